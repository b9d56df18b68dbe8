"""The sampler actor: turns rows of logits into tokens. The math
(trioserve.models.sampling) is pure and runs in a thread, so a step's
sampling never blocks the event loop. Each request's draws come from its own
counter-based stream, keyed by (seed, draw index) carried in the row, so what
else shares the step cannot change them."""

from __future__ import annotations

import trio

from trioserve.actors.messages import SampleReply, SampleRequest, deliver
from trioserve.models.sampling import sample_rows


def _sample(request: SampleRequest) -> SampleReply:
    try:
        return SampleReply(sample_rows(request.logits, request.rows, request.masks))
    except Exception as exc:  # noqa: BLE001 - reported to the scheduler, which fails those rows
        return SampleReply(None, error=f"{type(exc).__name__}: {exc}")


async def run_sampler(inbox: trio.MemoryReceiveChannel, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve SampleRequests until ``inbox`` closes; replies go to the channel
    each request carries."""
    task_status.started()
    async with inbox:
        async for request in inbox:
            reply = await trio.to_thread.run_sync(_sample, request)
            deliver(request.reply, reply)  # False: the scheduler stopped waiting
