"""The stale-release race, through the real server: a streamed turn cut
mid-stream, the next turn sent at once on another connection, and then the
cut turn's leftovers collected. Only the turn that began may settle it: the
late cleanup of the cut turn must not end the next one, so a third turn is
refused (409) while the second runs, the second commits, and the history
is exactly the committed turns, in order. Its KV pin is settled on every
path: deleting the session leaves no block pinned.

And the other ways a turn loses its client, each settled by the session
actor in its own task: a stream whose body never starts (no cleanup of its
own runs; the garbage collector is off), a handler that stops asking for
chunks, and the app stopping under a running turn."""

from __future__ import annotations

import gc
import json

import attrs
import httpx
import torch
import trio

from tests.http.conftest import assert_error, eventually, make_settings, metrics, start_server
from tests.http.test_server import raw_post
from tests.http.test_session_commit_points import call, events, http_scope
from trioserve.http import app as app_module
from trioserve.http.app import create_app
from trioserve.models.checkpoint import load_checkpoint

TIMEOUT = 30.0
ROUNDS = 4


async def _cut_turn(url: str, sid: str, content: str) -> None:
    """Start a streamed turn on a raw socket, read a few events, hang up."""
    body = {"messages": [{"role": "user", "content": content}], "stream": True}
    stream = await raw_post(url, f"/v1/sessions/{sid}/turns", body)
    async with stream:
        received = b""
        while received.count(b"data: ") < 3:
            data = await stream.receive_some()
            assert data, f"the server closed the stream early: {received[-300:]!r}"
            received += data
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received


async def test_a_cut_turns_late_cleanup_never_releases_the_next_turn(nursery, tiny_gguf, slow_steps):
    url = await start_server(nursery, make_settings(tiny_gguf))
    slow_steps(0.02)
    with trio.fail_after(120):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            created = await client.post("/v1/sessions", json={"temperature": 0, "max_tokens": 12, "ignore_eos": True})
            sid = created.json()["id"]
            committed: list[str] = []
            was_enabled = gc.isenabled()
            for round_ in range(ROUNDS):
                # The collector waits until B runs, as it may on a busy server.
                gc.disable()
                try:
                    await _cut_turn(url, sid, f"cut {round_}")
                except BaseException:
                    if was_enabled:
                        gc.enable()
                    raise
                # Turn B, at once: retried while the cut turn is still winding down.
                body = {"messages": [{"role": "user", "content": f"keep {round_}"}], "stream": True}
                while True:
                    async with client.stream("POST", f"/v1/sessions/{sid}/turns", json=body) as response:
                        if response.status_code == 409:
                            await response.aread()
                            await trio.sleep(0.005)
                            continue
                        assert response.status_code == 200, (await response.aread()).decode()
                        lines = response.aiter_lines()
                        first = await lines.__anext__()
                        assert first.startswith("data: ")
                        # B is running. Whatever is left of the cut turn is
                        # collected now: its cleanup must not touch B.
                        if was_enabled:
                            gc.enable()
                        gc.collect()
                        third = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "third"}]})
                        assert_error(third, 409, fragment="already has a turn running", param=None)
                        assert (await client.get(f"/v1/sessions/{sid}")).json()["busy"] is True
                        rest = [line async for line in lines]
                        assert "data: [DONE]" in rest, rest[-3:]
                        break
                committed.append(f"keep {round_}")
                state = (await client.get(f"/v1/sessions/{sid}")).json()
                assert state["busy"] is False and state["turns"] == round_ + 1
                assert [m["content"] for m in state["messages"] if m["role"] == "user"] == committed
            sessions = (await metrics(client))["sessions"]
            assert sessions["turns_committed"] == ROUNDS and sessions["busy"] == 0
            # Every provisional pin was settled: once the session is gone, nothing is pinned.
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200

            async def unpinned() -> str | None:
                cache = (await metrics(client))["prefix_cache"]
                return None if cache["pinned_blocks"] == 0 and cache["pinned_owners"] == 0 else f"still pinned: {cache}"

            await eventually(unpinned, timeout=10, what="no KV pinned after the session was deleted")


