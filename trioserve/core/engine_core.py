"""The engine core: every decision the engine makes, as a synchronous object
with no trio, no clocks, no randomness and no I/O.

It takes inputs -- `submit`, `cancel`, `settle` (an owner's order about
retained KV), `plan` (the top of an iteration), `result` (what a planned
step gave) and `die` -- each with the time ``now`` its caller read, and
returns what to publish: the refusal of a submission, token events and
final events, and the next step's plan. Given the same inputs in the same
order, a core returns the same outputs, byte for byte: that is what makes a
run recordable at this one boundary and replayable without the model
(core/trace.py, core/replay.py). The scheduler actor is a thin shell that
feeds it; seeds are resolved before a request reaches it.

An embedding request (GenerateRequest.pooling) is prefilled like any
prompt; the worker returns its chunks' pooled hidden states as fixed-point
sums (StepResult.pooled), which the core adds up, and when the prompt is all
prefilled the request ends with its vector in the FinalEvent
(state/pooling.py). Nothing about it is sampled.

A request that scores its prompt (SamplingParams.prompt_logprobs) has each
prompt chunk planned with the tokens its positions predict (PlanRow.score);
the worker returns their scores (StepResult.scored), computed from the very
logits of that prefill, and once the prefill is done the core sends them in
one PromptEvent, before any token. With max_tokens 0 the request then ends
("length") with nothing generated.

Contract: at most one plan is in flight. `plan` refuses to run while one
is; `result` must name the plan in flight. Inputs that arrive while a step
runs (submissions, cancellations, orders) are taken at once; cancellations
and orders take effect at the next `plan`, before admission."""

from __future__ import annotations

import attrs

from trioserve.errors import EngineDead, RequestError, TrioserveError
from trioserve.models.detokenizer import IncrementalDetokenizer
from trioserve.models.tokenizer import Tokenizer
from trioserve.state.pooling import add_sums, embedding, raw_vector
from trioserve.state.kv_pool import BlockPool
from trioserve.state.prefix_cache import PrefixCache
from trioserve.state.scheduling import PlannedRow, SchedulingPolicy
from trioserve.state.sequence import Sequence
from trioserve.state.stats import EngineStats, StatsRecorder
from trioserve.state.stops import StopMatcher
from trioserve.types import (
    POOLING_MODES,
    Event,
    FinalEvent,
    GenerateRequest,
    PlanRow,
    PromptEvent,
    SampleRow,
    ScoreRow,
    SamplingError,
    StepPlan,
    StepResult,
    Timings,
    TokenEvent,
    Usage,
)

ORDERS = ("commit", "cancel", "forget")


class CoreMisuse(RuntimeError):
    """An input that breaks the core's contract (a result for a plan that is
    not in flight, a second plan while one is): a bug in the caller, or a
    trace that was not recorded from a core."""


def check_request(request: GenerateRequest, vocab_size: int) -> None:
    """Validate what needs no engine state: the prompt ids, the draw start
    and the sampling parameters. Raises RequestError naming the field."""
    if not request.prompt_ids:
        raise RequestError("the prompt is empty", field="prompt")
    bad = [t for t in request.prompt_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size)]
    if bad:
        raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary (0..{vocab_size - 1})", field="prompt")
    if not (isinstance(request.draw_start, int) and request.draw_start >= 0):
        raise RequestError(f"draw_start must be a whole number of at least 0, got {request.draw_start!r}", field="draw_start")
    if request.pooling is not None:
        if request.pooling not in POOLING_MODES:
            raise RequestError(f"pooling must be one of {', '.join(POOLING_MODES)}, got {request.pooling!r}", field="pooling")
        if request.retain is not None or request.guide is not None:
            raise RequestError("an embedding request generates nothing: it takes no retain owner and no output constraint", field="pooling")
        if request.params.prompt_logprobs is not None:
            raise RequestError("an embedding request does not score its prompt: it takes no prompt_logprobs", field="prompt_logprobs")
    try:
        request.params.validate(vocab_size)
    except SamplingError as exc:
        raise RequestError(str(exc), field=exc.field) from exc


