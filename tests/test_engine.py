"""The engine end to end on the tiny random Llama (fp32): the real scheduler,
worker and sampler actors, no mocks. Faults are injected only through a
`model=` wrapper that delegates to the real DecoderModel.

What is checked: concurrent requests equal their solo runs; cancellation
(before admission, between prefill chunks, mid-decode, plain `break`) frees
blocks within one step and leaves the others untouched; admission never
over-commits the pool; impossible requests and a full queue are refused at
once; stops, lengths and EOS give exact usage and text; a refused step fails
only its rows and a half-applied one kills the engine; seeds replay."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import aclosing

import attrs
import pytest
import torch
import trio
import trio.testing

from trioserve.types import FinalEvent, GenerateRequest, TokenEvent
from trioserve.models.step_runner import StepRefused
from trioserve.config import EngineConfig
from trioserve.engine import Engine, open_engine
from trioserve.errors import EngineClosed, EngineDead, QueueFull, RequestError, RequestTooLarge
from trioserve.models.checkpoint import Checkpoint, load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.types import SEED_LIMIT, SamplingParams
from trioserve.state.kv_pool import blocks_needed

BS = 4  # block size used throughout
KV_BYTES_PER_TOKEN = 512  # tiny model in fp32: 2 (K, V) * 2 layers * 2 KV heads * 16 dims * 4 bytes
EOS = 2
# Every fail_after here only stops a hung test: what a test asserts is counted
# in steps, tokens and blocks, never in seconds. 120 s is over 10x what the
# slowest of them needs on a 2-core AVX2 VM, so a slower CPU cannot fail one.
HANG_S = 120


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints) -> Checkpoint:
    return load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32)


def config(blocks: int = 256, **kw) -> EngineConfig:
    """A config whose pool holds exactly ``blocks`` blocks of BS tokens."""
    kw.setdefault("max_num_seqs", 6)
    kw.setdefault("prefill_budget", 24)
    return EngineConfig(kv_cache_bytes=blocks * BS * KV_BYTES_PER_TOKEN, block_size=BS, dtype="float32", **kw)


def reserve(request: GenerateRequest) -> int:
    """Blocks admission reserves for ``request``."""
    return blocks_needed(len(request.prompt_ids) + request.params.max_tokens, BS)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


# -- consuming requests -------------------------------------------------------


@attrs.define
class Outcome:
    tokens: list[int]
    texts: list[str]
    final: FinalEvent

    @property
    def text(self) -> str:
        return "".join(self.texts) + self.final.text

    def same_as(self, other: Outcome) -> bool:
        a, b = self.final, other.final
        return (self.tokens, self.text, a.finish_reason, a.usage, a.seed) == (
            other.tokens,
            other.text,
            b.finish_reason,
            b.usage,
            b.seed,
        )


async def collect(engine: Engine, request: GenerateRequest) -> Outcome:
    """Run ``request`` to its end; checks the event stream's shape."""
    tokens, texts, final = [], [], None
    async with aclosing(engine.generate(request)) as events:
        async for event in events:
            assert final is None, "an event after the FinalEvent"
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
                texts.append(event.text)
            else:
                assert isinstance(event, FinalEvent)
                final = event
    assert final is not None, "the stream ended without a FinalEvent"
    return Outcome(tokens, texts, final)


async def solo_runs(ckpt: Checkpoint, requests: list[GenerateRequest]) -> list[Outcome]:
    """Each request alone, one after the other, in a fresh engine that
    prefills whole prompts in one step (unlike the engines under test)."""
    async with open_engine(config(max_num_seqs=1, prefill_budget=512), checkpoint=ckpt) as engine:
        return [await collect(engine, r) for r in requests]


async def wait_until(predicate: Callable[[], bool], poll: float = 0.0) -> None:
    while not predicate():
        await trio.sleep(poll)


def accepted(engine: Engine) -> int:
    """Requests the scheduler has taken: waiting, running or finished."""
    s = engine.statistics()
    return s.waiting + s.running + sum(n for _, n in s.finished)