async def test_the_cut_turns_leftovers_going_late_leave_the_next_turn_alone(tiny_gguf):
    """The same race with its timing pinned down. The test is the ASGI
    server (as in test_session_commit_points). Turn A's connection closes
    after a few events: its ``send`` raises OSError, as the ASGI spec has a
    server do, and the error (with its traceback, and so A's response
    body) is held on to, as a server that logs it might. Turn B starts and
    pauses at its first chunk; only then is A's error let go and collected,
    with whatever finalizers A's body had. B must keep the session, a third
    turn must be refused, and B alone must commit."""
    app = create_app(make_settings(tiny_gguf), checkpoint=load_checkpoint(tiny_gguf, dtype=torch.float32))
    async with app.test_app():
        status, chunks = await call(app, "POST", "/v1/sessions", {"temperature": 0, "max_tokens": 6, "ignore_eos": True})
        sid = json.loads(b"".join(chunks))["id"]
        turn_path = f"/v1/sessions/{sid}/turns"
        cut = []

        async def a_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                cut.append(message["body"])
                if len(events(cut)) >= 3:
                    raise OSError("the client closed the connection")

        held: list[BaseException] = []
        try:
            await _asgi(app, turn_path, {"messages": [{"role": "user", "content": "cut"}], "stream": True}, a_send)
        except BaseException as exc:  # noqa: BLE001 - what a server might keep, to log it
            held.append(exc)
        assert len(events(cut)) == 3 and events(cut)[-1] != "[DONE]"
        await _wait_idle(app, sid)

        paused, resume = trio.Event(), trio.Event()
        seen: list[bytes] = []

        async def b_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                seen.append(message["body"])
                if len(seen) == 1:
                    paused.set()
                    await resume.wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_asgi, app, turn_path, {"messages": [{"role": "user", "content": "keep"}], "stream": True}, b_send)
            with trio.fail_after(30):
                await paused.wait()
            held.clear()
            gc.collect()  # whatever is left of A goes now, while B runs
            status, chunks = await call(app, "POST", turn_path, {"messages": [{"role": "user", "content": "third"}]})
            assert status == 409, b"".join(chunks)
            resume.set()
        assert events(seen)[-1] == "[DONE]", events(seen)[-3:]
        status, chunks = await call(app, "GET", f"/v1/sessions/{sid}")
        state = json.loads(b"".join(chunks))
        assert state["busy"] is False and state["turns"] == 1
        assert [m["content"] for m in state["messages"] if m["role"] == "user"] == ["keep"]


async def test_a_streamed_turn_whose_body_never_starts_is_cancelled_at_once(tiny_gguf, slow_steps):
    """The client goes while the response's head is being written, so the
    body generator is never started, and never closed: it runs no cleanup
    of its own. With the garbage collector off (nothing may wait for it),
    the session must be free again at once, nothing committed, the engine
    request cancelled rather than run to its end, and the next turn must
    run and commit."""
    app = create_app(make_settings(tiny_gguf), checkpoint=load_checkpoint(tiny_gguf, dtype=torch.float32))
    async with app.test_app():
        status, chunks = await call(app, "POST", "/v1/sessions", {"temperature": 0, "max_tokens": 200, "ignore_eos": True})
        sid = json.loads(b"".join(chunks))["id"]
        turn_path = f"/v1/sessions/{sid}/turns"
        slow_steps(0.02)  # 200 tokens would take 4 s or more
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            began = trio.current_time()
            status = await _gone_at_head(app, turn_path, {"messages": [{"role": "user", "content": "never read"}], "stream": True})
            assert status == 200
            await _wait_idle(app, sid)
            assert trio.current_time() - began < 2.0, "the session was freed only when the generation ended by itself"
            state = json.loads(b"".join((await call(app, "GET", f"/v1/sessions/{sid}"))[1]))
            assert state["turns"] == 0 and state["messages"] == [] and state["draw_index"] == 0
            for _ in range(200):  # the scheduler drops the request within one step
                metrics = json.loads(b"".join((await call(app, "GET", "/metrics"))[1]))
                if metrics["running"] == 0 and metrics["waiting"] == 0:
                    break
                await trio.sleep(0.01)
            assert metrics["finished"] == {"cancelled": 1}, metrics["finished"]
            assert (metrics["sessions"]["turns_committed"], metrics["sessions"]["turns_cancelled"]) == (0, 1)
        finally:
            if was_enabled:
                gc.enable()
        status, chunks = await call(app, "POST", turn_path, {"messages": [{"role": "user", "content": "again"}], "max_tokens": 3})
        assert status == 200, b"".join(chunks)
        state = json.loads(b"".join((await call(app, "GET", f"/v1/sessions/{sid}"))[1]))
        assert state["busy"] is False and state["turns"] == 1
        assert [m["content"] for m in state["messages"] if m["role"] == "user"] == ["again"]


async def test_stopping_the_app_cancels_a_running_turn(tiny_gguf, slow_steps):
    """The app stops while a streamed turn is under way (its client still
    connected, paused after the first chunk): the turn ends as on a
    disconnect, cancelled, with nothing committed."""
    app = create_app(make_settings(tiny_gguf), checkpoint=load_checkpoint(tiny_gguf, dtype=torch.float32))
    paused = trio.Event()
    seen: list[bytes] = []

    async def paused_send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            seen.append(message["body"])
            paused.set()
            await trio.sleep_forever()  # the client reads no further, and does not leave

    with trio.fail_after(30):
        async with trio.open_nursery() as client:
            async with app.test_app():
                status, chunks = await call(app, "POST", "/v1/sessions", {"temperature": 0, "max_tokens": 200, "ignore_eos": True})
                sid = json.loads(b"".join(chunks))["id"]
                status, chunks = await call(app, "POST", f"/v1/sessions/{sid}/turns", {"messages": [{"role": "user", "content": "kept"}], "max_tokens": 3})
                assert status == 200
                slow_steps(0.02)
                client.start_soon(_asgi, app, f"/v1/sessions/{sid}/turns", {"messages": [{"role": "user", "content": "cut"}], "stream": True}, paused_send)
                await paused.wait()
                store = app.extensions["trioserve"].sessions
                assert store.get(sid, trio.current_time()).busy
            client.cancel_scope.cancel()
    session = store._sessions[sid]
    assert not session.busy and session.turns == 1
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["kept"]
    assert (store.committed, store.cancelled) == (1, 1)


