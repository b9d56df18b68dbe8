"""The scheduler actor: the one loop that decides.

It runs two tasks over one state. `intake` answers the inbox at once
(accepting or refusing submissions, marking cancellations) even while a step
is running. `steps` loops: drop cancelled requests and free their blocks;
admit; plan a step; have the worker run it and the sampler pick tokens;
commit tokens and publish events. Publishing never blocks: each request's
event channel holds max_tokens + 2 events.

A request whose consumer closed its event channel counts as cancelled, so a
cancellation cannot be lost even when the inbox is full."""

from __future__ import annotations

import trio

from trioserve.actors.messages import (
    Cancel,
    FinalEvent,
    SampleReply,
    SampleRequest,
    StepReply,
    StepRequest,
    Submit,
    Timings,
    TokenEvent,
    Usage,
    deliver,
)
from trioserve.errors import EngineClosed, EngineDead, RequestError, TrioserveError
from trioserve.models.detokenizer import IncrementalDetokenizer
from trioserve.models.guided import GuideCompiler
from trioserve.models.sampling import Row, new_seed
from trioserve.models.step import SeqChunk
from trioserve.models.tokenizer import Tokenizer
from trioserve.state.scheduling import PlannedRow, SchedulingPolicy
from trioserve.state.sequence import Sequence
from trioserve.state.stats import EngineStats, StatsRecorder
from trioserve.state.stops import StopMatcher


