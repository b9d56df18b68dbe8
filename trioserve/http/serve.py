"""Running the app under hypercorn inside our own trio.run, with draining:
on SIGINT or SIGTERM /health turns to 503 "draining", new requests get 503,
requests in flight finish (bounded by the drain timeout), then the process
exits 0."""

from __future__ import annotations

import signal
import sys

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from trioserve.config import ServerSettings
from trioserve.http.app import create_app


async def _drain_on_signal(app, settings: ServerSettings) -> None:
    """hypercorn's shutdown trigger: returns once a signal came and no HTTP
    request is left in flight (or the drain timeout passed)."""
    state = app.extensions["trioserve"]
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"trioserve: {signal.Signals(signum).name} received, draining (up to {settings.drain_timeout_s:g} s)", file=sys.stderr, flush=True)
            break
    state.phase = "draining"
    # Wait for every HTTP request in flight to have sent its last byte (new
    # ones are refused with 503 and finish at once).
    with trio.move_on_after(settings.drain_timeout_s):
        await state.requests.wait_idle()


async def serve_app(settings: ServerSettings, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    app = create_app(settings)
    config = HypercornConfig()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.loglevel = settings.log_level.upper()
    config.graceful_timeout = 2.0
    config.accesslog = None
    await serve(app, config, shutdown_trigger=lambda: _drain_on_signal(app, settings), task_status=task_status)


def run_server(settings: ServerSettings) -> int:
    trio.run(serve_app, settings)
    return 0
