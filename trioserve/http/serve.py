"""Running the app under hypercorn inside our own trio.run, with draining:
on SIGINT or SIGTERM /health turns to 503 "draining", new requests get 503,
requests in flight finish (bounded by the drain timeout), then the process
exits 0. Connections go through trioserve.http.transport, which gives
every wait on a client a deadline (write, read, keep-alive), so a client
that never reads cannot hold the drain open.

Work that cannot be interrupted in a thread (a chat template's render, a
LoRA regex) runs in child processes (models/bounded.py) whose waits end
when their request is cancelled (`request_cancelled`). And whatever still
holds the process past the drain (a thread stuck in a read), `run_server`
ends it EXIT_GRACE_S after the drain timeout: SIGTERM always ends the
process."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
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
from trioserve.models import bounded
from trioserve.models.checkpoint import load_checkpoint
from trioserve.progress import ProgressBar

# After the drain, requests still running get this long before they are cut
# (idle keep-alive connections close at once).
CUT_GRACE_S = 1.0
# A process not ended this long after its drain timeout is ended at once.
EXIT_GRACE_S = 5.0


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


def request_cancelled() -> None:
    """Raise trio.Cancelled in a thread of trio.to_thread.run_sync whose
    task was cancelled (a request cut, the server stopping); in any other
    thread, nothing. Installed as models/bounded.py's interrupt check."""
    try:
        trio.from_thread.check_cancelled()
    except RuntimeError:  # not a thread trio started: nothing to check
        return


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
    bounded.set_interrupt_check(request_cancelled)
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
        trio.run(functools.partial(serve_app, settings, shutdown_trigger=functools.partial(_with_exit_deadline, settings)))
    except BaseExceptionGroup as group:
        failure = _first(group, LifespanFailureError)
        if failure is None:
            raise
        # hypercorn wraps the app's exception text: Lifespan failure in startup. '<message>'
        text = str(failure)
        inner = text[text.find("'") + 1 : -1] if text.endswith("'") and "'" in text else text
        raise StartupFailed(inner) from None
    return 0


async def _with_exit_deadline(settings: ServerSettings) -> str:
    """wait_for_signal, then arm the backstop: a timer thread that ends the
    process EXIT_GRACE_S after the drain timeout if it still runs then."""
    why = await wait_for_signal()
    limit = settings.drain_timeout_s + EXIT_GRACE_S
    timer = threading.Timer(limit, _exit_now, (limit,))
    timer.daemon = True
    timer.start()
    return why


def _exit_now(limit: float) -> None:
    print(f"trioserve: still running {limit:g} s after the signal; exiting now", file=sys.stderr, flush=True)
    bounded.kill_all()
    os._exit(1)


def _first(group: BaseExceptionGroup, kind: type) -> BaseException | None:
    for exc in group.exceptions:
        if isinstance(exc, kind):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first(exc, kind)
            if found is not None:
                return found
    return None
