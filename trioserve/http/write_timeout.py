"""ASGI middleware between hypercorn and the app, for two things the app
cannot see from inside a handler.

- A write deadline. A client that stops reading but keeps its socket open
  never disconnects: the server's sends just stop completing once the
  buffers fill. Every send gets a deadline; when one passes, the send raises
  trio.TooSlowError inside the handler, which unwinds like a disconnect and
  cancels the request in the engine.
- The count of HTTP requests in flight, up to their last byte. The drain on
  shutdown waits for it to reach zero, so no response is cut."""

from __future__ import annotations

import trio


class WriteTimeout:
    """Wraps an ASGI app so each ``send`` must finish within ``seconds``;
    ``in_flight`` counts HTTP requests the app has not finished answering."""

    def __init__(self, app, seconds: float) -> None:
        self.app = app
        self.seconds = seconds
        self.in_flight = 0
        self._idle = trio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no HTTP request is in flight."""
        while self.in_flight:
            await self._idle.wait()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seconds = self.seconds

        async def send_with_deadline(message) -> None:
            with trio.fail_after(seconds):
                await send(message)

        self.in_flight += 1
        if self.in_flight == 1:
            self._idle = trio.Event()
        try:
            await self.app(scope, receive, send_with_deadline)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
