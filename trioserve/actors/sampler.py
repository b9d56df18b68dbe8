"""The sampler actor: turns the logits the worker hands it into each
sampling row's token, and replies to the scheduler with the step's result.
The math (trioserve.models.sampling) is pure and runs in a thread, so a
step's sampling never blocks the event loop. Each request's draws come from
its own counter-based stream, keyed by (seed, draw index) carried in its
plan row, so what else shares the step cannot change them.

Guided rows' masks are filled here, in the same thread, right before the
draw: llguidance takes 10-30 microseconds a token per row (docs/guided.md)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from trioserve.actors.device import DeviceThread, run_blocking
from trioserve.actors.messages import SampleRequest, deliver
from trioserve.models.guided import GuideCompiler
from trioserve.models.sampling import sample_rows
from trioserve.types import PlanRow, Sampled, SampleRow, StepPlan, StepResult


def sample_step(plan: StepPlan, logits, vocab_size: int, guides: GuideCompiler | None) -> StepResult:
    """One token for each sampling row of ``plan`` from ``logits`` (its
    rows, in order). Blocking: call it from a thread."""
    rows = plan.sampling
    # A checkpoint may pad its output head past the tokenizer's vocabulary;
    # those ids name no token, so they are never candidates.
    logits = logits[:, :vocab_size]
    samples, row_guides = positions(rows)
    masks = None
    if guides is not None and any(g is not None for g in row_guides):
        try:
            masks = guides.fill_masks(row_guides)
        except Exception as exc:  # noqa: BLE001 - the step fails its sampling rows with it
            return StepResult(plan.number, failed=f"the output constraint failed: {exc}")
    try:
        picked = sample_rows(logits, samples, masks)
    except Exception as exc:  # noqa: BLE001 - reported to the scheduler, which fails those rows
        return StepResult(plan.number, failed=f"sampling failed: {type(exc).__name__}: {exc}")
    return StepResult(plan.number, sampled=accept(rows, picked))


def positions(rows: Sequence[PlanRow]) -> tuple[list[SampleRow], list]:
    """One SampleRow (and guide) per logits row: a row with a speculative
    draft has one per position, each drawing at the index and with the
    history it would have if the draft so far were what was generated."""
    samples: list[SampleRow] = []
    row_guides: list = []
    for r in rows:
        s = r.sample
        samples.append(s)
        row_guides.append(r.guide)
        per_token = 0 if s.params.greedy else 1
        for i in range(1, len(s.draft) + 1):
            history = tuple(s.history) + s.draft[:i] if s.params.penalized else ()
            samples.append(attrs.evolve(s, draw_index=s.draw_index + i * per_token, history=history, draft=()))
            row_guides.append(None)  # guided rows are never drafted (state/scheduling.py)
    return samples, row_guides


def accept(rows: Sequence[PlanRow], picked: Sequence[Sampled]) -> tuple[tuple[Sampled, ...], ...]:
    """Each row's tokens from ``picked`` (one per position, in order): the
    first, then each next one while the token before it equals the draft
    token it was computed after. So a row keeps exactly the tokens plain
    decoding would have given, one or more of them."""
    out = []
    k = 0
    for r in rows:
        draft = r.sample.draft
        got = picked[k : k + 1 + len(draft)]
        k += 1 + len(draft)
        kept = [got[0]]
        for i, token in enumerate(draft):
            if got[i].token != token:
                break
            kept.append(got[i + 1])
        out.append(tuple(kept))
    return tuple(out)


async def run_sampler(
    inbox: trio.MemoryReceiveChannel[SampleRequest],
    vocab_size: int,
    guides: GuideCompiler | None = None,
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
            result = await run_blocking(device, sample_step, request.plan, request.logits, vocab_size, guides)
            if request.pooled:  # the forward pass ran, so its pooled sums hold whatever sampling gave
                result = attrs.evolve(result, pooled=request.pooled)
            deliver(request.reply, result)  # False: the scheduler stopped waiting
