"""The stale-release race, through the real server: a streamed turn cut
mid-stream, the next turn sent at once on another connection, and then the
cut turn's leftovers collected. Only the turn that began may settle it: the
late cleanup of the cut turn must not end the next one, so a third turn is
refused (409) while the second runs, the second commits, and the history
is exactly the committed turns, in order. Its KV pin is settled on every
path: deleting the session leaves no block pinned."""

from __future__ import annotations

import gc
import json

import httpx
import torch
import trio

from tests.http.conftest import assert_error, eventually, make_settings, metrics, start_server
from tests.http.test_server import raw_post
from tests.http.test_session_commit_points import call, events, http_scope
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
