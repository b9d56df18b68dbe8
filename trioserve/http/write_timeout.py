"""A client that stops reading but keeps its socket open never disconnects:
the server's sends just stop completing once the buffers fill. This ASGI
middleware puts a deadline on every send; when one passes, the send raises
trio.TooSlowError inside the handler, which unwinds like a disconnect and
cancels the request in the engine."""

from __future__ import annotations

import trio


class WriteTimeout:
    """Wraps an ASGI app so each ``send`` must finish within ``seconds``."""

    def __init__(self, app, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seconds = self.seconds

        async def send_with_deadline(message) -> None:
            with trio.fail_after(seconds):
                await send(message)

        await self.app(scope, receive, send_with_deadline)
