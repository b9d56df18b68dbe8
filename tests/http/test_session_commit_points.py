"""A streamed session turn commits exactly when its final response is chosen.

The client leaves at each point of a streamed turn: before the first token,
after the last token but before the final chunk, and right after the final
chunk (mid-stream is in test_sessions). Only the last commits.

To leave at an exact chunk, the test is the ASGI server here: it calls the
real app (engine, scheduler, sessions, all real) with its own `send`, which
stops at the chosen chunk (as a stalled socket would) and tells the app the
client disconnected, the way hypercorn does. Over TCP the last token and the
final chunk leave in the same write, so no client could aim between them."""

from __future__ import annotations

import json

import pytest
import torch
import trio

from tests.http.conftest import make_settings
from trioserve.http.app import create_app
from trioserve.models.checkpoint import load_checkpoint

MAX_TOKENS = 5
SETTINGS = {"temperature": 0.8, "seed": 5, "max_tokens": MAX_TOKENS, "ignore_eos": True}


async def call(app, method: str, path: str, body: dict | None = None, *, stop_at=None) -> tuple[int, list[bytes]]:
    """One request through the app's ASGI interface: the status and the body
    chunks sent. ``stop_at(chunks)`` is asked after each body chunk; when it
    says yes, that chunk is the last the client gets: the send stalls and
    the client is gone."""
    data = json.dumps(body).encode() if body is not None else b""
    scope = http_scope(method, path, data)
    gone = trio.Event()
    sent_body = False
    status = 0
    chunks: list[bytes] = []

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            if gone.is_set():
                await trio.sleep_forever()  # the socket is dead: nothing more goes out
            if message.get("body"):
                chunks.append(message["body"])
                if stop_at is not None and stop_at(chunks):
                    gone.set()
                    await trio.sleep_forever()

    with trio.fail_after(30):
        await app(scope, receive, send)
    return status, chunks


def http_scope(method: str, path: str, data: bytes) -> dict:
    """The ASGI scope of a request with a JSON body of ``data``."""
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"test"), (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "extensions": {},
    }  # fmt: skip


def events(chunks: list[bytes]) -> list[dict | str]:
    payloads = []
    for line in b"".join(chunks).decode().splitlines():
        if line.startswith("data: "):
            text = line.removeprefix("data: ")
            payloads.append(text if text == "[DONE]" else json.loads(text))
    return payloads


def finished(chunks: list[bytes]) -> bool:
    return any(isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"] for e in events(chunks))


@pytest.fixture
async def app(tiny_gguf):
    checkpoint = load_checkpoint(tiny_gguf, dtype=torch.float32)
    app = create_app(make_settings(tiny_gguf), checkpoint=checkpoint)
    async with app.test_app():
        yield app


async def session_state(app, sid: str) -> dict:
    for _ in range(200):  # the turn lets go of the session when its body is closed
        status, chunks = await call(app, "GET", f"/v1/sessions/{sid}")
        assert status == 200
        state = json.loads(b"".join(chunks))
        if not state["busy"]:
            return state
        await trio.sleep(0.01)
    raise AssertionError(f"session {sid} stayed busy")


def token_chunks(chunks: list[bytes]) -> int:
    """Chunks that carry one generated token (not the role chunk, not the final one)."""
    count = 0
    for e in events(chunks):
        if isinstance(e, dict) and e["choices"]:
            choice = e["choices"][0]
            if "role" not in choice["delta"] and choice["finish_reason"] is None:
                count += 1
    return count


POINTS = {
    "before the first token": (lambda chunks: True, False),
    "after the last token, before the final chunk": (lambda chunks: token_chunks(chunks) == MAX_TOKENS, False),
    "right after the final chunk": (finished, True),
}


@pytest.mark.parametrize("point", list(POINTS))
async def test_a_turn_commits_exactly_when_its_final_chunk_is_chosen(app, point):
    stop_at, commits = POINTS[point]
    status, chunks = await call(app, "POST", "/v1/sessions", SETTINGS)
    assert status == 200
    sid = json.loads(b"".join(chunks))["id"]
    status, chunks = await call(app, "POST", f"/v1/sessions/{sid}/turns", {"messages": [{"role": "user", "content": "first"}]})
    assert status == 200
    before = await session_state(app, sid)
    assert before["turns"] == 1

    body = {"messages": [{"role": "user", "content": "second"}], "stream": True}
    status, chunks = await call(app, "POST", f"/v1/sessions/{sid}/turns", body, stop_at=stop_at)
    assert status == 200 and events(chunks)[-1] != "[DONE]"
    after = await session_state(app, sid)
    metrics = json.loads(b"".join((await call(app, "GET", "/metrics"))[1]))["sessions"]
    if commits:
        assert after["turns"] == 2 and after["draw_index"] == before["draw_index"] + MAX_TOKENS
        assert after["messages"][-1]["role"] == "assistant" and after["messages"][-2] == {"role": "user", "content": "second"}
        assert (metrics["turns_committed"], metrics["turns_cancelled"]) == (2, 0)
    else:
        assert {k: after[k] for k in ("turns", "draw_index", "messages", "usage")} == {
            k: before[k] for k in ("turns", "draw_index", "messages", "usage")
        }
        assert (metrics["turns_committed"], metrics["turns_cancelled"]) == (1, 1)
    # Either way the next turn starts from the committed state and runs normally.
    status, chunks = await call(app, "POST", f"/v1/sessions/{sid}/turns", {"messages": [{"role": "user", "content": "third"}]})
    assert status == 200 and (await session_state(app, sid))["turns"] == after["turns"] + 1
