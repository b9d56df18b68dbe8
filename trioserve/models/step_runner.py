"""One step, from its plan to its result: the only code that touches the
device per step. `StepRunner.run(plan)` builds the step's inputs, runs the
forward pass, sums the pooling rows' hidden states, fills the guided rows'
masks, samples each sampling row's token and keeps what a speculative draft
got right. It is synchronous and blocking: the worker actor calls it in its
device thread (actors/worker.py), and replay calls it directly
(core/replay.py), so both run exactly the same step.

`run` is two halves in order: `forward` (the inputs, the forward pass,
pooling and prompt scoring: what benchmarks time on its own) and `finish`
(masks, draws, draft checks).

Prompt scoring (PlanRow.score): the rows of a prompt chunk that predict the
next prompt token go through the output head too, in slices, and their
scores (models/scoring.py) come back in StepResult.scored. Steps with no
such row run exactly as before.

Failure semantics. A step refused before it runs (its inputs do not describe
a valid step) fails only that step's requests: nothing was written. Any
other exception, while its inputs are built on the device or in the forward
pass, means the device cannot be trusted (the cache may have been partly
written), so the result is fatal and the scheduler declares the engine
dead. A failure while sampling fails the step's sampling rows. Whatever
else a step raises, the worker (actors/worker.py) turns into a fatal
result too: a step's fault never leaves its engine.

Sampling draws: each request's come from its own counter-based stream,
keyed by (seed, draw index) carried in its plan row, so what else shares the
step cannot change them (models/sampling.py)."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Sequence

import attrs
import torch

from trioserve.kernels.cpu import ThreadGovernor
from trioserve.kernels.sampler_math import FIXED, Numerics
from trioserve.models.guided import GuideCompiler
from trioserve.models.sampling import sample_rows
from trioserve.models.scoring import score_rows
from trioserve.models.step import SeqChunk, build_step
from trioserve.state.pooling import FRACTION_BITS, LIMIT
from trioserve.types import PlanRow, PromptLogprob, Sampled, SampleRow, StepPlan, StepResult


class StepRefused(Exception):
    """Raised before any device state changes: the step was not run."""


@attrs.frozen
class StepOutput:
    """What a forward pass gave: the logits of the plan's sampling rows, in
    order ([rows, vocab] fp32 on the CPU; None when nothing samples), the
    fixed-point sums of its pooling rows (StepResult.pooled) and the scores
    of its scoring rows (StepResult.scored)."""

    logits: torch.Tensor | None
    pooled: tuple[tuple[int, ...], ...] = ()
    scored: tuple[tuple[PromptLogprob, ...], ...] = ()


class StepRunner:
    """Runs a model's steps over its KV ``cache``. ``vocab_size``: the
    tokenizer's (a checkpoint may pad its head past it; those ids are never
    drawn). ``guides``: compiles and fills guided rows' masks (None: no
    guided rows). ``governor``: chooses each step's CPU threads and is told
    how long the forward pass took (only for a model whose bits do not
    depend on them: `thread_governor`)."""

    def __init__(
        self, model, cache, *, vocab_size: int, guides: GuideCompiler | None = None, governor: ThreadGovernor | None = None,
        numerics: Numerics = FIXED,
    ):  # fmt: skip
        self.model = model
        self.numerics = numerics  # the sampler's arithmetic (kernels/sampler_math.py); a replay may ask for torch's
        self.cache = cache
        self.block_size = cache.block_size
        self.vocab_size = vocab_size
        self.guides = guides
        self.governor = governor

    def run(self, plan: StepPlan) -> StepResult:
        """The whole step. Blocking: call it from the device thread."""
        out = self.forward(plan)
        return out if isinstance(out, StepResult) else self.finish(plan, out)

    def finish(self, plan: StepPlan, out: StepOutput) -> StepResult:
        """The step's result after its forward pass: the sampled tokens, and
        the pooled sums whatever sampling gave."""
        if not plan.sampling:
            return StepResult(plan.number, pooled=out.pooled, scored=out.scored)
        result = self.sample(plan, out.logits)
        return attrs.evolve(result, pooled=out.pooled, scored=out.scored) if out.pooled or out.scored else result

    def forward(self, plan: StepPlan) -> StepResult | StepOutput:
        """The forward pass: the logits of the plan's sampling rows and the
        sums of its pooling rows, or the StepResult that says why there are
        none. Blocking."""
        if self.governor is None:
            return self._forward(plan)
        tokens = sum(len(r.token_ids) for r in plan.rows)
        threads = self.governor.choose(tokens)
        torch.set_num_threads(threads)
        started = time.perf_counter()
        out = self._forward(plan)
        self.governor.record(tokens, threads, time.perf_counter() - started)
        return out

    def _forward(self, plan: StepPlan) -> StepResult | StepOutput:
        model = self.model
        try:
            chunks, index = step_chunks(plan)
            batch = build_step(chunks, self.block_size, model.device, fixed=model.batch_invariant)
            if int(batch.positions.max()) >= model.config.max_position:
                raise StepRefused(f"position {int(batch.positions.max())} is past the model's context")
            pooled_at, counts = pooled_rows(plan, chunks) if plan.pooling else ([], [])
            scored_at = scored_positions(plan, chunks) if plan.scoring else None
        except (ValueError, StepRefused) as exc:
            return StepResult(plan.number, refused=str(exc))
        except Exception as exc:  # noqa: BLE001 - the inputs went to the device: one that fails there cannot be trusted
            return fatal_result(plan.number, exc)
        try:
            if scored_at is not None:
                return self._forward_scoring(plan, scored_at, index, batch, pooled_at, counts)
            if not counts:  # the plain step: every sequence's logits, the sampling rows' kept
                logits = model.forward(batch, self.cache)
                wanted = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
                return StepOutput(wanted.float().cpu() if index else None)
            # Only the sampling rows go through the head: an embedding wants none.
            device = batch.last_index.device
            heads = batch.last_index.index_select(0, torch.tensor(index, dtype=torch.long, device=device))
            logits, hidden = model.forward_hidden(batch, self.cache, heads, torch.tensor(pooled_at, dtype=torch.long, device=device))
            return StepOutput(None if logits is None else logits.float().cpu(), fixed_point_sums(hidden.cpu(), counts))
        except StepRefused as exc:
            return StepResult(plan.number, refused=str(exc))
        except Exception as exc:  # noqa: BLE001 - any fault mid-step may have half-written the cache
            return fatal_result(plan.number, exc)

    def _forward_scoring(self, plan: StepPlan, scored_at, index: list[int], batch, pooled_at: list[int], counts: list[int]) -> StepOutput:
        """The forward pass of a step with scoring rows: the sampling rows'
        logits and the pooling rows' sums as `_forward` gives them, and the
        scoring rows' positions through the head in slices, each slice
        scored as it comes (so no step holds every position's logits)."""
        model = self.model
        device = batch.last_index.device
        at, targets, tops = scored_at
        scores: list[PromptLogprob] = []

        def scored(logits: torch.Tensor) -> None:
            k = len(scores)
            n = logits.shape[0]
            scores.extend(score_rows(logits, targets[k : k + n], tops[k : k + n], self.vocab_size, self.numerics))

        heads = batch.last_index.index_select(0, torch.tensor(index, dtype=torch.long, device=device))
        hidden_rows = torch.tensor(pooled_at, dtype=torch.long, device=device) if counts else None
        scored_rows = torch.tensor(at, dtype=torch.long, device=device)
        logits, hidden = model.forward_parts(batch, self.cache, heads, hidden_rows=hidden_rows, scored_rows=scored_rows, scored=scored)
        per_row = []
        k = 0
        for r in plan.scoring:
            per_row.append(tuple(scores[k : k + len(r.score.targets)]))
            k += len(r.score.targets)
        pooled = fixed_point_sums(hidden.cpu(), counts) if counts else ()
        return StepOutput(None if logits is None else logits.float().cpu(), pooled, tuple(per_row))

    def sample(self, plan: StepPlan, logits: torch.Tensor) -> StepResult:
        """One token for each sampling row of ``plan`` from ``logits`` (its
        rows, in order), a drafted row's kept tokens checked against its
        draft. Guided rows' masks are filled here, right before the draw
        (llguidance takes 10-30 microseconds a token per row; docs/guided.md).
        Blocking."""
        rows = plan.sampling
        logits = logits[:, : self.vocab_size]  # ids past the tokenizer's name no token
        samples, row_guides = sample_positions(rows)
        masks = None
        if self.guides is not None and any(g is not None for g in row_guides):
            try:
                masks = self.guides.fill_masks(row_guides)
            except Exception as exc:  # noqa: BLE001 - the step fails its sampling rows with it
                return StepResult(plan.number, failed=f"the output constraint failed: {exc}")
        try:
            picked = sample_rows(logits, samples, masks, self.numerics)
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler, which fails those rows
            return StepResult(plan.number, failed=f"sampling failed: {type(exc).__name__}: {exc}")
        return StepResult(plan.number, sampled=accept(rows, picked))


def fatal_result(number: int, exc: Exception) -> StepResult:
    """Step ``number``'s result after ``exc``: fatal (the engine dies),
    its cause one line naming the exception; the traceback goes to stderr
    for whoever runs the server."""
    print(f"trioserve: step {number} failed part-way; the engine is dead:", file=sys.stderr, flush=True)
    traceback.print_exception(exc, file=sys.stderr)
    return StepResult(number, fatal=" ".join(f"{type(exc).__name__}: {exc}".split()))


def thread_governor(model) -> ThreadGovernor | None:
    """A governor of the steps' CPU threads, up to torch's count now (the
    cores the process may use, or --threads), for a CPU model whose bits do
    not depend on them; else None (every step on that count)."""
    most = torch.get_num_threads()
    if model.device.type != "cpu" or most < 2 or not getattr(model.kernels, "thread_invariant", False):
        return None
    return ThreadGovernor(most)


def step_chunks(plan: StepPlan) -> tuple[list[SeqChunk], list[int]]:
    """The model's chunks for ``plan`` and, in the order of the plan's
    sampling rows, the chunks whose logits are sampled. A row with a
    speculative draft becomes one decode chunk per token, each with its own
    logits: every position computes exactly what decoding it alone would."""
    chunks: list[SeqChunk] = []
    index: list[int] = []
    for r in plan.rows:
        if r.sample is not None and r.sample.draft:
            for i, token in enumerate(r.token_ids):
                index.append(len(chunks))
                chunks.append(SeqChunk((token,), r.start + i, r.block_table, decode=True, adapter=r.adapter))
            continue
        if r.sample is not None:
            index.append(len(chunks))
        chunks.append(SeqChunk(r.token_ids, r.start, r.block_table, r.decode, r.adapter))
    return chunks, index


def pooled_rows(plan: StepPlan, chunks: list[SeqChunk]) -> tuple[list[int], list[int]]:
    """For the plan's pooling rows, in order: the packed positions of the
    tokens each pools (the last ``pool`` tokens of its chunk: a pooling row
    is a prompt chunk, so one chunk), concatenated, and how many each has."""
    positions: list[int] = []
    counts: list[int] = []
    k = at = 0  # the row's first chunk (step_chunks' order), and that chunk's packed position
    for r in plan.rows:
        became = chunks[k : k + (len(r.token_ids) if r.sample is not None and r.sample.draft else 1)]
        if r.pool:
            end = at + len(became[0].token_ids)
            positions.extend(range(at, at + r.pool) if r.pool_first else range(end - r.pool, end))
            counts.append(r.pool)
        k += len(became)
        at += sum(len(c.token_ids) for c in became)
    return positions, counts


def scored_positions(plan: StepPlan, chunks: list[SeqChunk]) -> tuple[list[int], list[int], list[int]]:
    """For the plan's scoring rows, in order: the packed positions whose
    logits score a prompt token (a scoring row is a prompt chunk, so one
    chunk; its first ``len(targets)`` tokens), the tokens they score, and
    how many of the likeliest each lists."""
    positions: list[int] = []
    targets: list[int] = []
    tops: list[int] = []
    k = at = 0  # the row's first chunk (step_chunks' order), and that chunk's packed position
    for r in plan.rows:
        became = chunks[k : k + (len(r.token_ids) if r.sample is not None and r.sample.draft else 1)]
        if r.score is not None:
            if len(r.score.targets) > len(r.token_ids):
                raise ValueError(f"request {r.request_id}: {len(r.score.targets)} tokens to score in a chunk of {len(r.token_ids)}")
            positions.extend(range(at, at + len(r.score.targets)))
            targets.extend(r.score.targets)
            tops.extend([r.score.top] * len(r.score.targets))
        k += len(became)
        at += sum(len(c.token_ids) for c in became)
    return positions, targets, tops


def fixed_point_sums(hidden: torch.Tensor, counts: list[int]) -> tuple[tuple[int, ...], ...]:
    """The rows of ``hidden`` (fp32), consecutive groups of ``counts``, each
    group summed in fixed point (state/pooling.py): exact, so a group's sum
    does not depend on how its prompt was cut into chunks."""
    scaled = torch.nan_to_num(hidden.double(), nan=0.0) * float(1 << FRACTION_BITS)  # exact
    fixed = scaled.round().clamp(-LIMIT, LIMIT).to(torch.int64)
    out = []
    for part in fixed.split(counts):
        out.append(tuple(part.sum(0).tolist()))
    return tuple(out)


def sample_positions(rows: Sequence[PlanRow]) -> tuple[list[SampleRow], list]:
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
