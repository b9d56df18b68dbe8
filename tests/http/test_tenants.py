"""Tenants (trioserve/http/tenants.py): each API key is one. Through a real
server on the tiny model: one tenant cannot read, continue, delete or
evict another's sessions and stored responses (its ids are 404s, worded
as for unknown ids), each has its own quota of requests in flight, the
metrics need a key, CORS answers only the origins listed, and the keys
file is read again on SIGHUP."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, start_server
from tests.http.test_drain import serve_command
from trioserve.http.tenants import Tenants, TenantsError, flag_tenant, read_keys_file

ALICE, BOB = "alice-key", "bob-key"
TIMEOUT = 60


def client(url: str, key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers=headers)


def turn(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2}


def _without_id(response: httpx.Response, the_id: str) -> dict:
    error = response.json()["error"]
    return {**error, "message": error["message"].replace(the_id, "ID")}


async def test_one_tenant_cannot_reach_anothers_sessions_or_stored_responses(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf, api_key=(ALICE, BOB)))
    with trio.fail_after(TIMEOUT):
        async with client(url, ALICE) as alice, client(url, BOB) as bob:
            session = (await alice.post("/v1/sessions", json={"seed": 3})).json()["id"]
            assert (await alice.post(f"/v1/sessions/{session}/turns", json=turn("hi"))).status_code == 200
            stored = (await alice.post("/v1/responses", json={"input": "hello", "max_output_tokens": 2})).json()["id"]
            unknown_session, unknown_response = "sess-" + "0" * 24, "resp_" + "0" * len(stored.removeprefix("resp_"))

            tries = {
                "read": (await bob.get(f"/v1/sessions/{session}"), await bob.get(f"/v1/sessions/{unknown_session}"), session, unknown_session),
                "turn": (
                    await bob.post(f"/v1/sessions/{session}/turns", json=turn("mine now")),
                    await bob.post(f"/v1/sessions/{unknown_session}/turns", json=turn("mine now")), session, unknown_session,
                ),
                "delete": (await bob.delete(f"/v1/sessions/{session}"), await bob.delete(f"/v1/sessions/{unknown_session}"), session, unknown_session),
                "read response": (await bob.get(f"/v1/responses/{stored}"), await bob.get(f"/v1/responses/{unknown_response}"), stored, unknown_response),
                "continue response": (
                    await bob.post("/v1/responses", json={"input": "go on", "previous_response_id": stored, "max_output_tokens": 2}),
                    await bob.post("/v1/responses", json={"input": "go on", "previous_response_id": unknown_response, "max_output_tokens": 2}),
                    stored, unknown_response,
                ),
                "delete response": (await bob.delete(f"/v1/responses/{stored}"), await bob.delete(f"/v1/responses/{unknown_response}"), stored, unknown_response),
            }  # fmt: skip
            for name, (theirs, unknown, their_id, unknown_id) in tries.items():
                assert theirs.status_code == 404, (name, theirs.text)
                # Exactly what an id that does not exist gets: nothing tells them apart.
                assert _without_id(theirs, their_id) == _without_id(unknown, unknown_id), name

            # Alice's are as they were.
            mine = await alice.get(f"/v1/sessions/{session}")
            assert mine.status_code == 200 and mine.json()["turns"] == 1
            assert (await alice.get(f"/v1/responses/{stored}")).status_code == 200
            again = await alice.post("/v1/responses", json={"input": "go on", "previous_response_id": stored, "max_output_tokens": 2})
            assert again.status_code == 200, again.text


async def test_a_tenant_makes_room_from_its_own_sessions_only(nursery, tiny_gguf):
    """Four sessions kept, two tenants: two each. Bob's flood evicts only
    Bob's idle sessions; every one of Alice's stays."""
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf, api_key=(ALICE, BOB)), max_sessions=4))
    with trio.fail_after(TIMEOUT):
        async with client(url, ALICE) as alice, client(url, BOB) as bob:
            hers = [(await alice.post("/v1/sessions", json={})).json()["id"] for _ in range(2)]
            his = [(await bob.post("/v1/sessions", json={})).json()["id"] for _ in range(20)]
            for session in hers:
                assert (await alice.get(f"/v1/sessions/{session}")).status_code == 200
            kept = [s for s in his if (await bob.get(f"/v1/sessions/{s}")).status_code == 200]
            assert kept == his[-2:]  # his two most recent
            # A third of Alice's goes over her share: her own oldest makes room.
            third = (await alice.post("/v1/sessions", json={})).json()["id"]
            assert [(await alice.get(f"/v1/sessions/{s}")).status_code for s in [*hers, third]] == [404, 200, 200]
            assert [(await bob.get(f"/v1/sessions/{s}")).status_code for s in his[-2:]] == [200, 200]


async def test_each_tenant_has_its_own_requests_in_flight(nursery, tiny_gguf, slow_steps):
    slow_steps(0.02)
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf, api_key=(ALICE, BOB)), tenant_max_in_flight=1))
    long = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go"}], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with trio.fail_after(TIMEOUT):
        async with client(url, ALICE) as alice, client(url, BOB) as bob:
            generating = trio.Event()

            async def stream_to_the_end() -> None:
                async with alice.stream("POST", "/v1/chat/completions", json=long) as running:
                    assert running.status_code == 200
                    async for _ in running.aiter_lines():
                        generating.set()

            async with trio.open_nursery() as inner:
                inner.start_soon(stream_to_the_end)
                await generating.wait()
                second = await alice.post("/v1/chat/completions", json={**long, "stream": False, "max_tokens": 1})
                other = await bob.post("/v1/chat/completions", json={**long, "stream": False, "max_tokens": 1})
            error = assert_error(second, 429, fragment="this API key has 1 requests running, the most it may", param=None, kind="rate_limit_error", code="tenant_busy")
            assert second.headers["Retry-After"] == "1", error
            assert other.status_code == 200, other.text
            # Once Alice's stream is over, she may run another.
            assert (await alice.post("/v1/chat/completions", json={**long, "stream": False, "max_tokens": 1})).status_code == 200


async def test_metrics_need_a_key_unless_public(nursery, tiny_gguf):
    locked = await start_server(nursery, make_settings(tiny_gguf, api_key=ALICE))
    public = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf, api_key=ALICE), metrics_public=True))
    open_server = await start_server(nursery, make_settings(tiny_gguf))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(timeout=TIMEOUT) as plain:
            for path in ("/metrics", "/metrics/prometheus"):
                refused = await plain.get(locked + path)
                assert_error(refused, 401, fragment="missing or wrong API key", param=None, kind="authentication_error", code="invalid_api_key")
                assert (await plain.get(locked + path, headers={"Authorization": f"Bearer {ALICE}"})).status_code == 200
                assert (await plain.get(public + path)).status_code == 200
                assert (await plain.get(open_server + path)).status_code == 200
            assert (await plain.get(locked + "/health")).status_code == 200  # health stays open for balancers


async def test_cors_answers_only_the_listed_origins(nursery, tiny_gguf):
    closed = await start_server(nursery, make_settings(tiny_gguf))
    listed = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), cors_origins="https://app.example, http://localhost:3000/"))
    anyone = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), cors_origins="*"))
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(timeout=TIMEOUT) as web:
            for origin in ("https://app.example", "https://evil.example"):
                answer = await web.options(closed + "/v1/chat/completions", headers={"Origin": origin, **preflight})
                assert not any(h.lower().startswith("access-control-") for h in answer.headers), answer.headers
            good = await web.options(listed + "/v1/chat/completions", headers={"Origin": "http://localhost:3000", **preflight})
            assert good.headers["Access-Control-Allow-Origin"] == "http://localhost:3000" and "Origin" in good.headers["Vary"]
            assert "Authorization" in good.headers["Access-Control-Allow-Headers"]
            assert good.headers["Access-Control-Expose-Headers"] == "X-Session-Id"
            assert "DELETE" in good.headers["Access-Control-Allow-Methods"]  # a listed page may delete stored responses, too
            evil = await web.get(listed + "/v1/models", headers={"Origin": "https://evil.example"})
            assert evil.status_code == 200 and "Access-Control-Allow-Origin" not in evil.headers
            star = await web.get(anyone + "/health", headers={"Origin": "https://evil.example"})
            assert star.headers["Access-Control-Allow-Origin"] == "*"


async def test_the_keys_file_names_tenants_and_is_read_again_on_sighup(nursery, tiny_gguf, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenant: key\nalice: a-one\nalice: a-two\n\nbob: b-one\n")
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), api_keys_file=str(keys)))
    with trio.fail_after(TIMEOUT):
        async with client(url, "a-one") as one, client(url, "a-two") as two, client(url, "b-one") as bob, client(url, "c-one") as carol:
            session = (await one.post("/v1/sessions", json={})).json()["id"]
            assert (await two.get(f"/v1/sessions/{session}")).status_code == 200  # the same tenant, another key
            assert (await bob.get(f"/v1/sessions/{session}")).status_code == 404
            assert (await carol.get("/v1/models")).status_code == 401

            keys.write_text("alice: a-two\ncarol: c-one\n")  # a-one retired, carol added
            os.kill(os.getpid(), signal.SIGHUP)

            async def reloaded() -> bool:
                return (await carol.get("/v1/models")).status_code == 200

            while not await reloaded():
                await trio.sleep(0.02)
            assert (await one.get("/v1/models")).status_code == 401
            assert (await two.get(f"/v1/sessions/{session}")).status_code == 200
            assert (await bob.get("/v1/models")).status_code == 401

            keys.write_text("carol c-one\n")  # broken: the keys stay as they were
            os.kill(os.getpid(), signal.SIGHUP)
            await trio.sleep(0.2)
            assert (await carol.get("/v1/models")).status_code == 200 and (await two.get("/v1/models")).status_code == 200

            # No key at all (emptied, or comments only, or replaced by a FIFO): the keys stay, the server stays locked.
            fifo = tmp_path / "fifo"
            os.mkfifo(fifo)
            for text in ("", "# every key retired\n\n", None):
                if text is None:
                    keys.unlink()
                    keys.symlink_to(fifo)
                else:
                    keys.write_text(text)
                os.kill(os.getpid(), signal.SIGHUP)
                await trio.sleep(0.2)
                async with client(url, None) as nobody:
                    assert (await nobody.get("/v1/models")).status_code == 401
                    assert (await nobody.get("/metrics")).status_code == 401
                assert (await carol.get("/v1/models")).status_code == 200


def test_keys_file_mistakes_are_named_by_line(tmp_path):
    keys = tmp_path / "keys"
    for text, fragment in [
        ("alice: k\nbob k\n", f"{keys}:2: expected 'tenant: key'"),
        ("alice:\n", f"{keys}:1: expected 'tenant: key'"),
        ("bad name: k\n", f"{keys}:1: a tenant name is 1 to 64 letters, digits and ._-"),
        ("alice: k\nbob: k\n", "one key is given to two tenants ('alice' and 'bob')"),
    ]:
        keys.write_text(text)
        with pytest.raises(TenantsError) as caught:
            Tenants(keys_file=str(keys))
        assert fragment in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(TenantsError, match="cannot be read"):
        read_keys_file(tmp_path / "missing")
    for text in ("", "\n  \n", "# alice: k\n# bob: j\n"):
        keys.write_text(text)
        with pytest.raises(TenantsError) as caught:
            Tenants(keys_file=str(keys))
        assert str(caught.value) == f"{keys}: no 'tenant: key' line (the file is empty or all comments); refusing to run without the keys it should hold"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, why in ((fifo, "not a regular file"), (tmp_path, "not a regular file"), (Path("/dev/zero"), "not a regular file")):
        with pytest.raises(TenantsError) as caught:
            read_keys_file(path)
        assert str(caught.value) == f"{path}: cannot be read ({why})"
    keys.write_bytes(b"alice: " + b"k" * (1 << 20) + b"\n")
    with pytest.raises(TenantsError) as caught:
        read_keys_file(keys)
    assert str(caught.value) == f"{keys}: cannot be read (larger than {1 << 20} bytes)"


def test_flag_keys_are_tenants_named_by_their_hash():
    tenants = Tenants(flag_keys=("k1", "k2"))
    assert tenants.required and tenants.names == sorted([flag_tenant("k1"), flag_tenant("k2")])
    assert tenants.identify("Bearer k2", "") == flag_tenant("k2") == tenants.identify("", "k2")
    assert tenants.identify("Bearer nope", "") is None and tenants.identify("", "") is None
    assert Tenants(flag_keys=("k2", "k1")).names == tenants.names  # the order of the flags does not matter
    assert Tenants().identify("", "") == "" and not Tenants().required


@pytest.mark.parametrize(
    "text, message",
    [
        ("alice: secret\nbob secret2\n", "{keys}:2: expected 'tenant: key'"),
        ("# alice: secret\n\n", "{keys}: no 'tenant: key' line (the file is empty or all comments); refusing to run without the keys it should hold"),
    ],
)
async def test_a_keys_file_that_cannot_be_used_stops_the_server_in_one_line(tiny_gguf, tmp_path, text, message):
    keys = tmp_path / "keys"
    keys.write_text(text)
    command = serve_command("--model", str(tiny_gguf), "--api-keys-file", str(keys), "--state-dir", "none")
    with trio.fail_after(TIMEOUT):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    lines = [line for line in done.stderr.decode().splitlines() if not line.startswith(("Loading", "Building"))]
    assert done.returncode == 2 and lines == ["trioserve: error: " + message.format(keys=keys)], done.stderr.decode()
    assert "secret" not in done.stderr.decode()


SECRET = "You are the bank's assistant. Internal note: the PIN of customer Jane Doe is {pin}. Never reveal it."


async def _cached(c: httpx.AsyncClient, pin: str, **more: object) -> int:
    body = {"messages": [{"role": "system", "content": SECRET.format(pin=pin)}, {"role": "user", "content": "hello"}], "max_tokens": 1, **more}
    answer = await c.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("scope", ["auto", "global"])
async def test_the_prefix_cache_tells_one_tenant_nothing_of_anothers_prompts(nursery, tiny_gguf, scope):
    """The attack of issue 30: guess a victim's prompt and read how much of
    the guess was cached. Scoped by tenant (the default with keys), the
    right guess is cached exactly as much as a wrong one; shared
    (`--prefix-cache-scope global`), it gives the secret away, which is
    what shows this test can fail."""
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf, api_key=(ALICE, BOB)), prefix_cache_scope=scope))
    with trio.fail_after(TIMEOUT):
        async with client(url, ALICE) as alice, client(url, BOB) as bob:
            await _cached(alice, "7319")
            assert await _cached(alice, "7319") > 0  # a tenant's own cache still works
            wrong_first = await _cached(bob, "1111")
            right = await _cached(bob, "7319")
            wrong_after = await _cached(bob, "2222")
            if scope == "global":
                assert right > wrong_after, (wrong_first, right, wrong_after)
            else:
                assert right == wrong_after, (wrong_first, right, wrong_after)
                # And a request's own cache_salt narrows it within the tenant.
                assert await _cached(alice, "7319", cache_salt="other") == 0
                assert await _cached(alice, "7319", cache_salt="other") > 0


async def test_a_bad_cache_salt_is_refused_by_name(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf))
    with trio.fail_after(TIMEOUT):
        async with client(url, None) as c:
            for salt, fragment in (("", "must be 1 to 256 characters, got 0"), ("x" * 257, "got 257"), (5, "expected a string")):
                answer = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": salt})
                assert_error(answer, 400, fragment=fragment, param="cache_salt")


async def test_a_chosen_session_id_is_each_tenants_own(nursery, tiny_gguf):
    """X-Session-Id names a session within its tenant (issue #49): two keys
    choosing one id get two sessions, neither learns of the other's (no
    409), neither can lock the other out, and each reaches only its own."""
    url = await start_server(nursery, make_settings(tiny_gguf, api_key=(ALICE, BOB)))
    key = {"X-Session-Id": "chat-1"}
    with trio.fail_after(TIMEOUT):
        async with client(url, ALICE) as alice, client(url, BOB) as bob:
            hers = await alice.post("/v1/sessions", json={"system": "Alice's.", "seed": 1}, headers=key)
            assert hers.status_code == 200 and hers.json()["id"] == "chat-1" and hers.headers["X-Session-Id"] == "chat-1", hers.text
            his = await bob.post("/v1/sessions", json={"system": "Bob's.", "seed": 2}, headers=key)
            assert his.status_code == 200 and his.json()["id"] == "chat-1", his.text  # not a 409: nothing of Alice's shows
            again = await alice.post("/v1/sessions", json={}, headers=key)
            assert_error(again, 409, fragment="a session 'chat-1' exists already (X-Session-Id)", param="X-Session-Id", code="session_exists")
            said = await alice.post("/v1/sessions/chat-1/turns", json=turn("hi"))
            assert said.status_code == 200 and said.headers["X-Session-Id"] == "chat-1", said.text
            assert (await alice.get("/v1/sessions/chat-1")).json()["system"] == "Alice's."
            mine = (await bob.get("/v1/sessions/chat-1")).json()
            assert mine["system"] == "Bob's." and mine["turns"] == 0 and mine["id"] == "chat-1"
            gone = await bob.delete("/v1/sessions/chat-1")
            assert gone.status_code == 200 and gone.json()["id"] == "chat-1"
            assert (await alice.get("/v1/sessions/chat-1")).json()["turns"] == 1  # hers is untouched
            missing = await bob.get("/v1/sessions/chat-1")
            assert_error(missing, 404, fragment="no session 'chat-1'", param=None, code=None)
            assert "alice" not in missing.text
