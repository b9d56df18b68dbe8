"""`trioserve serve` as a real process: SIGTERM drains (requests in flight
finish, /health says draining, new requests get 503) and the process exits 0;
a bad option is a usage error.

The tiny model generates ~700 tokens a second, so one request cannot run for
long (its context is 256 tokens). To keep the drain open for a few seconds
(long enough for the checks below even on a loaded two-core machine), the
server gets --max-num-seqs 1 and eight streams: one decoding when SIGTERM
arrives, seven waiting behind it. All eight must finish normally."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import httpx
import trio

from tests.http.conftest import SSE, metrics, read_sse

MAX_TOKENS = 200
STREAMS = 8
DRAIN_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "trioserve.cli", "serve", *args]


async def test_sigterm_drains_then_exits_zero(tiny_gguf):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = serve_command(
        "--model", str(tiny_gguf), "--dtype", "float32", "--port", str(port), "--kv-cache-bytes", "1MiB",
        "--max-num-seqs", "1", "--served-model-name", "tiny", "--drain-timeout", str(DRAIN_TIMEOUT), "--log-level", "warning",
    )
    stderr = bytearray()
    proc = await trio.lowlevel.open_process(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with trio.open_nursery() as nursery:

            async def drain_stderr():
                async for data in proc.stderr:
                    stderr.extend(data)

            nursery.start_soon(drain_stderr)
            with trio.fail_after(150):
                await _wait_up(url, proc, stderr)
                await _drain_scenario(url, proc)
                with trio.fail_after(DRAIN_TIMEOUT + 5):
                    code = await proc.wait()
                assert code == 0, f"exit status {code}; stderr: {stderr.decode()[-2000:]}"
    except BaseException as failure:
        failure.add_note(f"server stderr: {stderr.decode(errors='replace')[-4000:]}")
        raise
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.move_on_after(10):
                await proc.wait()
    text = stderr.decode(errors="replace")
    assert "SIGTERM received, draining" in text, text[-2000:]
    assert "Traceback" not in text, text[-4000:]


async def _wait_up(url: str, proc: trio.Process, stderr: bytearray) -> None:
    """Poll /health until 200, failing at once if the process exits."""
    with trio.move_on_after(30):
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(5.0)) as client:
            while proc.returncode is None:
                try:
                    health = await client.get("/health")
                    if health.status_code == 200:
                        assert health.json() == {"status": "ok"}, health.text
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.05)
    raise AssertionError(f"the server did not come up (exit status {proc.returncode}); stderr: {stderr.decode(errors='replace')[-2000:]}")


async def _drain_scenario(url: str, proc: trio.Process) -> None:
    streams: dict[int, SSE] = {}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0)) as client:

        async def one(i: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"stream {i}"}],
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                task_status.started()
                streams[i] = await read_sse(response)

        async with trio.open_nursery() as nursery:
            await nursery.start(one, 0)  # headers arrive once its first event exists: it is running
            for i in range(1, STREAMS):
                nursery.start_soon(one, i)

            async def queued() -> bool:
                m = await metrics(client)
                return (m["running"], m["waiting"]) == (1, STREAMS - 1)

            with trio.fail_after(15):
                while not await queued():
                    await trio.sleep(0.005)
            proc.send_signal(signal.SIGTERM)

            with trio.fail_after(30):
                while True:
                    health = await client.get("/health")
                    if health.status_code != 200:
                        break
                    await trio.sleep(0.005)
            assert health.status_code == 503 and health.json() == {"status": "draining"}, health.text
            late = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "late"}], "max_tokens": 2})
            assert late.status_code == 503, late.text
            assert late.headers.get("connection") == "close", late.headers  # the unread body ends the connection
            error = late.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "shutting_down" and "shutting down" in error["message"], error
            m = await metrics(client)
            assert m["running"] + m["waiting"] >= 1, f"the drain was over before the checks ran: {m}"

    for i in range(STREAMS):
        sse = streams[i]
        assert sse.payloads[-1] == "[DONE]", f"stream {i} was cut: {sse.payloads[-2:]}"
        finishes = [c["finish_reason"] for c in sse.choice_chunks()]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1]), f"stream {i}: {finishes[-3:]}"
        usage = sse.chunks[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS, f"stream {i}: {json.dumps(usage)}"


async def test_bogus_option_is_a_usage_error():
    with trio.fail_after(30):
        result = await trio.run_process(serve_command("--bogus"), capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 2, result
    assert b"unrecognized arguments: --bogus" in result.stderr, result.stderr
    assert b"Traceback" not in result.stderr
