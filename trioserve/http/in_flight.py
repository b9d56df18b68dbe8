"""ASGI middleware counting the HTTP requests in flight, up to their last
byte, so that the drain on shutdown can wait for every response to be
finished instead of cutting it. (The write deadline that used to live here
is applied where the socket write happens: trioserve/http/transport.py.)"""

from __future__ import annotations

import trio


class InFlight:
    """Wraps an ASGI app; ``in_flight`` counts HTTP requests the app has not
    finished answering, and ``wait_idle`` waits for it to reach zero."""

    def __init__(self, app) -> None:
        self.app = app
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
        self.in_flight += 1
        if self.in_flight == 1:
            self._idle = trio.Event()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
