"""The worker actor: owns the model and the KV cache tensors, and runs one
step at a time in a thread so the event loop stays responsive.

Failure semantics. A step refused before it runs (its inputs do not describe
a valid step) fails only that step's requests: nothing was written. Any
other exception happens after the cache may have been partly written, so the
reply is fatal and the scheduler declares the engine dead."""

from __future__ import annotations

import time

import torch
import trio

from trioserve.actors.messages import StepReply, StepRequest, deliver
from trioserve.models.step import build_step


class StepRefused(Exception):
    """Raised before any device state changes: the step was not run."""


def run_step(model, cache, block_size: int, request: StepRequest) -> StepReply:
    """The blocking part, run in the worker thread."""
    started = time.perf_counter()
    try:
        batch = build_step(request.chunks, block_size, model.device)
        if int(batch.positions.max()) >= model.config.max_position:
            raise StepRefused(f"position {int(batch.positions.max())} is past the model's context")
    except (ValueError, StepRefused) as exc:
        return StepReply(None, refused=str(exc))
    try:
        logits = model.forward(batch, cache)
        wanted = logits.index_select(0, torch.tensor(request.sample_rows, dtype=torch.long, device=logits.device))
        wanted = wanted.float().cpu()
    except StepRefused as exc:
        return StepReply(None, refused=str(exc))
    except Exception as exc:  # noqa: BLE001 - any fault mid-step may have half-written the cache
        return StepReply(None, fatal=f"{type(exc).__name__}: {exc}")
    return StepReply(wanted, seconds=time.perf_counter() - started)


async def run_worker(model, cache, inbox: trio.MemoryReceiveChannel, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve StepRequests from ``inbox`` until it closes. Each reply goes to
    the channel carried in the request. Cancellation waits for a running step
    to return (threads cannot be interrupted), then ends the actor."""
    block_size = cache.block_size
    task_status.started()
    async with inbox:
        async for request in inbox:
            reply = await trio.to_thread.run_sync(run_step, model, cache, block_size, request)
            deliver(request.reply, reply)  # False: the scheduler stopped waiting