class Scheduler:
    """State of the scheduler actor. Only its own two tasks touch it; others
    read `snapshot`, a frozen record replaced after every change."""

    def __init__(
        self,
        policy: SchedulingPolicy,
        tokenizer: Tokenizer,
        worker: trio.MemorySendChannel,
        sampler: trio.MemorySendChannel,
        guides: GuideCompiler | None = None,
    ):
        self.policy = policy
        self.guides = guides  # computes guided requests' token masks
        self.tokenizer = tokenizer
        self.worker = worker
        self.sampler = sampler
        self.seqs: dict[str, Sequence] = {}
        self.channels: dict[str, trio.MemorySendChannel] = {}
        self.wake = trio.Event()
        # Owners' orders about retained KV: (owner, request id) -> "commit" |
        # "cancel", and (owner, None) -> "forget". Written by `settle` from
        # other tasks and applied in order at the top of every iteration,
        # before admission, so an order is never lost to a full inbox; the
        # map holds at most one entry per request submitted in the meantime.
        self.retention: dict[tuple[str, str | None], str] = {}
        self.recorder = StatsRecorder()
        self.snapshot = self._freeze()

    # -- intake ------------------------------------------------------------
    async def intake(self, inbox: trio.MemoryReceiveChannel) -> None:
        """Answer the inbox until it closes or the engine stops. Submissions
        still queued then are refused, so no caller waits for a reply that
        will never come."""
        try:
            async for message in inbox:
                if isinstance(message, Submit):
                    self._submit(message)
                elif isinstance(message, Cancel):
                    seq = self.seqs.get(message.request_id)
                    if seq is not None:
                        seq.cancelled = True
                self.wake.set()
        finally:
            _refuse_queued(inbox)
            inbox.close()

    def _submit(self, message: Submit) -> None:
        try:
            seq = self._make_sequence(message)
            self.policy.enqueue(seq)
        except TrioserveError as exc:
            self._reply(message, exc)
            message.events.close()
            return
        self.seqs[seq.id] = seq
        self.channels[seq.id] = message.events
        if not self._reply(message, None):
            seq.cancelled = True
        self._refresh()

    def _make_sequence(self, message: Submit) -> Sequence:
        if self.recorder.dead is not None:
            raise EngineDead(self.recorder.dead)
        request = message.request
        if message.request_id in self.seqs:
            raise RequestError(f"request id {message.request_id!r} is already in use", field="request_id")
        params = request.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.stop_ids)
        return Sequence(
            id=message.request_id,
            prompt_ids=list(request.prompt_ids),
            params=params,
            seed=params.seed if params.seed is not None else new_seed(),
            draw_index=request.draw_start,
            stop_ids=frozenset(stop_ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stops=StopMatcher(params.stop),
            arrival=trio.current_time(),
            retain=request.retain,
            guide=request.guide,
        )

    @staticmethod
    def _reply(message: Submit, outcome: BaseException | None) -> bool:
        return deliver(message.reply, outcome)

    def settle(self, owner: str, order: str, request_id: str | None = None) -> None:
        """Record an owner's order (called from other tasks, never blocks)."""
        if order not in ("commit", "cancel", "forget"):
            raise ValueError(f"unknown retention order {order!r}")
        self.retention[(owner, None if order == "forget" else request_id)] = order
        self.wake.set()

    def _apply_retention(self) -> None:
        orders, self.retention = self.retention, {}
        for (owner, request_id), order in orders.items():
            self.policy.settle(owner, order, request_id)
        if orders and self.policy.cache is not None:
            self.policy.cache.trim(trio.current_time())

    # -- the loop ----------------------------------------------------------
    async def steps(self) -> None:
        while True:
            self.wake = trio.Event()
            self._apply_retention()
            self._drop_cancelled()
            now = trio.current_time()
            for seq in self.policy.admit(now):
                self.recorder.queue_wait.add(now - seq.arrival)
            rows = self.policy.plan()
            self._refresh()
            if not rows:
                await self.wake.wait()
                continue
            await self._step(rows)

    def _drop_cancelled(self) -> None:
        for rid, channel in self.channels.items():
            if channel.statistics().open_receive_channels == 0:
                self.seqs[rid].cancelled = True
        for seq in self.policy.drop_cancelled():
            self._final(seq, "cancelled")

    async def _step(self, rows: list[PlannedRow]) -> None:
        chunks = tuple(SeqChunk(r.tokens, r.start, self.policy.block_table(r.seq), r.decode) for r in rows)
        sampling = [r for r in rows if r.samples]
        index = tuple(i for i, r in enumerate(rows) if r.samples)
        guided = [r.seq.guide for r in sampling]
        masks: list = [None]  # the sampling rows' token masks, or the exception that filling them raised
        async with trio.open_nursery() as nursery:
            if self.guides is not None and any(g is not None for g in guided):
                nursery.start_soon(self._fill_masks, guided, masks)  # in a thread, while the forward pass runs
            reply: StepReply = await self._call(self.worker, lambda ch: StepRequest(chunks, index, ch))
        if reply.fatal is not None:
            self._die(f"a model step failed part-way: {reply.fatal}")
            return
        if reply.refused is not None:
            for row in rows:
                self._fail(row.seq, f"the step was refused: {reply.refused}")
            return
        self.policy.stepped(rows)
        self.recorder.steps += 1
        self.recorder.last_batch = len(rows)
        self.recorder.prompt_tokens += sum(max(0, min(len(r.seq.prompt_ids), r.start + len(r.tokens)) - r.start) for r in rows)
        if not sampling:
            return
        sample_rows = [
            Row(r.seq.params, r.seq.seed, r.seq.draw_index, r.seq.history() if r.seq.params.penalized else ())
            for r in sampling
        ]
        # A checkpoint may pad its output head past the tokenizer's vocabulary;
        # those ids name no token, so they are never candidates.
        logits = reply.logits[:, : self.tokenizer.vocab_size]
        if isinstance(masks[0], Exception):
            for row in sampling:
                self._fail(row.seq, f"the output constraint failed: {masks[0]}")
            return
        picked: SampleReply = await self._call(self.sampler, lambda ch: SampleRequest(logits, sample_rows, ch, masks[0]))
        if picked.error is not None:
            for row in sampling:
                self._fail(row.seq, f"sampling failed: {picked.error}")
            return
        now = trio.current_time()
        for row, sampled in zip(sampling, picked.sampled):
            self._commit(row.seq, sampled, now)

    async def _fill_masks(self, guided: list, out: list) -> None:
        try:
            out[0] = await trio.to_thread.run_sync(self.guides.fill_masks, guided)
        except Exception as exc:  # noqa: BLE001 - the step fails its sampling rows with it
            out[0] = exc

    def _commit(self, seq: Sequence, sampled, now: float) -> None:
        if seq.last_token_at is None:
            self.recorder.ttft.add(now - seq.arrival)
        else:
            self.recorder.inter_token.add(now - seq.last_token_at)
        if seq.guide is not None:
            try:
                seq.guide.advance(sampled.token)
            except ValueError as exc:
                self._fail(seq, str(exc))
                return
        is_stop_id = sampled.token in seq.stop_ids
        outcome = seq.commit(sampled.token, sampled.draws, now)
        self.recorder.generated_tokens += 1
        tail = ""
        if is_stop_id:
            tail = outcome.text
        else:
            self._publish(seq, TokenEvent(seq.id, sampled.token, outcome.text, sampled.logprob, sampled.top_logprobs))
        if outcome.finish_reason is not None:
            self.policy.finish(seq, outcome.finish_reason)
            self._final(seq, outcome.finish_reason, text=tail)

    def _fail(self, seq: Sequence, error: str) -> None:
        if seq in self.policy.running:
            self.policy.finish(seq, "error")
        self._final(seq, "error", error=error)

    def _die(self, cause: str) -> None:
        self.recorder.dead = cause
        for seq in self.policy.fail_all():
            self._final(seq, "error", error=f"the engine is dead: {cause}")
        self._refresh()

    # -- publishing ----------------------------------------------------------
    def _publish(self, seq: Sequence, event) -> None:
        if not deliver(self.channels[seq.id], event):
            seq.cancelled = True  # the consumer is gone

    def _final(self, seq: Sequence, reason: str, *, text: str = "", error: str | None = None) -> None:
        now = trio.current_time()
        self.recorder.end_to_end.add(now - seq.arrival)
        self.recorder.finished[reason] += 1
        timings = Timings(
            queue_s=None if seq.admitted_at is None else seq.admitted_at - seq.arrival,
            ttft_s=None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
            total_s=now - seq.arrival,
        )
        usage = Usage(len(seq.prompt_ids), seq.generated)
        self._publish(seq, FinalEvent(seq.id, reason, usage, seq.seed, text, error, timings, seq.draw_index))
        self.channels.pop(seq.id).close()
        del self.seqs[seq.id]

    async def _call(self, actor: trio.MemorySendChannel, make):
        """Send ``make(reply_channel)`` to ``actor`` and wait for its reply."""
        send, receive = trio.open_memory_channel(1)
        async with receive:
            await actor.send(make(send))
            return await receive.receive()

    def _freeze(self) -> EngineStats:
        pool = self.policy.pool.stats()
        prefix = self.policy.cache.stats() if self.policy.cache is not None else None
        return self.recorder.snapshot(
            running=len(self.policy.running),
            waiting=len(self.policy.waiting),
            used=pool.used_blocks - (prefix.idle_blocks if prefix else 0),
            total=pool.total_blocks,
            block_size=pool.block_size,
            prefix=prefix,
        )

    def _refresh(self) -> None:
        self.snapshot = self._freeze()


def _refuse_queued(inbox: trio.MemoryReceiveChannel) -> None:
    while True:
        try:
            message = inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        if isinstance(message, Submit):
            Scheduler._reply(message, EngineClosed("the engine is shut down"))
            message.events.close()


async def run_scheduler(scheduler: Scheduler, inbox: trio.MemoryReceiveChannel, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run intake and the step loop until cancelled (engine shutdown), when
    consumers see their event channels close. A bug that escapes the step
    loop kills the engine like a fatal step: every request in flight gets an
    error, statistics().dead says why, and intake goes on refusing new work."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler.intake, inbox)
            task_status.started()
            try:
                await scheduler.steps()
            except Exception as exc:  # noqa: BLE001 - reported through dead, never lost
                cause = f"internal error in the scheduler: {type(exc).__name__}: {exc}"
                try:
                    scheduler._die(cause)
                except Exception:  # noqa: BLE001 - state may be broken; refusing new work still matters
                    scheduler.recorder.dead = cause
                    scheduler._refresh()
                await trio.sleep_forever()
    finally:
        # After both tasks are done: intake may accept a submission in the
        # same tick the loop is cancelled, and its consumer must still see
        # its stream end.
        for channel in scheduler.channels.values():
            channel.close()
