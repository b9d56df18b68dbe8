"""The write deadline: a send that does not complete in time raises inside
the app (which then unwinds as on a disconnect); sends that complete pass
through untouched. The ASGI server is the boundary here, so its ``send`` is
played by the test."""

from __future__ import annotations

import pytest
import trio

from trioserve.http.write_timeout import WriteTimeout


async def test_stalled_send_raises_inside_the_app(autojump_clock):
    seen: list[str] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start"})
        try:
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        except trio.TooSlowError:
            seen.append("timed out")
            raise

    delivered = []

    async def server_send(message):
        if message["type"] == "http.response.body":
            await trio.sleep_forever()  # the client stopped reading
        delivered.append(message["type"])

    with pytest.raises(trio.TooSlowError):
        await WriteTimeout(app, 5.0)({"type": "http"}, None, server_send)
    assert seen == ["timed out"] and delivered == ["http.response.start"]
    assert trio.current_time() == pytest.approx(5.0)


async def test_sends_that_complete_pass_through(autojump_clock):
    async def app(scope, receive, send):
        for i in range(3):
            await send({"n": i})

    delivered = []

    async def server_send(message):
        await trio.sleep(1.0)  # slow but under the deadline each time
        delivered.append(message["n"])

    await WriteTimeout(app, 2.0)({"type": "http"}, None, server_send)
    assert delivered == [0, 1, 2]


async def test_non_http_scopes_are_not_wrapped():
    calls = []

    async def app(scope, receive, send):
        calls.append(send)

    async def server_send(message):
        return None

    await WriteTimeout(app, 1.0)({"type": "lifespan"}, None, server_send)
    assert calls == [server_send]