async def test_a_handler_that_stops_asking_loses_its_turn(tiny_gguf, monkeypatch):
    """A stream's client stops reading and never leaves (no transport here
    to time its writes out): the session actor waits for the next Pull at
    most the write timeout plus PULL_GRACE_S, then cancels the turn in its
    own task; the session is free and unchanged."""
    monkeypatch.setattr(app_module, "PULL_GRACE_S", 0.2)
    settings = attrs.evolve(make_settings(tiny_gguf), write_timeout_s=0.1)
    app = create_app(settings, checkpoint=load_checkpoint(tiny_gguf, dtype=torch.float32))
    stalled = trio.Event()

    async def stalling_send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            stalled.set()
            await trio.sleep_forever()

    async with app.test_app():
        status, chunks = await call(app, "POST", "/v1/sessions", {"temperature": 0, "max_tokens": 20, "ignore_eos": True})
        sid = json.loads(b"".join(chunks))["id"]
        with trio.fail_after(30):
            async with trio.open_nursery() as client:
                client.start_soon(_asgi, app, f"/v1/sessions/{sid}/turns", {"messages": [{"role": "user", "content": "stall"}], "stream": True}, stalling_send)
                await stalled.wait()
                began = trio.current_time()
                await _wait_idle(app, sid)
                assert trio.current_time() - began >= 0.25  # it waited for the handler first
                client.cancel_scope.cancel()
        state = json.loads(b"".join((await call(app, "GET", f"/v1/sessions/{sid}"))[1]))
        assert state["turns"] == 0 and state["messages"] == []
        metrics = json.loads(b"".join((await call(app, "GET", "/metrics"))[1]))["sessions"]
        assert (metrics["turns_committed"], metrics["turns_cancelled"]) == (0, 1)


async def _gone_at_head(app, path: str, body: dict) -> int:
    """POST ``body`` to ``path`` through the app's ASGI interface; the
    client disconnects while the response's head is being sent (that send
    never completes), before any of the body. The status it was sent."""
    data = json.dumps(body).encode()
    scope = http_scope("POST", path, data)
    delivered = False
    gone = trio.Event()
    status = 0

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        assert message["type"] == "http.response.start", f"the body started: {message!r}"
        status = message["status"]
        gone.set()
        await trio.sleep_forever()  # the socket is dead: the head never leaves

    with trio.fail_after(30):
        await app(scope, receive, send)
    return status


async def _wait_idle(app, sid: str) -> None:
    for _ in range(200):
        status, chunks = await call(app, "GET", f"/v1/sessions/{sid}")
        if not json.loads(b"".join(chunks))["busy"]:
            return
        await trio.sleep(0.01)
    raise AssertionError(f"session {sid} stayed busy")


async def _asgi(app, path: str, body: dict, send) -> None:
    """POST ``body`` to ``path`` through the app's ASGI interface with the
    caller's ``send``; the client never disconnects."""
    data = json.dumps(body).encode()
    scope = http_scope("POST", path, data)
    delivered = False
    forever = trio.Event()

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await forever.wait()
        return {"type": "http.disconnect"}

    with trio.fail_after(30):
        await app(scope, receive, send)


async def test_a_chat_stream_whose_body_never_starts_is_cancelled_at_once(tiny_gguf, slow_steps):
    """The same hostile client on a plain streamed chat completion: it goes
    while the head is written, the body generator never starts, and with
    the garbage collector off nothing else would ever close the request's
    events. The engine request must still end cancelled within a step or
    two, not run its 200 tokens."""
    app = create_app(make_settings(tiny_gguf), checkpoint=load_checkpoint(tiny_gguf, dtype=torch.float32))
    async with app.test_app():
        slow_steps(0.02)  # 200 tokens would take 4 s or more
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            began = trio.current_time()
            body = {"messages": [{"role": "user", "content": "never read"}], "stream": True, "max_tokens": 200, "ignore_eos": True}
            assert await _gone_at_head(app, "/v1/chat/completions", body) == 200
            for _ in range(200):
                metrics = json.loads(b"".join((await call(app, "GET", "/metrics"))[1]))
                if metrics["running"] == 0 and metrics["waiting"] == 0:
                    break
                await trio.sleep(0.01)
            assert metrics["finished"] == {"cancelled": 1}, metrics["finished"]
            assert trio.current_time() - began < 2.0, "the request ran until something else noticed"
        finally:
            if was_enabled:
                gc.enable()