@attrs.frozen
class CoreSettings:
    """Everything a core is built from besides the tokenizer: what a trace's
    header records so that a replay builds the same core."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    prefill_budget: int
    max_queue: int
    retry_after_s: float = 1.0
    prefix_cache: bool = True
    prefix_cache_max_blocks: int | None = None
    prefix_cache_idle_s: float | None = None
    # Whether generated tokens' KV may serve later prompts (off in
    # batch-invariant mode). Traces from before it existed ran with it on.
    share_generated_kv: bool = True
    # Prompt-lookup draft tokens per decode row (0: no speculative decoding).
    draft_tokens: int = 0
    # The time a step with decode rows is planned to take at most (prompt
    # chunks shrink to fit; 0: off). Traces from before it existed ran off.
    max_step_s: float = 0.0
    # How a step's prefill budget is shared (state/scheduling.py
    # PREFILL_SHARING): evenly between tenants, then between each tenant's
    # requests. Traces from before it existed shared between tenants only.
    prefill_sharing: str = "requests"
    # Each prompt runs whole in one step, never in chunks (an encoder's
    # bidirectional attention needs all of it at once: models/bert.py).
    whole_prompts: bool = False


def new_core(settings: CoreSettings, tokenizer: Tokenizer) -> EngineCore:
    """A fresh core: an empty block pool, prefix cache and queue."""
    pool = BlockPool(settings.num_blocks, settings.block_size)
    prefixes = None
    if settings.prefix_cache:
        prefixes = PrefixCache(pool, max_blocks=settings.prefix_cache_max_blocks, idle_s=settings.prefix_cache_idle_s)
    policy = SchedulingPolicy(
        pool,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        prefill_budget=settings.prefill_budget,
        max_queue=settings.max_queue,
        retry_after=settings.retry_after_s,
        prefix_cache=prefixes,
        share_generated_kv=settings.share_generated_kv,
        draft_tokens=settings.draft_tokens,
        max_step_s=settings.max_step_s,
        prefill_sharing=settings.prefill_sharing,
        whole_prompts=settings.whole_prompts,
    )
    return EngineCore(policy, tokenizer)


@attrs.define
class _InFlight:
    plan: StepPlan
    rows: list[PlannedRow]
    planned_at: float


class EngineCore:
    def __init__(self, policy: SchedulingPolicy, tokenizer: Tokenizer) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.seqs: dict[str, Sequence] = {}
        # Owners' orders about retained KV, applied in order at the next
        # `plan` before admission: (owner, request id) -> "commit" |
        # "cancel", and (owner, None) -> "forget". Setting an entry again
        # keeps its place.
        self.retention: dict[tuple[str, str | None], str] = {}
        self.stats = StatsRecorder()
        self.steps_planned = 0
        self._in_flight: _InFlight | None = None
        self._now = 0.0
        # The policy reads the time through this, so it sees only the
        # callers' ``now``, never a clock.
        policy.clock = lambda: self._now

    # -- inputs ----------------------------------------------------------
    def submit(self, request_id: str, request: GenerateRequest, now: float) -> TrioserveError | None:
        """Queue a request, or return why it is refused (nothing is kept then)."""
        self._now = now
        try:
            seq = self._sequence(request_id, request, now)
            self.policy.enqueue(seq)
        except TrioserveError as exc:
            return exc
        self.seqs[request_id] = seq
        return None

    def cancel(self, request_id: str, now: float, error: str | None = None) -> None:
        """Stop a request (its consumer left); it ends at the next `plan`
        unless the step in flight ends it first. Unknown ids are ignored.
        With ``error``, it ends as failed with that cause (its LoRA adapter
        is being unloaded) rather than cancelled."""
        self._now = now
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.cancelled = True
            seq.error = error

    def requests_of(self, adapter: str) -> list[str]:
        """The requests, waiting or running, of LoRA adapter ``adapter``."""
        return [rid for rid, seq in self.seqs.items() if seq.adapter == adapter]

    def settle(self, owner: str, order: str, request_id: str | None, now: float) -> None:
        """An owner's order about retained KV: "commit" or "cancel" the KV
        held for its turn ``request_id``, or "forget" all it keeps."""
        if order not in ORDERS:
            raise ValueError(f"unknown retention order {order!r}")
        self._now = now
        self.retention[(owner, None if order == "forget" else request_id)] = order

    def plan(self, now: float) -> tuple[list[Event], StepPlan | None]:
        """The top of an iteration: apply the owners' orders, end cancelled
        requests, admit, and plan the next step (None: nothing to run)."""
        if self._in_flight is not None:
            raise CoreMisuse(f"step {self._in_flight.plan.number} is still in flight")
        self._now = now
        orders, self.retention = self.retention, {}
        for (owner, request_id), order in orders.items():
            self.policy.settle(owner, order, request_id)
        if orders and self.policy.cache is not None:
            self.policy.cache.trim(now)
        events: list[Event] = []
        for seq in self.policy.drop_cancelled():
            events.append(self._final(seq, "cancelled") if seq.error is None else self._final(seq, "error", error=seq.error))
        for seq in self.policy.admit(now):
            self.stats.queue_wait.add(now - seq.arrival)
        rows = self.policy.plan()
        if not rows:
            return events, None
        self.steps_planned += 1
        plan = StepPlan(self.steps_planned, tuple(self._plan_row(r) for r in rows))
        self._in_flight = _InFlight(plan, rows, now)
        return events, plan

    def result(self, result: StepResult, now: float) -> list[Event]:
        """Take what the plan in flight gave: commit tokens, end requests."""
        flight = self._in_flight
        if flight is None or result.step != flight.plan.number:
            expected = "no step" if flight is None else f"step {flight.plan.number}"
            raise CoreMisuse(f"a result for step {result.step} while {expected} is in flight")
        self._in_flight = None
        self._now = now
        if result.fatal is not None:
            return self.die(f"a model step failed part-way: {result.fatal}", now)
        rows = flight.rows
        if result.refused is not None:
            return [self._fail(r.seq, f"the step was refused: {result.refused}") for r in rows]
        pooling = [r for r in rows if r.pool]
        if len(result.pooled) != len(pooling):
            raise CoreMisuse(f"step {result.step} has {len(pooling)} pooling rows but its result has {len(result.pooled)}")
        scoring = [r for r, p in zip(rows, flight.plan.rows, strict=True) if p.score is not None]
        if len(result.scored) != len(scoring):
            raise CoreMisuse(f"step {result.step} has {len(scoring)} scoring rows but its result has {len(result.scored)}")
        self.policy.stepped(rows)
        self.policy.timed(rows, now - flight.planned_at)
        self.stats.steps += 1
        self.stats.last_batch = len(rows)
        self.stats.prompt_tokens += sum(max(0, min(len(r.seq.prompt_ids), r.start + len(r.tokens)) - r.start) for r in rows)
        events: list[Event] = self._pool(rows, pooling, result.pooled)
        self._score(rows, scoring, result.scored, events)
        sampling = [r for r in rows if r.samples]
        if result.failed is not None:
            return events + [self._fail(r.seq, result.failed) for r in sampling]
        if len(result.sampled) != len(sampling):
            raise CoreMisuse(f"step {result.step} has {len(sampling)} sampling rows but its result has {len(result.sampled)}")
        for row, tokens in zip(sampling, result.sampled, strict=True):
            if row.draft:  # the tokens after the first were drafted, and right
                kept = min(len(tokens) - 1, len(row.draft))
                self.policy.accepted(row, kept)
                self.stats.draft_tokens += len(row.draft)
                self.stats.draft_accepted += kept
            for sampled in tokens:
                if self._commit(row.seq, sampled, now, events):
                    break
        return events

    def die(self, cause: str, now: float) -> list[Event]:
        """The engine cannot go on: every request ends with an error, and
        every later submission is refused with ``cause``."""
        self._now = now
        self._in_flight = None
        self.stats.dead = cause
        return [self._final(seq, "error", error=f"the engine is dead: {cause}") for seq in self.policy.fail_all()]

    # -- reading -----------------------------------------------------------
    @property
    def in_flight(self) -> StepPlan | None:
        return None if self._in_flight is None else self._in_flight.plan

    def snapshot(self) -> EngineStats:
        pool = self.policy.pool.stats()
        prefix = self.policy.cache.stats() if self.policy.cache is not None else None
        return self.stats.snapshot(
            running=len(self.policy.running),
            waiting=len(self.policy.waiting),
            used=pool.used_blocks - (prefix.idle_blocks if prefix else 0),
            total=pool.total_blocks,
            block_size=pool.block_size,
            prefix=prefix,
        )

    # -- inside ------------------------------------------------------------
    def _sequence(self, request_id: str, request: GenerateRequest, now: float) -> Sequence:
        if self.stats.dead is not None:
            raise EngineDead(self.stats.dead)
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use", field="request_id")
        check_request(request, self.vocab_size)
        if request.pooling in ("first", "score") and not self.policy.whole_prompts:
            raise RequestError(f"pooling {request.pooling!r} needs each prompt whole in one step (an encoder's engine)", field="pooling")
        params = request.params
        if params.seed is None:
            raise RequestError("the seed must be resolved before a request reaches the engine core", field="seed")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.stop_ids)
        return Sequence(
            id=request_id,
            prompt_ids=list(request.prompt_ids),
            params=params,
            seed=params.seed,
            draw_index=request.draw_start,
            stop_ids=frozenset(stop_ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer, context=request.prompt_ids[-4:]),
            stops=StopMatcher(params.stop),
            arrival=now,
            retain=request.retain,
            guide=request.guide,
            pooling=request.pooling,
            adapter=request.adapter,
            cache_salt=request.cache_salt,
            tenant=request.tenant,
            prompt_scores=None if params.prompt_logprobs is None else [],
        )

    def _plan_row(self, row: PlannedRow) -> PlanRow:
        seq = row.seq
        sample = None
        if row.samples:
            history = tuple(seq.history()) if seq.params.penalized else ()
            sample = SampleRow(seq.params, seq.seed, seq.draw_index, history, row.draft)
        score = None
        if seq.prompt_scores is not None and not row.decode:
            # Position p predicts prompt token p + 1: every position of the chunk
            # but the prompt's last (which predicts the first generated token).
            targets = seq.prompt_ids[row.start + 1 : row.start + len(row.tokens) + 1]
            if targets:
                score = ScoreRow(tuple(targets), seq.params.prompt_logprobs)
        return PlanRow(
            seq.id,
            tuple(row.tokens),
            row.start,
            tuple(self.policy.block_table(seq)),
            row.decode,
            sample,
            seq.guide if sample is not None else None,
            row.pool,
            seq.adapter,
            score,
            pool_first=seq.pooling in ("first", "score"),
        )

    def _pool(self, rows: list[PlannedRow], pooling: list[PlannedRow], pooled) -> list[Event]:
        """Add each pooling row's sums to its request; end the embedding
        requests whose prompt is now all prefilled, with their vectors."""
        for row, sums in zip(pooling, pooled, strict=True):
            try:
                row.seq.pool_sums = add_sums(row.seq.pool_sums, sums)
            except ValueError as exc:
                raise CoreMisuse(f"request {row.seq.id}: {exc}") from None
            row.seq.pooled_rows += row.pool
        events: list[Event] = []
        for row in rows:
            seq = row.seq
            if seq.pooling is not None and seq.num_cached >= len(seq.prompt_ids):
                pooled = raw_vector if seq.pooling == "score" else embedding
                vector = pooled(seq.pool_sums or (), seq.pooled_rows)
                self.policy.finish(seq, "stop")
                events.append(self._final(seq, "stop", vector=vector))
        return events

    def _score(self, rows: list[PlannedRow], scoring: list[PlannedRow], scored, events: list[Event]) -> None:
        """Add each scoring row's scores to its request; for each request
        whose prefill this step ended: its PromptEvent, when it scores its
        prompt, and its end, when it generates nothing (max_tokens 0)."""
        for row, scores in zip(scoring, scored, strict=True):
            if row.seq.prompt_scores is None:
                raise CoreMisuse(f"request {row.seq.id} does not score its prompt, but its row has scores")
            row.seq.prompt_scores.extend(scores)
        for row in rows:
            seq = row.seq
            if seq.pooling is not None or not row.ends_prefill:
                continue
            if seq.prompt_scores is not None:
                if len(seq.prompt_scores) != len(seq.prompt_ids) - 1:
                    raise CoreMisuse(f"request {seq.id}: {len(seq.prompt_scores)} prompt tokens scored of {len(seq.prompt_ids) - 1}")
                events.append(PromptEvent(seq.id, tuple(seq.prompt_scores)))
            if seq.params.max_tokens == 0:
                self.policy.finish(seq, "length")
                events.append(self._final(seq, "length"))

    def _commit(self, seq: Sequence, sampled, now: float, events: list[Event]) -> bool:
        """Take one sampled token; True when the request ended with it."""
        if seq.last_token_at is None:
            self.stats.ttft.add(now - seq.arrival)
        else:
            self.stats.inter_token.add(now - seq.last_token_at)
        if seq.guide is not None:
            try:
                seq.guide.advance(sampled.token)
            except ValueError as exc:  # the request's constraint failed (models.guided.GuideFailed names its field)
                events.append(self._fail(seq, str(exc), field=getattr(exc, "field", None)))
                return True
        is_stop_id = sampled.token in seq.stop_ids
        outcome = seq.commit(sampled.token, sampled.draws, now)
        self.stats.generated_tokens += 1
        token = TokenEvent(seq.id, sampled.token, outcome.text, sampled.logprob, sampled.top_logprobs)
        if not is_stop_id:
            events.append(token)
        if outcome.finish_reason is None:
            return False
        self.policy.finish(seq, outcome.finish_reason)
        if is_stop_id:  # its text is what was held back until now; the token itself is listed by logprobs alone
            events.append(self._final(seq, outcome.finish_reason, text=outcome.text, stop_token=attrs.evolve(token, text="")))
        else:
            events.append(self._final(seq, outcome.finish_reason))
        return True

    def _fail(self, seq: Sequence, error: str, field: str | None = None) -> FinalEvent:
        if seq in self.policy.running:
            self.policy.finish(seq, "error")
        return self._final(seq, "error", error=error, error_field=field)

    def _final(self, seq: Sequence, reason: str, *, text: str = "", error: str | None = None, vector=None, stop_token=None, error_field: str | None = None) -> FinalEvent:
        now = self._now
        self.stats.end_to_end.add(now - seq.arrival)
        self.stats.finished[reason] += 1
        timings = Timings(
            queue_s=None if seq.admitted_at is None else seq.admitted_at - seq.arrival,
            ttft_s=None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
            total_s=now - seq.arrival,
        )
        del self.seqs[seq.id]
        usage = Usage(len(seq.prompt_ids), seq.generated, seq.cached_prompt)
        return FinalEvent(seq.id, reason, usage, seq.seed, text, error, timings, seq.draw_index, vector, stop_token, error_field)
