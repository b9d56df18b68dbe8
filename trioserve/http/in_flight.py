"""ASGI middleware counting the HTTP requests in flight, up to their last
byte, so that the drain on shutdown can wait for every response to be
finished instead of cutting it. (The write deadline that used to live here
is applied where the socket write happens: trioserve/http/transport.py.)

It also tells whoever asked (`at_request_end`) that a request is over,
however it ended: its last byte sent, the client gone, or the response cut
before its body ever started (then no body generator runs its cleanup)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import trio

# The callbacks of the HTTP request the current task serves.
_AT_END: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar("trioserve_at_request_end", default=None)


def at_request_end(callback: Callable[[], None]) -> bool:
    """Call ``callback()`` (synchronous, must not raise) once the current
    HTTP request is over, in the task that served it. False, and nothing
    registered, outside a request served through InFlight."""
    callbacks = _AT_END.get()
    if callbacks is None:
        return False
    callbacks.append(callback)
    return True


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
        callbacks: list[Callable[[], None]] = []
        token = _AT_END.set(callbacks)
        try:
            await self.app(scope, receive, send)
        finally:
            _AT_END.reset(token)
            for callback in callbacks:
                callback()
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