class Watcher:
    """Every snapshot the scheduler's step loop publishes, in order.

    The loop refreshes the snapshot and then awaits the worker thread (or
    its wake event) before the next refresh, so a task that checks at every
    scheduling point sees each one."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.seen = [engine.statistics()]

    async def run(self) -> None:
        while True:
            snap = self.engine.statistics()
            if snap is not self.seen[-1]:
                self.seen.append(snap)
            await trio.sleep(0)

    def first(self, predicate):
        """The first snapshot for which ``predicate`` holds, and the one before it."""
        for before, snap in zip(self.seen, self.seen[1:]):
            if predicate(snap):
                return before, snap
        raise AssertionError("no snapshot matched")


class WrappedModel:
    """The real DecoderModel behind a thin wrapper that records each step's
    layout, can hold the first step until ``gate`` is set, and can fail one
    chosen forward call: "refuse" raises StepRefused before the real forward
    runs; "half" runs the real forward (the cache is written) and then raises."""

    def __init__(self, inner: DecoderModel, *, fail_call: int | None = None, mode: str | None = None, gate: threading.Event | None = None):
        self.inner = inner
        self.fail_call = fail_call
        self.mode = mode
        self.gate = gate
        self.steps: list[list[tuple[int, tuple[int, ...]]]] = []  # per forward: (start, token ids) of each sequence

    @property
    def config(self):
        return self.inner.config

    @property
    def device(self):
        return self.inner.device

    @property
    def batch_invariant(self):
        return self.inner.batch_invariant

    @property
    def lora(self):
        return self.inner.lora

    @property
    def kernels(self):
        return self.inner.kernels

    @property
    def dtype(self):
        return self.inner.dtype

    @property
    def kv_dtype(self):
        return self.inner.kv_dtype

    def kv_bytes_per_token(self) -> int:
        return self.inner.kv_bytes_per_token()

    def new_kv_cache(self, num_blocks: int, block_size: int, **options):
        return self.inner.new_kv_cache(num_blocks, block_size, **options)

    @property
    def layouts(self) -> list[list[tuple[int, int]]]:
        """Per forward: (start, number of new tokens) of each sequence."""
        return [[(start, len(ids)) for start, ids in step] for step in self.steps]

    def forward(self, batch, cache):
        if self.gate is not None and not self.steps:
            assert self.gate.wait(timeout=HANG_S), "the test never opened the gate"
        lasts = batch.last_index.tolist()
        positions = batch.positions.tolist()
        ids = batch.token_ids.tolist()
        firsts = [0] + [last + 1 for last in lasts[:-1]]
        self.steps.append([(positions[f], tuple(ids[f : last + 1])) for f, last in zip(firsts, lasts)])
        if len(self.steps) == self.fail_call:
            if self.mode == "refuse":
                raise StepRefused("injected refusal")
            self.inner.forward(batch, cache)
            raise RuntimeError("injected fault after the forward ran")
        return self.inner.forward(batch, cache)


def test_kv_bytes_per_token_is_what_the_configs_assume(ckpt):
    assert DecoderModel.from_checkpoint(ckpt).kv_bytes_per_token() == KV_BYTES_PER_TOKEN


# -- 1. concurrency equals solo -----------------------------------------------


def sixteen_requests(vocab: int) -> list[GenerateRequest]:
    rng = random.Random(16)
    lengths = [1, 3, 7, 12, 23, 24, 25, 31, 40, 47, 55, 61, 70, 9, 18, 33]
    rng.shuffle(lengths)
    requests = []
    for i, n in enumerate(lengths):
        if i % 2 == 0:
            params = SamplingParams(max_tokens=rng.randint(6, 24), temperature=0.0, seed=100 + i)
        else:
            params = SamplingParams(
                max_tokens=rng.randint(6, 24),
                temperature=0.8,
                top_p=[1.0, 0.9, 0.7, 0.5][(i // 2) % 4],
                top_k=[0, 5, 40, 0][(i // 2 + 1) % 4],
                seed=100 + i,
            )
        requests.append(GenerateRequest(random_prompt(rng, n, vocab), params, request_id=f"r{i}"))
    return requests


async def test_sixteen_concurrent_requests_equal_their_solo_runs(ckpt):
    requests = sixteen_requests(ckpt.tokenizer.vocab_size)
    with trio.fail_after(HANG_S):
        solo = await solo_runs(ckpt, requests)
        model = WrappedModel(DecoderModel.from_checkpoint(ckpt, batch_invariant=True))
        together: dict[int, Outcome] = {}
        async with open_engine(config(max_num_seqs=6, prefill_budget=24), checkpoint=ckpt, model=model) as engine:

            async def run(i: int) -> None:
                together[i] = await collect(engine, requests[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(requests)):
                    nursery.start_soon(run, i)
            # The same requests again, one at a time, after the others.
            again = [await collect(engine, r) for r in requests[:4]]
            stats = engine.statistics()
    for i, request in enumerate(requests):
        assert together[i].same_as(solo[i]), (i, together[i], solo[i])
        assert together[i].final.usage.prompt_tokens == len(request.prompt_ids)
    for i, outcome in enumerate(again):
        assert outcome.same_as(solo[i])
    # The batching really varied: never more than 6 rows, sometimes 6; a
    # step mixing decode rows with prefill chunks; prompts cut into chunks
    # that continue at start > 0; and the step budget respected.
    rows = [len(layout) for layout in model.layouts]
    assert max(rows) == 6
    assert all(sum(n for _, n in layout) <= 24 for layout in model.layouts)
    assert any(any(n == 1 and s > 0 for s, n in layout) and any(n > 1 for _, n in layout) for layout in model.layouts)
    assert any(s > 0 and n > 1 for layout in model.layouts for s, n in layout)
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert sum(n for _, n in stats.finished) == 20
    assert stats.generated_tokens == sum(o.final.usage.completion_tokens for o in together.values()) + sum(
        o.final.usage.completion_tokens for o in again
    )


# -- 2. cancellation ------------------------------------------------------------


def long_runner(vocab: int, seed: int, prompt_len: int = 6, max_tokens: int = 40) -> GenerateRequest:
    rng = random.Random(seed)
    return GenerateRequest(
        random_prompt(rng, prompt_len, vocab),
        SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed, ignore_eos=True),
        request_id=f"runner-{seed}",
    )


def check_dropped_within_one_step(watcher: Watcher, at_cancel, still_reserved: int, running: int, left=None) -> None:
    """The first snapshot that counts the cancellation came at most one
    step after the consumer left (``left``: the statistics when its task had
    closed its events; by default ``at_cancel``, taken just before): the
    step the worker may have been running then is finished and counted,
    and the very next loop iteration drops the request (the consumer told
    the scheduler it left, `Scheduler.leave`, as its generation closed).
    Its blocks are back in the pool in that same snapshot, while nothing
    else started or finished. (A scope cancelled from another task leaves
    only when that task next runs; a tiny model's steps are short enough to
    finish one in between, so the count starts there.)"""
    left = at_cancel if left is None else left
    before, snap = watcher.first(lambda s: s.finished_count("cancelled") == at_cancel.finished_count("cancelled") + 1)
    assert snap.steps - left.steps <= 1, (at_cancel.steps, left.steps, snap.steps)
    assert snap.kv_blocks_used == still_reserved
    assert snap.running == running
    assert snap.waiting == 0


async def test_cancel_before_admission(ckpt):
    vocab = ckpt.tokenizer.vocab_size
    runners = [long_runner(vocab, 1), long_runner(vocab, 2)]
    stuck = GenerateRequest([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0), request_id="stuck")
    # A hang guard, not a speed test: ~2 s here, missed at 20 s on a 2-core AVX2 machine.
    with trio.fail_after(HANG_S):
        solo = await solo_runs(ckpt, runners)
        async with open_engine(config(max_num_seqs=2), checkpoint=ckpt) as engine:
            watcher = Watcher(engine)
            results: dict[int, Outcome] = {}
            got: list = []
            left: list = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watcher.run)

                async def run(i: int) -> None:
                    results[i] = await collect(engine, runners[i])

                for i in range(2):
                    nursery.start_soon(run, i)
                await wait_until(lambda: engine.statistics().running == 2)
                scope = trio.CancelScope()

                async def stuck_consumer() -> None:
                    with scope:
                        async with aclosing(engine.generate(stuck)) as events:
                            async for event in events:
                                got.append(event)
                    left.append(engine.statistics())  # its events are closed now

                nursery.start_soon(stuck_consumer)
                await wait_until(lambda: engine.statistics().waiting == 1)
                at_cancel = engine.statistics()
                assert at_cancel.kv_blocks_used == reserve(runners[0]) + reserve(runners[1])
                scope.cancel()
                await wait_until(lambda: len(results) == 2)
                nursery.cancel_scope.cancel()
            stats = engine.statistics()
    assert got == [] and scope.cancelled_caught
    check_dropped_within_one_step(watcher, at_cancel, reserve(runners[0]) + reserve(runners[1]), running=2, left=left[0])
    for i in range(2):
        assert results[i].same_as(solo[i])
    assert stats.kv_blocks_used == 0 and stats.waiting == 0 and stats.running == 0
    assert stats.finished_count("cancelled") == 1 and stats.finished_count("length") == 2
    assert stats.queue_wait.count == 2  # the stuck request was never admitted


async def test_cancel_between_prefill_chunks(ckpt):
    vocab = ckpt.tokenizer.vocab_size
    runners = [long_runner(vocab, 3), long_runner(vocab, 4)]
    long_prompt = random_prompt(random.Random(5), 150, vocab)
    long = GenerateRequest(long_prompt, SamplingParams(max_tokens=8, temperature=0.0), request_id="long")
    with trio.fail_after(HANG_S):
        solo = await solo_runs(ckpt, runners)
        async with open_engine(config(max_num_seqs=4, prefill_budget=24), checkpoint=ckpt) as engine:
            watcher = Watcher(engine)
            results: dict[int, Outcome] = {}
            got: list = []
            left: list = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watcher.run)
                first_tokens = [trio.Event(), trio.Event()]

                async def run(i: int) -> None:
                    outcome = Outcome([], [], None)
                    async with aclosing(engine.generate(runners[i])) as events:
                        async for event in events:
                            first_tokens[i].set()
                            if isinstance(event, TokenEvent):
                                outcome.tokens.append(event.token_id)
                                outcome.texts.append(event.text)
                            else:
                                outcome.final = event
                    results[i] = outcome

                for i in range(2):
                    nursery.start_soon(run, i)
                for event in first_tokens:
                    await event.wait()  # both runners are decoding now
                base = engine.statistics()
                scope = trio.CancelScope()

                async def long_consumer() -> None:
                    with scope:
                        async with aclosing(engine.generate(long)) as events:
                            async for event in events:
                                got.append(event)
                    left.append(engine.statistics())  # its events are closed now

                nursery.start_soon(long_consumer)
                # Cancel once the first chunk of the long prompt is computed.
                await wait_until(lambda: engine.statistics().prompt_tokens > base.prompt_tokens)
                at_cancel = engine.statistics()
                scope.cancel()
                await wait_until(lambda: len(results) == 2)
                nursery.cancel_scope.cancel()
            stats = engine.statistics()
    # Chunks are at most 24 - 2 decode rows = 22 tokens: the long prompt was
    # mid-prefill when cancelled, and never finished prefilling.
    assert 0 < at_cancel.prompt_tokens - base.prompt_tokens <= 22
    assert at_cancel.kv_blocks_used == reserve(runners[0]) + reserve(runners[1]) + reserve(long)
    check_dropped_within_one_step(watcher, at_cancel, reserve(runners[0]) + reserve(runners[1]), running=2, left=left[0])
    assert stats.prompt_tokens - base.prompt_tokens < len(long_prompt)
    assert got == [] and scope.cancelled_caught
    for i in range(2):
        assert results[i].same_as(solo[i])
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.finished_count("cancelled") == 1 and stats.finished_count("length") == 2


async def test_cancel_mid_decode_with_aclosing(ckpt):
    vocab = ckpt.tokenizer.vocab_size
    runners = [long_runner(vocab, 6), long_runner(vocab, 7)]
    victim = long_runner(vocab, 8, prompt_len=10, max_tokens=30)
    k = 3
    with trio.fail_after(HANG_S):
        solo = await solo_runs(ckpt, [*runners, victim])
        async with open_engine(config(max_num_seqs=4), checkpoint=ckpt) as engine:
            watcher = Watcher(engine)
            results: dict[int, Outcome] = {}
            seen: list[int] = []
            marks = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watcher.run)

                async def run(i: int) -> None:
                    results[i] = await collect(engine, runners[i])

                for i in range(2):
                    nursery.start_soon(run, i)
                await wait_until(lambda: engine.statistics().running == 2)
                async with aclosing(engine.generate(victim)) as events:
                    async for event in events:
                        assert isinstance(event, TokenEvent)
                        seen.append(event.token_id)
                        if len(seen) == k:
                            marks["at_cancel"] = engine.statistics()
                            break
                await wait_until(lambda: len(results) == 2)
                nursery.cancel_scope.cancel()
            stats = engine.statistics()
    assert seen == solo[2].tokens[:k]
    assert marks["at_cancel"].kv_blocks_used == sum(reserve(r) for r in [*runners, victim])
    check_dropped_within_one_step(watcher, marks["at_cancel"], reserve(runners[0]) + reserve(runners[1]), running=2)
    for i in range(2):
        assert results[i].same_as(solo[i])
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.finished_count("cancelled") == 1 and stats.finished_count("length") == 2


@pytest.mark.filterwarnings("ignore:Async generator .* was garbage collected:ResourceWarning")
async def test_cancel_by_plain_break_is_seen_within_a_bounded_wait(ckpt):
    """A plain `break` leaves the generator to be closed when it is garbage
    collected: trio's finalizer hook schedules its aclose() in a system task
    (and warns). The request must still be cancelled promptly."""
    vocab = ckpt.tokenizer.vocab_size
    runner = long_runner(vocab, 9, max_tokens=60)
    victim = long_runner(vocab, 10, prompt_len=5, max_tokens=40)
    with trio.fail_after(HANG_S):
        solo = await solo_runs(ckpt, [runner, victim])
        async with open_engine(config(max_num_seqs=4), checkpoint=ckpt) as engine:
            results: dict[int, Outcome] = {}
            seen: list[int] = []
            async with trio.open_nursery() as nursery:

                async def run() -> None:
                    results[0] = await collect(engine, runner)

                nursery.start_soon(run)
                await wait_until(lambda: engine.statistics().running == 1)
                async for event in engine.generate(victim):
                    seen.append(event.token_id)
                    if len(seen) == 2:
                        break
                at_break = engine.statistics()
                with trio.fail_after(HANG_S):
                    await wait_until(lambda: engine.statistics().finished_count("cancelled") == 1)
                dropped = engine.statistics()
                # The aclose runs in the next scheduling batch; at most the step
                # in flight then, plus one that may have started before the
                # system task ran, complete before the drop.
                assert dropped.steps - at_break.steps <= 2
                assert dropped.kv_blocks_used == reserve(runner) and dropped.running == 1
                await wait_until(lambda: 0 in results)
            stats = engine.statistics()
    assert seen == solo[1].tokens[:2]
    assert results[0].same_as(solo[0])
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.finished_count("cancelled") == 1


# -- 3. admission -----------------------------------------------------------------


async def test_admission_never_over_commits_the_pool(ckpt):
    vocab = ckpt.tokenizer.vocab_size
    rng = random.Random(30)
    requests = []
    for i in range(10):
        n = rng.randint(2, 8)
        # prompt + max_tokens = 12 tokens = 3 blocks each; the pool holds 9.
        params = SamplingParams(max_tokens=12 - n, temperature=[0.0, 0.8][i % 2], seed=i)
        requests.append(GenerateRequest(random_prompt(rng, n, vocab), params, request_id=f"a{i}"))
    assert {reserve(r) for r in requests} == {3}
    with trio.fail_after(HANG_S):
        solo = await solo_runs(ckpt, requests)
        model = WrappedModel(DecoderModel.from_checkpoint(ckpt, batch_invariant=True))
        async with open_engine(config(blocks=9, max_num_seqs=6), checkpoint=ckpt, model=model) as engine:
            watcher = Watcher(engine)
            results: dict[int, Outcome] = {}
            async with trio.open_nursery() as outer:
                outer.start_soon(watcher.run)
                async with trio.open_nursery() as nursery:

                    async def run(i: int) -> None:
                        results[i] = await collect(engine, requests[i])

                    for i in range(10):
                        nursery.start_soon(run, i)
                        # One at a time, so arrival order is submission order.
                        await wait_until(lambda: accepted(engine) == i + 1)
                outer.cancel_scope.cancel()
            stats = engine.statistics()
    assert max(s.running for s in watcher.seen) == 3
    assert all(s.kv_blocks_used <= 9 for s in watcher.seen)
    assert any(s.waiting > 0 for s in watcher.seen)
    for i in range(10):
        assert results[i].same_as(solo[i])
    # Oldest first: prompts start prefilling (which follows admission order)
    # in arrival order, and never more than three are in flight in a step.
    first_chunks = [(start, ids) for step in model.steps for start, ids in step if start == 0]
    order = [next(i for i, r in enumerate(requests) if tuple(r.prompt_ids[: len(ids)]) == ids) for _, ids in first_chunks]
    assert order == list(range(10))
    assert max(len(step) for step in model.steps) == 3
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert sum(n for _, n in stats.finished) == 10


async def test_impossible_requests_fail_at_once_with_the_numbers(ckpt):
    vocab = ckpt.tokenizer.vocab_size
    rng = random.Random(31)
    busy = long_runner(vocab, 11, max_tokens=40)  # 46 tokens: 12 of the 16 blocks
    with trio.fail_after(HANG_S):
        async with open_engine(config(blocks=16, max_model_len=100), checkpoint=ckpt) as engine:
            async with trio.open_nursery() as nursery:
                done = trio.Event()

                async def run() -> None:
                    await collect(engine, busy)
                    done.set()

                nursery.start_soon(run)
                await wait_until(lambda: engine.statistics().running == 1)

                # Longer than max_model_len (100).
                too_long = GenerateRequest(random_prompt(rng, 90, vocab), SamplingParams(max_tokens=20))
                with pytest.raises(RequestTooLarge) as info:
                    async with aclosing(engine.generate(too_long)) as events:
                        await events.__anext__()
                message = str(info.value)
                for number in ("90", "20", "110", "100"):
                    assert number in message, message
                assert info.value.field == "max_tokens"

                # Fits the model length, not the 16-block (64-token) pool.
                too_big = GenerateRequest(random_prompt(rng, 60, vocab), SamplingParams(max_tokens=10))
                with pytest.raises(RequestTooLarge) as info:
                    async with aclosing(engine.generate(too_big)) as events:
                        await events.__anext__()
                message = str(info.value)
                for number in ("60", "10", "70", "18", "16", "64"):
                    assert number in message, message
                # Refused while the runner still runs: nothing waited.
                assert not done.is_set()
                assert engine.statistics().waiting == 0

                # Exactly the pool's size is accepted (after the runner).
                exact = GenerateRequest(random_prompt(rng, 54, vocab), SamplingParams(max_tokens=10, temperature=0.0))
                assert reserve(exact) == 16
                outcome = await collect(engine, exact)
                assert outcome.final.finish_reason in ("length", "stop")
            stats = engine.statistics()
    assert stats.kv_blocks_used == 0
    assert sum(n for _, n in stats.finished) == 2


async def test_full_queue_refuses_with_retry_after(ckpt):
    vocab = ckpt.tokenizer.vocab_size
    busy = long_runner(vocab, 12, max_tokens=60)
    waiters = [long_runner(vocab, 13, max_tokens=5), long_runner(vocab, 14, max_tokens=5), long_runner(vocab, 15, max_tokens=5)]
    with trio.fail_after(HANG_S):
        solo = await solo_runs(ckpt, [busy, *waiters])
        cfg = config(max_num_seqs=1, prefill_budget=8, max_queue=2, retry_after_s=2.5)
        async with open_engine(cfg, checkpoint=ckpt) as engine:
            results: dict[int, Outcome] = {}
            async with trio.open_nursery() as nursery:

                async def run(i: int, request: GenerateRequest) -> None:
                    results[i] = await collect(engine, request)

                nursery.start_soon(run, 0, busy)
                await wait_until(lambda: engine.statistics().running == 1)
                scopes = [trio.CancelScope(), trio.CancelScope()]

                async def waiter(i: int) -> None:
                    with scopes[i]:
                        await run(i + 1, waiters[i])

                for i in range(2):
                    nursery.start_soon(waiter, i)
                await wait_until(lambda: engine.statistics().waiting == 2)
                with pytest.raises(QueueFull) as info:
                    async with aclosing(engine.generate(waiters[2])) as events:
                        await events.__anext__()
                assert info.value.retry_after == 2.5 and info.value.waiting == 2
                assert "2.5" in str(info.value)
                # Room again once a waiter leaves.
                scopes[1].cancel()
                await wait_until(lambda: engine.statistics().waiting == 1)
                nursery.start_soon(run, 3, waiters[2])
            stats = engine.statistics()
    assert results[0].same_as(solo[0])
    assert results[1].same_as(solo[1])
    assert 2 not in results
    assert results[3].same_as(solo[3])
    assert stats.finished_count("cancelled") == 1 and stats.kv_blocks_used == 0


@pytest.mark.parametrize("max_tokens", [-1, -5, 2.5])  # 0 is a prompt alone (tests/core/test_prompt_scoring.py)
async def test_bad_max_tokens_is_a_request_error(ckpt, max_tokens):
    # Validation happens before anything is sized from max_tokens: -5 must not
    # reach trio's channel constructor, nor 2.5 arithmetic.
    with trio.fail_after(HANG_S):
        async with open_engine(config(), checkpoint=ckpt) as engine:
            with pytest.raises(RequestError) as info:
                async with aclosing(engine.generate(GenerateRequest([5, 6], SamplingParams(max_tokens=max_tokens)))) as events:
                    await events.__anext__()
            assert info.value.field == "max_tokens"
            assert engine.statistics().waiting == 0


# -- 4. stops, lengths, EOS, usage ------------------------------------------------


def spanning_stop(base: Outcome) -> tuple[str, int]:
    """A stop string whose first occurrence in the base run's streamed text
    starts inside one token's text and ends inside a later one; returns it
    and the index of its first character."""
    ends, total = [], 0
    for text in base.texts:
        total += len(text)
        ends.append(total)
    full = "".join(base.texts)
    for i in range(3, len(base.texts) - 2):
        b = ends[i]
        if not base.texts[i] or b + 2 > len(full):
            continue
        stop = full[b - 1 : b + 2]
        if "\ufffd" not in stop and full.find(stop) == b - 1:
            return stop, b - 1
    raise AssertionError(f"no stop candidate in {full!r}")


def tokens_to_reach(base: Outcome, end: int) -> int:
    """How many tokens the base run took until its streamed text had ``end`` characters."""
    total = 0
    for n, text in enumerate(base.texts, 1):
        total += len(text)
        if total >= end:
            return n
    raise AssertionError("the text never got that long")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_stop_strings_spanning_tokens(ckpt, temperature):
    prompt = ckpt.tokenizer.encode("The quick brown fox jumps over")
    base_params = SamplingParams(max_tokens=40, temperature=temperature, seed=21, ignore_eos=True)
    with trio.fail_after(HANG_S):
        async with open_engine(config(), checkpoint=ckpt) as engine:
            base = await collect(engine, GenerateRequest(prompt, base_params))
            assert base.final.finish_reason == "length"
            stop, at = spanning_stop(base)
            full = "".join(base.texts)
            n = tokens_to_reach(base, at + len(stop))
            assert n >= 2 and tokens_to_reach(base, at + 1) < n  # really spans a token boundary

            stopped = await collect(engine, GenerateRequest(prompt, attrs.evolve(base_params, stop=(stop,))))
            # A stop that never occurs changes nothing; one whose first
            # occurrence starts later loses to the earlier one.
            later = [full[j : j + 3] for j in range(at + 1, len(full) - 2) if full.find(full[j : j + 3]) > at][:1]
            both = await collect(engine, GenerateRequest(prompt, attrs.evolve(base_params, stop=("\x00never\x00", *later, stop))))
            # The stop completes exactly at max_tokens: still "stop".
            at_limit = await collect(engine, GenerateRequest(prompt, attrs.evolve(base_params, stop=(stop,), max_tokens=n)))
    for outcome in (stopped, both, at_limit):
        assert outcome.final.finish_reason == "stop"
        assert outcome.tokens == base.tokens[:n]
        assert outcome.final.usage.completion_tokens == n
        assert outcome.final.usage.prompt_tokens == len(prompt)
        assert outcome.text == full[:at]
        assert stop not in outcome.text


async def test_length_and_eos_and_stop_token_ids_usage(ckpt):
    tok = ckpt.tokenizer
    assert tok.eos_id == EOS
    prompt = tok.encode("Hello, world! How are you")
    with trio.fail_after(HANG_S):
        async with open_engine(config(), checkpoint=ckpt) as engine:
            base = await collect(engine, GenerateRequest(prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)))
            forced_eos = await collect(
                engine, GenerateRequest(prompt, SamplingParams(max_tokens=10, temperature=0.8, seed=5, logit_bias=((EOS, 100.0),)))
            )
            ignored_eos = await collect(
                engine,
                GenerateRequest(prompt, SamplingParams(max_tokens=4, temperature=0.0, logit_bias=((EOS, 100.0),), ignore_eos=True)),
            )
            k = next(i for i in range(3, 30) if base.tokens[i] not in base.tokens[:i])
            by_id = await collect(
                engine,
                GenerateRequest(
                    prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True, stop_token_ids=(base.tokens[k],))
                ),
            )
            stats = engine.statistics()
    # Length: every sampled token streamed, text is the decoded output.
    assert base.final.finish_reason == "length"
    assert base.final.usage.completion_tokens == len(base.tokens) == 30
    assert base.final.usage.prompt_tokens == len(prompt)
    assert base.text == tok.decode(base.tokens)
    # EOS: sampled and counted, not streamed, no text.
    assert forced_eos.final.finish_reason == "stop"
    assert forced_eos.tokens == [] and forced_eos.text == ""
    assert forced_eos.final.usage.completion_tokens == 1
    assert forced_eos.final.usage.prompt_tokens == len(prompt)
    # ignore_eos: EOS is an ordinary (special, textless) token.
    assert ignored_eos.final.finish_reason == "length"
    assert ignored_eos.tokens == [EOS] * 4 and ignored_eos.text == ""
    assert ignored_eos.final.usage.completion_tokens == 4
    # stop_token_ids mid-output: the k tokens before it, the stop id counted.
    assert by_id.final.finish_reason == "stop"
    assert by_id.tokens == base.tokens[:k]
    assert by_id.final.usage.completion_tokens == k + 1
    assert by_id.text == tok.decode(base.tokens[:k])
    assert stats.generated_tokens == 30 + 1 + 4 + k + 1
    assert stats.finished_count("stop") == 2 and stats.finished_count("length") == 2


# -- 5. faults ------------------------------------------------------------------------


def fault_requests(vocab: int) -> list[GenerateRequest]:
    rng = random.Random(50)
    return [
        GenerateRequest(
            random_prompt(rng, n, vocab),
            SamplingParams(max_tokens=8, temperature=[0.0, 0.8][i % 2], seed=i, ignore_eos=True),
            request_id=f"f{i}",
        )
        for i, n in enumerate([5, 9, 4, 7, 6])
    ]


async def test_refused_step_fails_only_its_rows(ckpt):
    """Three 30-token prompts under a 24-token budget, one row more waiting.
    Step 1 (held until all four are accepted) is A[0:24]; then B and C are
    admitted, and step 2 is A[24:30] + B[0:9] + C[0:9] (the budget A leaves
    shared evenly between B and C), while D waits for a place. Step 2 is
    refused: A, B and C fail, D goes on, as does a later request."""
    vocab = ckpt.tokenizer.vocab_size
    rng = random.Random(51)
    requests = [
        GenerateRequest(
            random_prompt(rng, n, vocab),
            SamplingParams(max_tokens=8, temperature=[0.0, 0.8][i % 2], seed=i, ignore_eos=True),
            request_id=f"f{i}",
        )
        for i, n in enumerate([30, 30, 30, 6, 9])
    ]
    with trio.fail_after(HANG_S):
        solo = await solo_runs(ckpt, requests)
        gate = threading.Event()
        model = WrappedModel(DecoderModel.from_checkpoint(ckpt, batch_invariant=True), fail_call=2, mode="refuse", gate=gate)
        results: dict[int, Outcome] = {}
        async with open_engine(config(max_num_seqs=3, prefill_budget=24), checkpoint=ckpt, model=model) as engine:
            async with trio.open_nursery() as nursery:

                async def run(i: int) -> None:
                    results[i] = await collect(engine, requests[i])

                for i in range(4):
                    nursery.start_soon(run, i)
                    await wait_until(lambda: accepted(engine) == i + 1)
                gate.set()
            mid = engine.statistics()
            after = await collect(engine, requests[4])
            stats = engine.statistics()
    assert model.layouts[:2] == [[(0, 24)], [(24, 6), (0, 9), (0, 9)]]
    for i in (0, 1, 2):
        final = results[i].final
        assert final.finish_reason == "error", final
        assert "injected refusal" in final.error and "refused" in final.error
        assert results[i].tokens == [] and final.usage.completion_tokens == 0
    assert results[3].same_as(solo[3])
    assert after.same_as(solo[4])
    assert mid.dead is None and stats.dead is None
    assert mid.finished_count("error") == 3 and mid.finished_count("length") == 1
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0


async def test_half_applied_step_kills_the_engine(ckpt):
    with trio.fail_after(HANG_S):
        requests = fault_requests(ckpt.tokenizer.vocab_size)
        gate = threading.Event()
        model = WrappedModel(DecoderModel.from_checkpoint(ckpt, batch_invariant=True), fail_call=3, mode="half", gate=gate)
        results: dict[int, Outcome] = {}
        async with open_engine(config(max_num_seqs=2), checkpoint=ckpt, model=model) as engine:
            async with trio.open_nursery() as nursery:

                async def run(i: int) -> None:
                    results[i] = await collect(engine, requests[i])

                for i in range(4):
                    nursery.start_soon(run, i)
                    await wait_until(lambda: accepted(engine) == i + 1)
                gate.set()
            stats = engine.statistics()
            with pytest.raises(EngineDead) as info:
                async with aclosing(engine.generate(requests[4])) as events:
                    await events.__anext__()
            assert "injected fault" in info.value.cause
    assert len(model.layouts) == 3  # nothing ran after the fault
    for i in range(4):  # running (A, B) and waiting (C, D) alike
        final = results[i].final
        assert final.finish_reason == "error", final
        assert "dead" in final.error and "injected fault" in final.error
        assert final.usage.completion_tokens == len(results[i].tokens)
    assert results[2].tokens == [] and results[3].tokens == []
    assert stats.dead is not None and "RuntimeError: injected fault" in stats.dead
    assert stats.finished_count("error") == 4
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0


# -- 6. seeds -------------------------------------------------------------------------


async def test_greedy_ignores_the_seed_and_reports_it(ckpt):
    prompt = ckpt.tokenizer.encode("A tokenizer turns text into")
    with trio.fail_after(HANG_S):
        async with open_engine(config(), checkpoint=ckpt) as engine:
            runs = [
                await collect(engine, GenerateRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0, seed=seed)))
                for seed in (1, SEED_LIMIT - 1, None)
            ]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    assert runs[0].text == runs[1].text == runs[2].text
    assert runs[0].final.seed == 1 and runs[1].final.seed == SEED_LIMIT - 1
    assert isinstance(runs[2].final.seed, int) and 0 <= runs[2].final.seed < SEED_LIMIT


async def test_unseeded_request_reports_a_seed_that_replays_it(ckpt):
    prompt = ckpt.tokenizer.encode("In the morning the server")
    params = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    with trio.fail_after(HANG_S):
        async with open_engine(config(), checkpoint=ckpt) as engine:
            first = await collect(engine, GenerateRequest(prompt, params))
            second = await collect(engine, GenerateRequest(prompt, params))
            replay = await collect(engine, GenerateRequest(prompt, attrs.evolve(params, seed=first.final.seed)))
    assert 0 <= first.final.seed < SEED_LIMIT
    assert first.final.seed != second.final.seed
    assert replay.final.seed == first.final.seed
    assert replay.tokens == first.tokens and replay.text == first.text


# -- stress -------------------------------------------------------------------------------


async def test_random_cancellations_leave_a_clean_engine(ckpt):
    vocab = ckpt.tokenizer.vocab_size
    rng = random.Random(99)
    requests, plans = [], []
    for i in range(30):
        params = SamplingParams(
            max_tokens=rng.randint(3, 16), temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 10]), seed=rng.randrange(1000)
        )
        requests.append(GenerateRequest(random_prompt(rng, rng.randint(1, 45), vocab), params, request_id=f"s{i}"))
        # none: run to the end; "time": cancel the scope after a random delay
        # (waiting, prefilling or decoding); "tokens": leave after k tokens.
        plans.append((rng.uniform(0, 0.03), rng.choice(["none", "time", "tokens"]), rng.uniform(0.002, 0.06), rng.randint(1, 4)))
    with trio.fail_after(HANG_S):
        solo = await solo_runs(ckpt, requests)
        cancelled: set[int] = set()
        seen: dict[int, list[int]] = {}
        finals: dict[int, FinalEvent] = {}
        async with open_engine(config(blocks=40, max_num_seqs=6, prefill_budget=24), checkpoint=ckpt) as engine:

            async def run(i: int) -> None:
                delay, how, after, k = plans[i]
                await trio.sleep(delay)
                seen[i] = []
                with trio.move_on_after(after if how == "time" else float("inf")):
                    async with aclosing(engine.generate(requests[i])) as events:
                        async for event in events:
                            if isinstance(event, FinalEvent):
                                finals[i] = event
                                return
                            seen[i].append(event.token_id)
                            if how == "tokens" and len(seen[i]) >= k:
                                break
                cancelled.add(i)

            async with trio.open_nursery() as nursery:
                for i in range(30):
                    nursery.start_soon(run, i)
            with trio.fail_after(HANG_S):  # cancellations land within a step or two
                await wait_until(lambda: sum(n for _, n in engine.statistics().finished) == 30, poll=0.001)
            stats = engine.statistics()
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert len(cancelled) + len(finals) == 30 and not cancelled & set(finals)
    assert cancelled, "the random plan cancelled nothing"
    counts = dict(stats.finished)
    reported = Counter(f.finish_reason for f in finals.values())
    # Every consumer that saw its end is counted under that reason; a
    # cancelled consumer's request is counted once, as "cancelled" or (when
    # it finished before the cancel landed) under the reason it finished with.
    assert sum(counts.values()) == 30
    assert all(counts.get(r, 0) >= n for r, n in reported.items())
    assert counts.get("cancelled", 0) <= len(cancelled)
    assert "error" not in counts
    for i, final in finals.items():
        assert seen[i] == solo[i].tokens and final.finish_reason == solo[i].final.finish_reason
        assert final.usage == solo[i].final.usage
    for i in cancelled:
        assert seen[i] == solo[i].tokens[: len(seen[i])]


# -- robustness: bugs and shutdown must not strand callers ------------------------


async def test_a_bug_in_the_step_loop_kills_the_engine_and_is_reported(ckpt, monkeypatch):
    """An exception escaping the scheduler's loop (here: committing the third
    token) fails every request in flight, shows in statistics().dead, and
    later submissions are refused with EngineDead instead of hanging."""
    from trioserve.state import sequence

    real = sequence.Sequence.commit
    calls = {"n": 0}

    def failing_commit(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected bug")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sequence.Sequence, "commit", failing_commit)
    with trio.fail_after(HANG_S):
        async with open_engine(config(), checkpoint=ckpt) as engine:
            outcome = await collect(engine, GenerateRequest([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0)))
            assert outcome.final.finish_reason == "error"
            assert "injected bug" in outcome.final.error
            assert "RuntimeError: injected bug" in engine.statistics().dead
            with pytest.raises(EngineDead, match="injected bug"):
                await collect(engine, GenerateRequest([5, 6], SamplingParams(max_tokens=2)))


@pytest.mark.parametrize("checkpoints", [1, 2, 3, 4])
async def test_submissions_queued_at_shutdown_are_refused_not_stranded(ckpt, checkpoints):
    """Leaving open_engine a few scheduling points after 8 submissions (some
    still sit in the scheduler's inbox): each caller gets EngineClosed or
    its stream ends; none waits forever for a reply."""
    outcomes: list[str] = []

    async def submit(engine) -> None:
        try:
            await collect(engine, GenerateRequest([5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0)))
            outcomes.append("finished")
        except EngineClosed:
            outcomes.append("closed")

    with trio.fail_after(HANG_S):
        async with trio.open_nursery() as nursery:
            async with open_engine(config(), checkpoint=ckpt) as engine:
                for _ in range(8):
                    nursery.start_soon(submit, engine)
                for _ in range(checkpoints):
                    await trio.sleep(0)
            # the engine is gone; every caller must come back on its own
    assert len(outcomes) == 8 and set(outcomes) <= {"closed", "finished"}


# -- prefix cache ---------------------------------------------------------------


async def test_shared_system_prompt_is_prefilled_once_and_outputs_match_cache_off(ckpt):
    """Two requests sharing a 200-token system prompt: the second prefills
    only its own suffix (the prefill counter moves by the suffix and the
    lookup reports the hit), and every output equals the cache-off output."""
    rng = random.Random(11)
    vocab = ckpt.tokenizer.vocab_size
    system = random_prompt(rng, 200, vocab)
    first = GenerateRequest(system + random_prompt(rng, 9, vocab), SamplingParams(max_tokens=12, temperature=0.0, seed=1))
    second = GenerateRequest(system + random_prompt(rng, 14, vocab), SamplingParams(max_tokens=12, temperature=0.7, seed=5))

    async def run(prefix_cache: bool):
        async with open_engine(config(prefix_cache=prefix_cache, prefill_budget=64), checkpoint=ckpt) as engine:
            a = await collect(engine, first)
            before = engine.statistics()
            b = await collect(engine, second)
            after = engine.statistics()
        return a, b, before, after

    with trio.fail_after(HANG_S):
        a_on, b_on, before, after = await run(True)
        a_off, b_off, _, after_off = await run(False)
    assert a_on.same_as(a_off) and b_on.same_as(b_off)
    shared = (200 // BS) * BS  # whole blocks of the system prompt
    assert after.prompt_tokens - before.prompt_tokens == len(second.prompt_ids) - shared
    assert after.prefix.hit_tokens - before.prefix.hit_tokens == shared
    assert after_off.prefix is None
    # Blocks only the cache holds are not "used" by requests.
    assert after.kv_blocks_used == 0 and after.prefix.idle_blocks > 0


async def test_cached_blocks_yield_to_new_requests_when_the_pool_is_full(ckpt):
    """A pool just big enough for one request: earlier requests' cached
    blocks are evicted so later, unrelated requests still run."""
    rng = random.Random(12)
    vocab = ckpt.tokenizer.vocab_size
    requests = [GenerateRequest(random_prompt(rng, 30, vocab), SamplingParams(max_tokens=10, temperature=0.0)) for _ in range(4)]
    need = reserve(requests[0])
    with trio.fail_after(HANG_S):
        async with open_engine(config(blocks=need, max_num_seqs=1), checkpoint=ckpt) as engine:
            outcomes = [await collect(engine, r) for r in requests]
            stats = engine.statistics()
    assert all(o.final.finish_reason == "length" for o in outcomes)
    assert stats.prefix.evictions > 0 and stats.kv_blocks_used == 0


async def test_draw_start_continues_a_random_stream(ckpt):
    """A request that resumes another's output at draw index k (as a
    session's next turn does) draws exactly what the original drew from k on;
    FinalEvent.draw_end reports where the stream stopped."""
    rng = random.Random(21)
    prompt = random_prompt(rng, 12, ckpt.tokenizer.vocab_size)
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=77, ignore_eos=True)
    with trio.fail_after(HANG_S):
        async with open_engine(config(), checkpoint=ckpt) as engine:
            whole = await collect(engine, GenerateRequest(prompt, params))
            resumed = await collect(
                engine,
                GenerateRequest(prompt + whole.tokens[:4], attrs.evolve(params, max_tokens=6), draw_start=4),
            )
            greedy = await collect(engine, GenerateRequest(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), draw_start=3))
    assert whole.final.draw_end == 10
    assert resumed.tokens == whole.tokens[4:] and resumed.final.draw_end == 10
    assert greedy.final.draw_end == 3  # greedy consumes no draws
