"""The worker actor: owns the model and the KV cache tensors, and runs one
step at a time in a thread so the event loop stays responsive.

Failure semantics. A step refused before it runs (its inputs do not describe
a valid step) fails only that step's requests: nothing was written. Any
other exception happens after the cache may have been partly written, so the
reply is fatal and the scheduler declares the engine dead."""

from __future__ import annotations

import ctypes
import time

import attrs
import torch
import trio

from trioserve.actors.device import DeviceThread, run_blocking
from trioserve.actors.messages import SampleRequest, StepRequest, deliver
from trioserve.kernels.cpu import ThreadGovernor
from trioserve.models.step import SeqChunk, build_step
from trioserve.state.pooling import FRACTION_BITS, LIMIT
from trioserve.types import StepPlan, StepResult


# How often the worker hands freed heap memory back to the OS (seconds; 0: never).
# One trim takes ~10 ms here, so every 10 s costs ~0.1% of the time.
TRIM_INTERVAL_S = 10.0


class StepRefused(Exception):
    """Raised before any device state changes: the step was not run."""


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


@attrs.frozen
class StepOutput:
    """What a forward pass gave: the logits of the plan's sampling rows, in
    order ([rows, vocab] fp32 on the CPU; None when nothing samples), and
    the fixed-point sums of its pooling rows (StepResult.pooled)."""

    logits: torch.Tensor | None
    pooled: tuple[tuple[int, ...], ...] = ()


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
                chunks.append(SeqChunk((token,), r.start + i, r.block_table, decode=True))
            continue
        if r.sample is not None:
            index.append(len(chunks))
        chunks.append(SeqChunk(r.token_ids, r.start, r.block_table, r.decode))
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
            positions.extend(range(end - r.pool, end))
            counts.append(r.pool)
        k += len(became)
        at += sum(len(c.token_ids) for c in became)
    return positions, counts


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


def forward_step(model, cache, block_size: int, plan: StepPlan, governor: ThreadGovernor | None = None) -> StepResult | StepOutput:
    """The blocking part, run in the worker thread: the logits of the
    plan's sampling rows and the sums of its pooling rows, or the
    StepResult that says why there are none. ``governor``: chooses the
    step's CPU threads and is told how long it took (only for a model whose
    bits do not depend on them)."""
    if governor is None:
        return _forward_step(model, cache, block_size, plan)
    tokens = sum(len(r.token_ids) for r in plan.rows)
    threads = governor.choose(tokens)
    torch.set_num_threads(threads)
    started = time.perf_counter()
    out = _forward_step(model, cache, block_size, plan)
    governor.record(tokens, threads, time.perf_counter() - started)
    return out


def _forward_step(model, cache, block_size: int, plan: StepPlan) -> StepResult | StepOutput:
    try:
        chunks, index = step_chunks(plan)
        batch = build_step(chunks, block_size, model.device, fixed=model.batch_invariant)
        if int(batch.positions.max()) >= model.config.max_position:
            raise StepRefused(f"position {int(batch.positions.max())} is past the model's context")
        pooled_at, counts = pooled_rows(plan, chunks) if plan.pooling else ([], [])
    except (ValueError, StepRefused) as exc:
        return StepResult(plan.number, refused=str(exc))
    try:
        if not counts:  # the plain step: every sequence's logits, the sampling rows' kept
            logits = model.forward(batch, cache)
            wanted = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
            return StepOutput(wanted.float().cpu() if index else None)
        # Only the sampling rows go through the head: an embedding wants none.
        device = batch.last_index.device
        heads = batch.last_index.index_select(0, torch.tensor(index, dtype=torch.long, device=device))
        logits, hidden = model.forward_hidden(batch, cache, heads, torch.tensor(pooled_at, dtype=torch.long, device=device))
        return StepOutput(None if logits is None else logits.float().cpu(), fixed_point_sums(hidden.cpu(), counts))
    except StepRefused as exc:
        return StepResult(plan.number, refused=str(exc))
    except Exception as exc:  # noqa: BLE001 - any fault mid-step may have half-written the cache
        return StepResult(plan.number, fatal=f"{type(exc).__name__}: {exc}")


def thread_governor(model) -> ThreadGovernor | None:
    """A governor of the steps' CPU threads, up to torch's count now (the
    cores the process may use, or --threads), for a CPU model whose bits do
    not depend on them; else None (every step on that count)."""
    most = torch.get_num_threads()
    if model.device.type != "cpu" or most < 2 or not getattr(model.kernels, "thread_invariant", False):
        return None
    return ThreadGovernor(most)


async def run_worker(
    model,
    cache,
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
    block_size = cache.block_size
    trimmer = HeapTrimmer()
    governor = thread_governor(model)
    task_status.started()
    async with inbox:
        async for request in inbox:
            plan = request.plan
            out = await run_blocking(device, forward_step, model, cache, block_size, plan, governor)
            if isinstance(out, StepResult):
                deliver(request.reply, out)  # False: the scheduler stopped waiting
            elif not plan.sampling:
                deliver(request.reply, StepResult(plan.number, pooled=out.pooled))
            else:
                await sampler.send(SampleRequest(plan, out.logits, request.reply, out.pooled))
            if trimmer.due():  # while the sampler works on this step's logits
                await trio.to_thread.run_sync(trimmer.trim)
