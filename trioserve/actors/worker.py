"""The worker actor: runs one step at a time through the model's
StepRunner (models/step_runner.py, which owns the model and the KV cache
tensors and says what a failed step means), whole -- forward pass, pooling,
masks, draws, drafts checked -- in the device thread so the event loop stays
responsive, and replies to the scheduler with its result.

A step that raises is a fatal result, never the actor's end: whatever it
raised (a device that cannot run, a kernel's bug, a tensor on the wrong
device), the cache may be half-written, so the scheduler marks this engine
dead and fails its requests, while the worker stays to answer (the engine's
nursery, and the registry's above it, are never torn down by one model's
fault).

Sampling was once an actor of its own, fed the logits over a channel. With
at most one plan in flight and both on the one device thread, that hop
overlapped nothing; bench/README.md ("One step runner") has the
measurement that retired it."""

from __future__ import annotations

import ctypes
import time

import trio

from trioserve.actors.device import DeviceThread, run_blocking
from trioserve.actors.messages import StepRequest, deliver
from trioserve.models.step_runner import StepRunner, fatal_result


# How often the worker hands freed heap memory back to the OS (seconds; 0: never).
# One trim takes ~10 ms here, so every 10 s costs ~0.1% of the time.
TRIM_INTERVAL_S = 10.0


class HeapTrimmer:
    """Returns the C heap's free pages to the OS at most every ``interval``
    seconds, between steps (glibc's malloc_trim; a no-op elsewhere).

    Why: steps run in whichever of trio's cached threads is idle, and glibc
    gives each thread its own heap (arena). Each one keeps the free space its
    largest steps left behind, so resident memory creeps up long after the
    step shapes (bucketed, see models/step.py) stopped changing. Trimming
    bounds it; the cost is re-faulting the pages the next step touches,
    measured as noise next to a step (bench/README.md, Soak)."""

    def __init__(self, interval: float = TRIM_INTERVAL_S, clock=time.monotonic):
        self.interval = interval
        self._clock = clock
        self._next = clock() + interval
        self.trims = 0
        self._trim = _malloc_trim()

    def due(self) -> bool:
        return self._trim is not None and self.interval > 0 and self._clock() >= self._next

    def trim(self) -> None:
        """Blocking (milliseconds): call it from a thread, between steps."""
        if self._trim is not None:
            self._trim(0)
            self.trims += 1
        self._next = self._clock() + self.interval


def _malloc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


async def run_worker(
    runner: StepRunner,
    inbox: trio.MemoryReceiveChannel[StepRequest],
    device: DeviceThread | None = None,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve StepRequests from ``inbox`` until it closes, each result to
    the reply channel its request carries. Steps run on ``device``
    (actors/device.py; None: trio's worker threads). A step that raises
    gives a fatal StepResult (`fatal_result`). Cancellation waits for a
    running step to return (threads cannot be interrupted), then ends the
    actor."""
    trimmer = HeapTrimmer()
    task_status.started()
    with inbox:  # closed without a checkpoint: whoever catches this actor's failure acts before the scheduler runs again
        async for request in inbox:
            try:
                result = await run_blocking(device, runner.run, request.plan)
            except Exception as exc:  # noqa: BLE001 - contained: this engine dies, nothing above it does
                result = fatal_result(request.plan.number, exc)
            deliver(request.reply, result)  # False: the scheduler stopped waiting
            if trimmer.due():  # between steps (~10 ms every 10 s)
                await trio.to_thread.run_sync(trimmer.trim)
