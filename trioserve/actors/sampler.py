"""The sampler actor: turns the logits the worker hands it into each
sampling row's token, through the model's StepRunner (models/step_runner.py:
guided masks, draws, speculative drafts checked), and replies to the
scheduler with the step's result. The math runs in the device thread, so a
step's sampling never blocks the event loop."""

from __future__ import annotations

import trio

from trioserve.actors.device import DeviceThread, run_blocking
from trioserve.actors.messages import SampleRequest, deliver
from trioserve.models.step_runner import StepRunner


async def run_sampler(
    inbox: trio.MemoryReceiveChannel[SampleRequest],
    runner: StepRunner,
    device: DeviceThread | None = None,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve SampleRequests until ``inbox`` closes; each result goes to the
    reply channel its request carries. The math runs on ``device``, the
    worker's thread (actors/device.py; None: trio's worker threads)."""
    task_status.started()
    async with inbox:
        async for request in inbox:
            result = await run_blocking(device, runner.finish, request.plan, request.out)
            deliver(request.reply, result)  # False: the scheduler stopped waiting
