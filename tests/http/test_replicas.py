"""Two `trioserve serve` processes behind a real nginx on 127.0.0.1, with
the configuration docs/scaling.md gives (written from the same template):
a conversation keyed by X-Session-Id stays on one replica, stateless
requests spread over both; with a shared PostgreSQL state store, the
other replica continues a conversation whose replica was killed. Skipped,
saying why, where nginx (or PostgreSQL) is not installed (`make test`
installs Debian's packages where it can)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import trio

from tests.http.test_drain import free_port
from tests.http.test_durable import Server, healthy, turn

TIMEOUT = 180
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: apt-get install nginx; make test does it as root)")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"


def nginx_conf(port: int, replicas: list[int], prefix: Path) -> str:
    """docs/scaling.md's http block, for ``replicas`` on 127.0.0.1, run from ``prefix``."""
    text = DOCS.read_text(encoding="utf-8")
    block = text.split("```nginx\n", 1)[1].split("```", 1)[0]
    servers = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=5s;\n" for p in replicas)
    block = block.replace("    server 10.0.0.1:8000 max_fails=1 fail_timeout=5s;\n    server 10.0.0.2:8000 max_fails=1 fail_timeout=5s;\n", servers)
    block = block.replace("listen 80;", f"listen 127.0.0.1:{port};")
    assert f"127.0.0.1:{replicas[1]}" in block and f"listen 127.0.0.1:{port}" in block, "docs/scaling.md's example changed shape"
    temp = "".join(f"    {name}_temp_path {prefix}/{name};\n" for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (
        f"daemon off;\nworker_processes 1;\npid {prefix}/nginx.pid;\nerror_log {prefix}/error.log;\nuser root;\n"
        f"events {{}}\nhttp {{\n    access_log off;\n{temp}{block}}}\n"
    )


@contextlib.asynccontextmanager
async def balanced(replicas: list[Server], tmp_path: Path):
    """``replicas`` started, behind nginx with docs/scaling.md's block: its URL.
    Everything stops on the way out."""
    port = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_conf(port, [r.port for r in replicas], tmp_path))
    url = f"http://127.0.0.1:{port}"
    nginx = None
    try:
        for replica in replicas:
            await replica.start()
        nginx = await trio.lowlevel.open_process([NGINX, "-p", str(tmp_path), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await healthy(url, nginx)
        yield url
    finally:
        if nginx is not None:
            nginx.send_signal(signal.SIGQUIT)
            with trio.move_on_after(10):
                await nginx.wait()
            if nginx.returncode is None:
                nginx.kill()
        for replica in replicas:
            if replica.proc is not None and replica.proc.returncode is None:
                await replica.stop(signal.SIGTERM)


async def finished(client: httpx.AsyncClient, replica: Server) -> int:
    """Requests ``replica`` has finished, whatever their end."""
    return sum((await client.get(f"{replica.url}/metrics")).json()["finished"].values())


async def test_conversations_stick_and_stateless_requests_spread(tiny_gguf, tmp_path):
    replicas = [Server(tiny_gguf, tmp_path / f"state{i}") for i in range(2)]
    with trio.fail_after(TIMEOUT):
        async with balanced(replicas, tmp_path) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                owners = set()
                for key in ("conv-alpha", "conv-beta", "conv-gamma", "conv-delta"):
                    made = await client.post("/v1/sessions", json={"seed": 1}, headers={"X-Session-Id": key})
                    assert made.status_code == 200, made.text
                    assert made.json()["id"] == key and made.headers["X-Session-Id"] == key
                    for text in ("one", "two"):
                        turn = await client.post(f"/v1/sessions/{key}/turns", json={"messages": [{"role": "user", "content": text}], "max_tokens": 3})
                        assert turn.status_code == 200, turn.text
                    holders = []
                    for replica in replicas:
                        direct = await client.get(f"{replica.url}/v1/sessions/{key}")
                        if direct.status_code == 200:
                            holders.append(replica.port)
                            assert direct.json()["turns"] == 2
                    assert len(holders) == 1, f"{key} is on {holders}"
                    owners.add(holders[0])
                    read = await client.get(f"/v1/sessions/{key}")
                    assert read.status_code == 200 and read.json()["turns"] == 2  # found through the balancer again

                async def ask(i: int) -> None:
                    body = {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 24, "ignore_eos": True}
                    response = await client.post("/v1/chat/completions", json=body)
                    assert response.status_code == 200, response.text

                async with trio.open_nursery() as nursery:
                    for i in range(12):
                        nursery.start_soon(ask, i)
                served = [await finished(client, replica) for replica in replicas]
            # Eight turns went to the conversations' owners; the twelve
            # stateless requests went to whichever replica had fewer.
            assert sum(served) == 8 + 12
            assert min(served) > 0, served


async def test_with_a_shared_store_another_replica_continues_a_killed_ones_conversation(tiny_gguf, tmp_path, postgres):
    replicas = [Server(tiny_gguf, postgres.url) for _ in range(2)]
    key = "conv-shared"
    with trio.fail_after(TIMEOUT):
        async with balanced(replicas, tmp_path) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                made = await client.post("/v1/sessions", json={"system": "Be brief.", "seed": 4}, headers={"X-Session-Id": key})
                assert made.status_code == 200, made.text
                for text in ("one", "two", "three"):
                    await turn(client, key, text)
                served = [await finished(client, replica) for replica in replicas]
                assert sorted(served) == [0, 3], served  # every turn on one replica
                owner, other = (replicas[0], replicas[1]) if served[0] else (replicas[1], replicas[0])
                before = (await client.get(f"/v1/sessions/{key}")).json()
                assert before["turns"] == 3

                owner.proc.kill()  # no drain, no goodbye
                await owner.proc.wait()
                history = [{"role": "system", "content": "Be brief."}, *before["messages"], {"role": "user", "content": "four"}]
                stateless = await client.post(
                    "/v1/chat/completions", json={"messages": history, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
                )
                # nginx finds the owner gone and sends the turn to the other,
                # which reads the session from the database and re-prefills it.
                assert await turn(client, key, "four") == stateless.json()["choices"][0]["message"]["content"]
                assert await finished(client, other) == 2
                after = (await client.get(f"{other.url}/v1/sessions/{key}")).json()
                assert after["messages"][: len(before["messages"])] == before["messages"]
                assert after["turns"] == 4 and after["draw_index"] >= before["draw_index"] and after["seed"] == before["seed"]
                assert (await client.post("/v1/sessions", json={}, headers={"X-Session-Id": key})).status_code == 409
