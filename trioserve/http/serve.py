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
from hypercorn.utils import LifespanFailureError

from trioserve.config import ServerSettings
from trioserve.errors import TrioserveError
from trioserve.engine import resolve_dtype
from trioserve.http.app import create_app
from trioserve.models.checkpoint import load_checkpoint
from trioserve.progress import ProgressBar


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
        while True:
            await state.requests.wait_idle()
            stats = state.engine.statistics() if state.engine is not None else None
            if stats is None or (stats.running == 0 and stats.waiting == 0):
                break
            await trio.sleep(0.05)


async def serve_app(settings: ServerSettings, *, checkpoint=None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Load the checkpoint (with progress), then serve it. A checkpoint that
    cannot be loaded raises CheckpointError before anything binds. A
    ``checkpoint`` already loaded (benchmarks serving it twice) is used as is."""
    if checkpoint is None:
        progress = ProgressBar("Loading weights")
        checkpoint = await trio.to_thread.run_sync(
            lambda: load_checkpoint(settings.engine.model, dtype=resolve_dtype(settings.engine.dtype), progress=progress)
        )
        progress.finish(f" ({checkpoint.path})")
    app = create_app(settings, checkpoint=checkpoint)
    config = HypercornConfig()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.loglevel = settings.log_level.upper()
    config.graceful_timeout = 2.0  # after the drain only idle keep-alive connections remain
    config.accesslog = None
    await serve(app, config, shutdown_trigger=lambda: _drain_on_signal(app, settings), task_status=task_status)


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
