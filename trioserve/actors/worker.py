"""The worker actor: runs one step's forward pass at a time through the
model's StepRunner (models/step_runner.py, which owns the model and the KV
cache tensors and says what a failed step means), in the device thread so
the event loop stays responsive, and hands the logits to the sampler."""

from __future__ import annotations

import ctypes
import time

import trio

from trioserve.actors.device import DeviceThread, run_blocking
from trioserve.actors.messages import SampleRequest, StepRequest, deliver
from trioserve.models.step_runner import StepRunner
from trioserve.types import StepResult


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
    sampler: trio.MemorySendChannel[SampleRequest],
    device: DeviceThread | None = None,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve StepRequests from ``inbox`` until it closes. The logits of a
    step go straight to the sampler, which replies to the channel the
    request carries; a step that samples nothing or failed is answered here.
    Steps run on ``device`` (actors/device.py; None: trio's worker threads).
    Cancellation waits for a running step to return (threads cannot be
    interrupted), then ends the actor."""
    trimmer = HeapTrimmer()
    task_status.started()
    async with inbox:
        async for request in inbox:
            plan = request.plan
            out = await run_blocking(device, runner.forward, plan)
            if isinstance(out, StepResult):
                deliver(request.reply, out)  # False: the scheduler stopped waiting
            elif not plan.sampling:
                deliver(request.reply, runner.finish(plan, out))
            else:
                await sampler.send(SampleRequest(plan, out, request.reply))
            if trimmer.due():  # while the sampler works on this step's logits
                await trio.to_thread.run_sync(trimmer.trim)
