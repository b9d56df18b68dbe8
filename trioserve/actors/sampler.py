"""The sampler actor: turns the logits the worker hands it into each
sampling row's token, and replies to the scheduler with the step's result.
The math (trioserve.models.sampling) is pure and runs in a thread, so a
step's sampling never blocks the event loop. Each request's draws come from
its own counter-based stream, keyed by (seed, draw index) carried in its
plan row, so what else shares the step cannot change them.

Guided rows' masks are filled here, in the same thread, right before the
draw: llguidance takes 10-30 microseconds a token per row (docs/guided.md)."""

from __future__ import annotations

import trio

from trioserve.actors.messages import SampleRequest, deliver
from trioserve.models.guided import GuideCompiler
from trioserve.models.sampling import sample_rows
from trioserve.types import StepPlan, StepResult


def sample_step(plan: StepPlan, logits, vocab_size: int, guides: GuideCompiler | None) -> StepResult:
    """One token for each sampling row of ``plan`` from ``logits`` (its
    rows, in order). Blocking: call it from a thread."""
    rows = plan.sampling
    # A checkpoint may pad its output head past the tokenizer's vocabulary;
    # those ids name no token, so they are never candidates.
    logits = logits[:, :vocab_size]
    masks = None
    if guides is not None and any(r.guide is not None for r in rows):
        try:
            masks = guides.fill_masks([r.guide for r in rows])
        except Exception as exc:  # noqa: BLE001 - the step fails its sampling rows with it
            return StepResult(plan.number, failed=f"the output constraint failed: {exc}")
    try:
        picked = sample_rows(logits, [r.sample for r in rows], masks)
    except Exception as exc:  # noqa: BLE001 - reported to the scheduler, which fails those rows
        return StepResult(plan.number, failed=f"sampling failed: {type(exc).__name__}: {exc}")
    return StepResult(plan.number, sampled=tuple((s,) for s in picked))


async def run_sampler(
    inbox: trio.MemoryReceiveChannel[SampleRequest],
    vocab_size: int,
    guides: GuideCompiler | None = None,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve SampleRequests until ``inbox`` closes; each result goes to the
    reply channel its request carries."""
    task_status.started()
    async with inbox:
        async for request in inbox:
            result = await trio.to_thread.run_sync(sample_step, request.plan, request.logits, vocab_size, guides)
            deliver(request.reply, result)  # False: the scheduler stopped waiting
