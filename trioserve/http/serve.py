"""Running the app under hypercorn inside our own trio.run, with draining:
on SIGINT or SIGTERM /health turns to 503 "draining", new requests get 503,
requests in flight finish (bounded by the drain timeout), then the process
exits 0. Connections go through trioserve.http.transport, which gives
every wait on a client a deadline (write, read, keep-alive), so a client
that never reads cannot hold the drain open."""

from __future__ import annotations

import signal
import sys
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.utils import LifespanFailureError

from trioserve.config import ServerSettings
from trioserve.errors import TrioserveError
from trioserve.kernels.cpu import resolve_dtype
from trioserve.http.app import create_app
from trioserve.http.transport import TransportLimits, serve_http
from trioserve.actors.device import without_openmp_helpers
from trioserve.models.checkpoint import load_checkpoint
from trioserve.progress import ProgressBar

# After the drain, requests still running get this long before they are cut
# (idle keep-alive connections close at once).
CUT_GRACE_S = 1.0


async def wait_for_signal() -> str:
    """Return the name of the first SIGINT or SIGTERM to arrive."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            return f"{signal.Signals(signum).name} received"
    raise AssertionError("a signal receiver never ends")


async def _drain(app, settings: ServerSettings, trigger: Callable[[], Awaitable[str | None]]) -> None:
    """The server's shutdown trigger: returns once ``trigger`` returned and no
    HTTP request is left in flight, or the drain timeout passed. Requests
    left then are cut by the transport (a stalled write included)."""
    state = app.extensions["trioserve"]
    why = await trigger()
    state.phase = "draining"
    print(f"trioserve: {why or 'shutting down'}, draining (up to {settings.drain_timeout_s:g} s)", file=sys.stderr, flush=True)
    # Wait for every HTTP request in flight to have sent its last byte (new
    # ones are refused with 503 and finish at once).
    with trio.move_on_after(settings.drain_timeout_s):
        while True:
            await state.requests.wait_idle()
            if all(s.running == 0 and s.waiting == 0 for s in (engine.statistics() for engine in state.engines())):
                break
            await trio.sleep(0.05)


def hypercorn_config(settings: ServerSettings) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.loglevel = settings.log_level.upper()
    config.graceful_timeout = CUT_GRACE_S
    config.keep_alive_timeout = settings.keep_alive_timeout_s
    config.accesslog = None
    return config


async def serve_app(
    settings: ServerSettings,
    *,
    checkpoint=None,
    shutdown_trigger: Callable[[], Awaitable[str | None]] = wait_for_signal,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Load the checkpoint (with progress), then serve it until
    ``shutdown_trigger`` returns (by default: SIGINT or SIGTERM) and the
    drain is over. A checkpoint that cannot be loaded raises CheckpointError
    before anything binds. A ``checkpoint`` already loaded (benchmarks
    serving it twice) is used as is. Reports the bound URLs through
    ``task_status``. Cancelled: connections are cut and the engine stops."""
    if checkpoint is None:
        progress = ProgressBar("Loading weights")
        checkpoint = await trio.to_thread.run_sync(
            without_openmp_helpers, lambda: load_checkpoint(settings.engine.model, dtype=resolve_dtype(settings.engine.dtype, settings.engine.device), progress=progress)
        )
        progress.finish(f" ({checkpoint.path})")
    app = create_app(settings, checkpoint=checkpoint)
    limits = TransportLimits(
        write_timeout_s=settings.write_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        send_buffer_bytes=settings.send_buffer_bytes,
    )
    await serve_http(
        app,
        hypercorn_config(settings),
        limits,
        shutdown_trigger=lambda: _drain(app, settings, shutdown_trigger),
        task_status=task_status,
    )


class StartupFailed(TrioserveError):
    """The app could not start (e.g. the checkpoint is missing or broken)."""


def run_server(settings: ServerSettings) -> int:
    """Serve until drained. A failure while starting (loading the model)
    becomes one StartupFailed with the cause's message, not a traceback."""
    try:
        trio.run(serve_app, settings)
    except BaseExceptionGroup as group:
        failure = _first(group, LifespanFailureError)
        if failure is None:
            raise
        # hypercorn wraps the app's exception text: Lifespan failure in startup. '<message>'
        text = str(failure)
        inner = text[text.find("'") + 1 : -1] if text.endswith("'") and "'" in text else text
        raise StartupFailed(inner) from None
    return 0


def _first(group: BaseExceptionGroup, kind: type) -> BaseException | None:
    for exc in group.exceptions:
        if isinstance(exc, kind):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first(exc, kind)
            if found is not None:
                return found
    return None
