"""PrefixCache over a BlockPool, on its own and through SchedulingPolicy:
longest whole-block prefix matching (never the last prompt token), chained
block keys, one pool reference per remembered block, LRU eviction of idle
blocks only, the count and idle-time limits, the hit-rate figures, and a
stateful model that checks reference counts and block contents after every
admission, step, finish, cancellation, eviction and trim."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from trioserve.models.detokenizer import IncrementalDetokenizer
from trioserve.types import SamplingParams
from trioserve.models.tokenizer import Tokenizer
from trioserve.state import prefix_cache as prefix_cache_module
from trioserve.state.kv_pool import BlockPool, blocks_needed
from trioserve.state.prefix_cache import ROOT, PrefixCache, PrefixStats, block_key
from trioserve.state.scheduling import PlannedRow, SchedulingPolicy
from trioserve.state.sequence import Sequence
from trioserve.state.stops import StopMatcher

BS = 4

# Three distinct full blocks and a few tails.
A = [10, 11, 12, 13]
B = [20, 21, 22, 23]
C = [30, 31, 32, 33]
D = [40, 41, 42, 43]


def new_cache(blocks: int = 16, **limits) -> tuple[BlockPool, PrefixCache]:
    pool = BlockPool(blocks, BS)
    return pool, PrefixCache(pool, **limits)


def put(pool: BlockPool, cache: PrefixCache, sid: str, tokens: list[int], now: float = 0.0, *, keep: bool = False) -> list[int]:
    """A sequence that wrote ``tokens`` into fresh blocks, registered them and
    (unless ``keep``) let go; returns its table."""
    table = pool.grow(sid, len(tokens))
    cache.register(tokens, table, now)
    if not keep:
        pool.free_sequence(sid)
    return table


def cached_blocks(cache: PrefixCache) -> set[int]:
    return {e.block for e in cache._entries.values()}


# -- block keys ----------------------------------------------------------------------


def test_block_key_is_deterministic_and_chained():
    assert block_key(ROOT, A) == block_key(ROOT, list(A)) == block_key(ROOT, tuple(A))
    assert block_key(ROOT, A) != block_key(ROOT, B)
    k_a = block_key(ROOT, A)
    # The same block content after different parents gets different keys.
    assert block_key(k_a, B) != block_key(ROOT, B)
    assert block_key(k_a, B) != block_key(block_key(ROOT, C), B)
    # Order inside a block matters.
    assert block_key(ROOT, [1, 2, 3, 4]) != block_key(ROOT, [2, 1, 3, 4])


# -- match ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3), (14, 3), (20, 3)],
)
def test_match_takes_whole_blocks_and_never_the_last_token(length, expected):
    pool, cache = new_cache()
    table = put(pool, cache, "s", A + B + C)
    prompt = (A + B + C + D + D)[:length]
    got = cache.match(prompt, now=1.0)
    assert got == table[:expected]
    # A prompt of exactly k full blocks matches at most k - 1 of them.
    assert len(got) * BS < max(length, 1)


@pytest.mark.parametrize("pos", range(12))
def test_a_different_token_stops_the_match_at_its_block(pos):
    pool, cache = new_cache()
    table = put(pool, cache, "s", A + B + C)
    prompt = A + B + C + [99]
    prompt[pos] = 999
    assert cache.match(prompt, now=1.0) == table[: pos // BS]


def test_same_block_content_after_a_different_prefix_does_not_match():
    pool, cache = new_cache()
    ab = put(pool, cache, "ab", A + B)
    cb = put(pool, cache, "cd", C + D)
    # B is cached, but only after A: behind C it is not a hit.
    assert cache.match(C + B + [1], 0.0) == cb[:1]
    assert cache.match(B + [1], 0.0) == []  # B at position 0 is not cached
    assert cache.match(D + B + [1], 0.0) == []
    assert cache.match(A + B + [1], 0.0) == ab[:2]
    assert cache.match(A + D + [1], 0.0) == ab[:1]


def test_match_counts_nothing_and_takes_no_reference():
    pool, cache = new_cache()
    table = put(pool, cache, "s", A + B)
    before = [pool.refcount(b) for b in table]
    for _ in range(3):
        assert cache.match(A + B + [1], 0.0) == table
    assert [pool.refcount(b) for b in table] == before == [1, 1]
    s = cache.stats()
    assert (s.queries, s.query_tokens, s.hit_tokens) == (0, 0, 0)


def test_match_checks_the_tokens_not_just_the_key(monkeypatch):
    # With every key colliding, the stored tokens still decide a hit.
    pool, cache = new_cache()
    monkeypatch.setattr(prefix_cache_module, "block_key", lambda parent, tokens: b"same")
    table = put(pool, cache, "s", A)
    assert cache.match(A + [1], 0.0) == table
    assert cache.match(B + [1], 0.0) == []


# -- register ------------------------------------------------------------------------


def test_register_adds_one_reference_per_full_block_only():
    pool, cache = new_cache(blocks=8)
    tokens = A + B + [1, 2]  # two full blocks and a partial one
    table = pool.grow("s", len(tokens))
    assert [pool.refcount(b) for b in table] == [1, 1, 1]
    assert cache.register(tokens, table, 0.0) == 2
    assert [pool.refcount(b) for b in table] == [2, 2, 1]
    assert len(cache) == 2 and cached_blocks(cache) == set(table[:2])
    assert cache.stats().registered_tokens == 2 * BS
    assert cache.idle_blocks() == 0  # the sequence still holds them
    pool.free_sequence("s")
    assert [pool.refcount(b) for b in table] == [1, 1, 0]
    assert cache.idle_blocks() == 2
    assert pool.num_free == 8 - 2


def test_register_of_fewer_tokens_than_a_block_adds_nothing():
    pool, cache = new_cache(blocks=4)
    table = pool.grow("s", 3)
    assert cache.register([1, 2, 3], table, 0.0) == 0
    assert cache.register([], table, 0.0) == 0
    assert len(cache) == 0 and pool.refcount(table[0]) == 1
    assert cache.stats().registered_tokens == 0


def test_register_keeps_the_existing_copy_of_known_blocks():
    pool, cache = new_cache(blocks=12)
    first = put(pool, cache, "one", A + B)
    second = pool.grow("two", 12)
    assert set(first).isdisjoint(second)
    # Same first two blocks (recomputed into its own blocks), a new third.
    assert cache.register(A + B + C, second, 1.0) == 1
    assert [pool.refcount(b) for b in first] == [1, 1]  # cache only, unchanged
    assert [pool.refcount(b) for b in second] == [1, 1, 2]  # duplicates not referenced
    assert cached_blocks(cache) == {first[0], first[1], second[2]}
    assert cache.stats().registered_tokens == 3 * BS
    pool.free_sequence("two")
    assert pool.refcount(second[0]) == pool.refcount(second[1]) == 0
    assert cache.match(A + B + C + [1], 2.0) == [first[0], first[1], second[2]]
    # Registering the same content again adds nothing and no reference.
    third = pool.grow("three", 12)
    assert cache.register(A + B + C, third, 3.0) == 0
    assert [pool.refcount(b) for b in third] == [1, 1, 1]
    assert cache.stats().registered_tokens == 3 * BS


def test_register_twice_from_the_same_table_is_a_no_op():
    pool, cache = new_cache(blocks=4)
    table = pool.grow("s", 8)
    assert cache.register(A + B, table, 0.0) == 2
    assert cache.register(A + B, table, 1.0) == 0
    assert [pool.refcount(b) for b in table] == [2, 2]


# -- idle blocks, eviction, limits ---------------------------------------------------


def test_evict_frees_idle_blocks_least_recently_used_first():
    pool, cache = new_cache(blocks=8)
    (a,) = put(pool, cache, "a", A, now=1.0)
    (b,) = put(pool, cache, "b", B, now=2.0)
    (c,) = put(pool, cache, "c", C, now=3.0)
    assert cache.idle_blocks() == 3 and pool.num_free == 5
    assert cache.match(A + [1], now=4.0) == [a]  # a is now the most recent
    assert cache.evict(1) == 1
    assert pool.refcount(b) == 0 and cached_blocks(cache) == {a, c}
    assert cache.evict(1) == 1
    assert cached_blocks(cache) == {a}
    assert cache.evict(5) == 1  # only what there is
    assert len(cache) == 0 and pool.num_free == 8
    assert cache.evict(1) == 0
    assert cache.stats().evictions == 3


def test_register_touches_known_blocks_for_lru():
    pool, cache = new_cache(blocks=8)
    (a,) = put(pool, cache, "a", A, now=1.0)
    (b,) = put(pool, cache, "b", B, now=2.0)
    put(pool, cache, "a2", A, now=3.0)  # known: a becomes most recent
    assert cache.evict(1) == 1
    assert cached_blocks(cache) == {a}


def test_evict_never_takes_a_block_a_sequence_holds():
    pool, cache = new_cache(blocks=8)
    ab = put(pool, cache, "ab", A + B, now=1.0)
    (c,) = put(pool, cache, "c", C, now=2.0)
    shared = cache.match(A + B + [1], now=3.0)  # LRU order now: c, a, b
    pool.adopt("user", shared)
    assert cache.idle_blocks() == 1
    assert cache.evict(10) == 1  # only c
    assert cached_blocks(cache) == set(ab)
    assert [pool.refcount(x) for x in ab] == [2, 2] and pool.refcount(c) == 0
    assert cache.evict(0) == 0
    pool.free_sequence("user")
    assert cache.idle_blocks() == 2
    assert cache.evict(10) == 2 and pool.num_free == 8


def test_trim_applies_the_count_limit_to_idle_blocks_oldest_first():
    pool, cache = new_cache(blocks=8, max_blocks=2)
    (a,) = put(pool, cache, "a", A, now=1.0)
    (b,) = put(pool, cache, "b", B, now=2.0)
    assert len(cache) == 2
    (c,) = put(pool, cache, "c", C, now=3.0)
    assert len(cache) == 3  # register leaves the limits to trim, once blocks are let go
    cache.trim(now=3.0)  # a goes: the oldest idle block
    assert cached_blocks(cache) == {b, c} and pool.refcount(a) == 0
    # A held block over the limit is skipped; the next idle one goes instead.
    pool.adopt("user", cache.match(B + [1], now=4.0))
    cache.max_blocks = 1
    cache.trim(now=5.0)
    assert cached_blocks(cache) == {b}
    cache.max_blocks = 0
    cache.trim(now=6.0)
    assert cached_blocks(cache) == {b}  # held: stays though over the limit
    pool.free_sequence("user")
    cache.trim(now=7.0)
    assert len(cache) == 0 and pool.num_free == 8


def test_trim_applies_the_idle_time_limit():
    pool, cache = new_cache(blocks=8, idle_s=10.0)
    (a,) = put(pool, cache, "a", A, now=0.0)
    (b,) = put(pool, cache, "b", B, now=5.0)
    cache.trim(now=10.0)  # a idle exactly 10 s: not over the limit
    assert cached_blocks(cache) == {a, b}
    assert cache.match(A + [1], now=9.0) == [a]  # used again at 9
    cache.trim(now=15.5)  # b idle 10.5 s, a 6.5 s
    assert cached_blocks(cache) == {a}
    cache.trim(now=19.0)
    assert cached_blocks(cache) == {a}
    cache.trim(now=19.5)
    assert len(cache) == 0 and pool.num_free == 8


def test_trim_keeps_an_old_block_that_a_sequence_holds():
    pool, cache = new_cache(blocks=8, idle_s=1.0)
    (a,) = put(pool, cache, "a", A, now=0.0)
    (b,) = put(pool, cache, "b", B, now=0.0)
    pool.adopt("user", [a])
    cache.trim(now=100.0)
    assert cached_blocks(cache) == {a}
    pool.free_sequence("user")
    cache.trim(now=100.0)
    assert len(cache) == 0


def test_trim_without_limits_drops_nothing():
    pool, cache = new_cache(blocks=8)
    put(pool, cache, "a", A + B + C, now=0.0)
    cache.trim(now=1e9)
    assert len(cache) == 3


def test_clear_frees_every_idle_block_and_keeps_held_ones():
    pool, cache = new_cache(blocks=8)
    put(pool, cache, "ab", A + B)
    held = put(pool, cache, "cd", C + D, keep=True)
    assert cache.idle_blocks() == 2
    cache.clear()
    assert cached_blocks(cache) == set(held) and cache.idle_blocks() == 0
    assert pool.num_free == 8 - 2
    pool.free_sequence("cd")
    cache.clear()
    assert len(cache) == 0 and pool.num_free == 8
    assert cache.stats().evictions == 4


# -- record and stats ----------------------------------------------------------------


# -- pins -------------------------------------------------------------------------


def test_pin_holds_the_cached_chain_against_trim_and_evict():
    pool, cache = new_cache(blocks=8, max_blocks=1)
    a, b, c = put(pool, cache, "abc", A + B + C, now=1.0, keep=True)
    assert cache.pin("s", A + B + [1, 2], now=2.0) == 2 * BS  # whole blocks only
    pool.free_sequence("abc")
    cache.trim(now=3.0)  # count limit 1: only c, which nobody pins, goes
    assert cached_blocks(cache) == {a, b} and pool.refcount(c) == 0
    assert cache.evict(10) == 0 and cache.idle_blocks() == 0
    assert [pool.refcount(x) for x in (a, b)] == [2, 2]
    s = cache.stats()
    assert (s.pinned_blocks, s.pinned_owners, s.pin_evictions) == (2, 1, 0)
    assert cache.unpin("s") == 2
    cache.trim(now=4.0)
    assert len(cache) == 1 and cache.stats().pinned_owners == 0


def test_pin_stops_at_the_first_block_not_cached_and_replaces_the_old_pin():
    pool, cache = new_cache(blocks=8)
    a, b = put(pool, cache, "ab", A + B)
    (d,) = put(pool, cache, "d", D)
    assert cache.pin("s", A + C + B, now=1.0) == BS  # C is not cached after A
    assert pool.refcount(a) == 2 and pool.refcount(b) == 1
    assert cache.pin("s", A + B, now=2.0) == 2 * BS  # overlapping re-pin: a keeps exactly one pin
    assert [pool.refcount(x) for x in (a, b, d)] == [2, 2, 1]
    assert cache.pin("s", D, now=3.0) == BS
    assert [pool.refcount(x) for x in (a, b, d)] == [1, 1, 2]
    assert cache.pinned_tokens("s") == BS and cache.pinned_tokens("other") == 0


def test_make_room_takes_least_recently_pinned_owners_only_when_that_is_enough():
    pool, cache = new_cache(blocks=6)
    (a,) = put(pool, cache, "a", A)
    (b,) = put(pool, cache, "b", B)
    (c,) = put(pool, cache, "c", C)
    cache.pin("old", A, now=1.0)
    cache.pin("new", B, now=2.0)
    pool.adopt("user", cache.match(C + [1], now=3.0))  # c is in use: not freeable
    assert pool.num_free == 3 and cache.freeable_blocks() == 2
    assert cache.make_room(3) == 0  # cannot reach 3: nothing is touched
    assert cache.stats().pinned_owners == 2
    assert cache.make_room(1) == 1  # the least recently pinned owner goes first
    assert pool.refcount(a) == 0 and pool.refcount(b) == 2
    assert cache.stats().pin_evictions == 1 and cache.pinned_tokens("new") == BS


def test_stats_and_hit_rate():
    pool, cache = new_cache(blocks=8)
    assert cache.stats().hit_rate == 0.0  # no queries: no division by zero
    put(pool, cache, "s", A + B)
    cache.record(10, 8)
    cache.record(6, 0)
    cache.record(4, 0)
    s = cache.stats()
    assert s == PrefixStats(
        queries=3, query_tokens=20, hit_tokens=8, cached_blocks=2, idle_blocks=2, registered_tokens=8, evictions=0
    )
    assert s.hit_rate == pytest.approx(8 / 20)


# -- through the scheduling policy ---------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_checkpoints["hf"])


def build_seq(tok: Tokenizer, sid: str, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(
        id=sid,
        prompt_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        seed=0,
        stop_ids=frozenset({tok.eos_id}),
        detokenizer=IncrementalDetokenizer(tok),
        stops=StopMatcher(()),
        arrival=0.0,
    )


@pytest.fixture
def make(tok):
    def build(sid: str, prompt: list[int], max_tokens: int) -> Sequence:
        return build_seq(tok, sid, prompt, max_tokens)

    return build


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def policy(blocks: int = 32, *, budget: int = 16, max_num_seqs: int = 8, **limits) -> SchedulingPolicy:
    pool = BlockPool(blocks, BS)
    return SchedulingPolicy(
        pool,
        max_num_seqs=max_num_seqs,
        max_model_len=512,
        prefill_budget=budget,
        max_queue=64,
        prefix_cache=PrefixCache(pool, **limits),
        clock=Clock(),
    )


def step(p: SchedulingPolicy, rows: list[PlannedRow], token: int = 100) -> None:
    p.stepped(rows)
    for row in rows:
        if row.samples:
            outcome = row.seq.commit(token, 0, 0.0)
            if outcome.finish_reason is not None:
                p.finish(row.seq, outcome.finish_reason)


def run_to_end(p: SchedulingPolicy, seq: Sequence) -> None:
    while seq in p.running:
        step(p, p.plan())


def test_second_sequence_shares_the_finished_ones_full_blocks(make):
    p = policy()
    first = make("first", A + B + C + [1, 2], 2)
    p.enqueue(first)
    assert p.admit(0.0) == [first] and first.num_cached == 0
    table = p.block_table(first)
    run_to_end(p, first)
    # 14 prompt tokens + 1 computed output token: 3 full blocks remembered.
    assert first.num_cached == 15
    assert len(p.cache) == 3 and p.cache.idle_blocks() == 3
    assert [p.pool.refcount(b) for b in table[:3]] == [1, 1, 1]

    second = make("second", A + B + C + [7, 8, 9], 3)
    p.enqueue(second)
    assert p.admit(1.0) == [second]
    assert second.num_cached == 3 * BS
    got = p.block_table(second)
    assert got[:3] == table[:3]
    assert len(got) == blocks_needed(15 + 3, BS)
    assert [p.pool.refcount(b) for b in got[:3]] == [2, 2, 2]
    # Only the uncached tail is planned.
    rows = p.plan()
    assert [(r.tokens, r.start) for r in rows] == [([7, 8, 9], 12)]
    s = p.cache.stats()
    assert (s.queries, s.query_tokens, s.hit_tokens) == (2, 14 + 15, 12)
    assert s.hit_rate == pytest.approx(12 / 29)


def test_a_prompt_of_exactly_cached_blocks_still_computes_its_last_block(make):
    p = policy()
    first = make("first", A + B + C, 1)
    p.enqueue(first)
    p.admit(0.0)
    run_to_end(p, first)
    assert len(p.cache) == 3
    again = make("again", A + B + C, 1)
    p.enqueue(again)
    p.admit(1.0)
    assert again.num_cached == 2 * BS
    assert [(r.tokens, r.start, r.samples) for r in p.plan()] == [(C, 8, True)]


def test_admission_evicts_idle_cached_blocks_to_make_room(make):
    p = policy(blocks=6)
    first = make("first", A + B + C + D + A, 4)  # 24 tokens: the whole pool
    p.enqueue(first)
    assert p.admit(0.0) == [first]
    run_to_end(p, first)
    assert first.num_cached == 20 + 3  # the last sampled token is never computed
    assert len(p.cache) == 5 and p.pool.num_free == 1
    table_first = p.cache.match(A + B + C + D + A + [1], 0.5)
    assert len(table_first) == 5

    other = make("other", [50] * 9, 3)  # 12 tokens: 3 blocks, no hit
    p.enqueue(other)
    assert p.admit(1.0) == [other]
    assert other.num_cached == 0
    assert p.cache.stats().evictions == 2
    assert len(p.cache) == 3 and p.pool.num_free == 0
    # Least recently used first, a chain's tail before its head: the head
    # blocks stay, and they are still reachable by match.
    assert cached_blocks(p.cache) == set(table_first[:3])
    assert p.cache.match(A + B + C + D + A + [1], 2.0) == table_first[:3]


def test_a_sequence_that_does_not_fit_lets_go_of_the_blocks_it_adopted(make):
    p = policy(blocks=8)
    first = make("first", A + B + C + [1], 1)  # 4 blocks
    p.enqueue(first)
    p.admit(0.0)
    run_to_end(p, first)
    assert len(p.cache) == 3 and p.pool.num_free == 5
    shared = p.cache.match(A + B + C + [1], 0.5)
    hog = make("hog", [60] * 8, 4)  # 3 blocks, no hit
    p.enqueue(hog)
    assert p.admit(1.0) == [hog]
    assert p.pool.num_free == 2
    refs_before = [p.pool.refcount(b) for b in shared]
    assert refs_before == [1, 1, 1]

    big = make("big", A + B + C + [9], 12)  # 28 tokens = 7 blocks, 3 shared: needs 4 free
    p.enqueue(big)
    assert p.admit(2.0) == []
    assert list(p.waiting) == [big] and big in p.waiting
    assert p.pool.table("big") == []
    assert [p.pool.refcount(b) for b in shared] == refs_before
    assert cached_blocks(p.cache) == set(shared)  # adopted, so never evicted for itself
    assert p.pool.num_free == 2
    assert big.num_cached == 0
    assert p.cache.stats().queries == 2  # the failed attempt is not recorded

    # Once the hog is done, it fits, sharing the same blocks.
    p.finish(hog, "stop", remember=False)
    assert p.admit(3.0) == [big]
    assert big.num_cached == 12 and p.block_table(big)[:3] == shared


def test_fail_all_does_not_register_into_the_cache(make):
    p = policy(blocks=16, budget=32)
    a, b = make("a", A + B + [1], 4), make("b", C + D + [2], 4)
    for seq in (a, b):
        p.enqueue(seq)
    p.admit(0.0)
    step(p, p.plan())
    assert a.num_cached == 9 and b.num_cached == 9
    waiting = make("w", A + [3], 1)
    p.enqueue(waiting)
    everyone = p.fail_all()
    assert set(everyone) == {a, b, waiting}
    assert len(p.cache) == 0 and p.cache.stats().registered_tokens == 0
    assert p.pool.num_free == 16


def test_fail_all_applies_the_cache_limits_even_with_nothing_running(make):
    """Idle cached blocks that expired while nothing ran go when the engine
    fails too, as after any other finish (found by the state machine)."""
    p = policy(blocks=16, idle_s=4.0)
    first = make("first", A + B + [1], 1)
    p.enqueue(first)
    p.admit(0.0)
    run_to_end(p, first)
    assert len(p.cache) == 2 and not p.running
    p.clock.now = 10.0  # both blocks idle for longer than the limit; no trim ran since
    p.enqueue(make("waiting", C + [2], 1))
    p.fail_all()
    assert len(p.cache) == 0 and p.pool.num_free == 16


def test_drop_cancelled_registers_the_computed_full_blocks(make):
    p = policy(blocks=16, budget=7)
    run = make("run", A + B + [1, 2, 3], 4)
    p.enqueue(run)
    p.admit(0.0)
    step(p, p.plan())  # 7 of 11 prompt tokens computed: one full block
    assert run.num_cached == 7
    table = p.block_table(run)
    waiting = make("wait", C + D + [5], 2)
    p.enqueue(waiting)
    p.max_num_seqs = 1
    p.admit(0.0)
    assert list(p.waiting) == [waiting]
    run.cancelled = waiting.cancelled = True
    assert set(p.drop_cancelled()) == {run, waiting}
    assert run.finish_reason == waiting.finish_reason == "cancelled"
    assert cached_blocks(p.cache) == {table[0]}
    assert p.cache.stats().registered_tokens == BS
    assert p.pool.num_free == 16 - 1
    p.max_num_seqs = 8
    again = make("again", A + B + [9], 1)
    p.enqueue(again)
    p.admit(1.0)
    assert again.num_cached == BS and p.block_table(again)[0] == table[0]


def test_a_retaining_sequence_holds_its_blocks_only_when_it_ends_normally(make):
    from trioserve.state.prefix_cache import held_key

    p = policy(blocks=16, max_blocks=1)
    done = make("done", A + B + [1], 2)
    done.retain = "sess"
    p.enqueue(done)
    p.admit(0.0)
    run_to_end(p, done)  # 9 prompt + 1 computed output token: 2 full blocks
    assert done.finish_reason == "length"
    assert p.cache.pinned_tokens(held_key("sess")) == 2 * BS and len(p.cache) == 2  # the count limit cannot take them

    cut = make("cut", C + D + [1], 2)
    cut.retain = "other"
    p.enqueue(cut)
    p.admit(1.0)
    step(p, p.plan())
    cut.cancelled = True
    p.drop_cancelled()
    assert p.cache.pinned_tokens(held_key("other")) == 0  # a cancelled turn holds nothing
    p.settle("sess", "commit", "not-done")  # a stale order for another request changes nothing
    assert p.cache.pinned_tokens("sess") == 0 and p.cache.pinned_tokens(held_key("sess")) == 2 * BS
    p.settle("sess", "commit", "done")
    assert p.cache.pinned_tokens("sess") == 2 * BS and p.cache.pinned_tokens(held_key("sess")) == 0


def test_settle_orders_cancel_and_forget_even_before_the_request_ends(make):
    from trioserve.state.prefix_cache import held_key

    p = policy(blocks=32)
    first = make("t1", A + B + [1], 2)
    first.retain = "s"
    p.enqueue(first)
    p.admit(0.0)
    run_to_end(p, first)
    p.settle("s", "commit", "t1")
    kept = p.cache.pinned_tokens("s")
    assert kept == 2 * BS

    second = make("t2", A + B + C + [1], 2)
    second.retain = "s"
    p.enqueue(second)
    p.admit(1.0)
    p.settle("s", "cancel", "t2")  # the client left; the scheduler has not noticed yet
    run_to_end(p, second)  # it ends normally all the same
    assert p.cache.pinned_tokens(held_key("s")) == 0 and p.cache.pinned_tokens("s") == kept

    third = make("t3", A + B + C + D + [1], 2)
    third.retain = "s"
    p.enqueue(third)
    p.admit(2.0)
    p.settle("s", "forget")  # the session was deleted meanwhile
    run_to_end(p, third)
    assert p.cache.stats().pinned_owners == 0 and p.held == {}
    with pytest.raises(ValueError, match="unknown retention order"):
        p.settle("s", "keep")
    p.cache.clear()
    assert p.pool.num_free == 32


def test_finish_remembers_prompt_and_computed_output_tokens(make):
    p = policy(blocks=16)
    seq = make("s", A + [1, 2], 6)
    p.enqueue(seq)
    p.admit(0.0)
    tokens = [101, 102, 103, 104, 105, 106]
    while seq in p.running:
        step(p, p.plan(), token=tokens[len(seq.output_ids)])
    # 6 prompt tokens + 5 computed outputs (the last sampled one never is) = 11: 2 full blocks
    assert seq.num_cached == 11
    assert len(p.cache) == 2
    follow = make("f", A + [1, 2, 101, 102] + [7], 1)
    p.enqueue(follow)
    p.admit(1.0)
    assert follow.num_cached == 2 * BS


def test_cache_count_limit_holds_after_a_sequence_finishes(make):
    # The count limit holds once a finishing sequence lets go of its blocks
    # (register alone cannot trim: the sequence still holds them then).
    p = policy(blocks=8, max_blocks=2)
    seq = make("s", A + B + C + D + A, 1)
    p.enqueue(seq)
    p.admit(0.0)
    run_to_end(p, seq)
    assert seq.num_cached == 20
    assert p.cache.idle_blocks() <= 2 and len(p.cache) <= 2


# -- stateful model ------------------------------------------------------------------

M_BS = 2
M_BLOCKS = 10
M_MAX_CACHED = 6
M_IDLE_S = 4.0
ALPHABET = [5, 6]


class PrefixMachine(RuleBasedStateMachine):
    """A SchedulingPolicy with a PrefixCache, driven at random, against a model
    of: which full-block prefixes are cached in which block and in what LRU
    order, what each block's KV holds, and the lookup/registration counts."""

    def __init__(self, tok: Tokenizer) -> None:
        super().__init__()
        self.tok = tok
        self.now = 0.0
        self.pool = BlockPool(M_BLOCKS, M_BS)
        self.cache = PrefixCache(self.pool, max_blocks=M_MAX_CACHED, idle_s=M_IDLE_S)
        self.policy = SchedulingPolicy(
            self.pool,
            max_num_seqs=3,
            max_model_len=64,
            prefill_budget=5,
            max_queue=100,
            prefix_cache=self.cache,
            clock=lambda: self.now,
        )
        self.counter = 0
        # Model: full-block prefix tuple -> (block, last use), least recent first.
        self.model: OrderedDict[tuple[int, ...], list] = OrderedDict()
        self.content: dict[int, list[int | None]] = {b: [None] * M_BS for b in range(M_BLOCKS)}
        self.queries = self.query_tokens = self.hit_tokens = 0
        self.registered = self.evictions = 0

    # -- model helpers -------------------------------------------------------
    def live(self) -> list[Sequence]:
        return list(self.policy.waiting) + list(self.policy.running)

    def held(self) -> set[int]:
        return {b for s in self.policy.running for b in self.pool.table(s.id)}

    def actual(self) -> dict[int, tuple[int, ...]]:
        return {e.block: e.tokens for e in self.cache._entries.values()}

    def chain(self, prompt: list[int]) -> int:
        """How many leading whole blocks of ``prompt`` the model says match."""
        k = 0
        while k < (len(prompt) - 1) // M_BS and tuple(prompt[: (k + 1) * M_BS]) in self.model:
            k += 1
        return k

    def touch(self, prefix: tuple[int, ...]) -> None:
        self.model[prefix][1] = self.now
        self.model.move_to_end(prefix)

    def touch_chain(self, prefixes: list[tuple[int, ...]]) -> None:
        """A chain is touched tail first, so its head ends most recent."""
        for prefix in reversed(prefixes):
            self.touch(prefix)

    def model_register(self, tokens: list[int], table: list[int]) -> None:
        chain = []
        for i in range(len(tokens) // M_BS):
            prefix = tuple(tokens[: (i + 1) * M_BS])
            if prefix not in self.model:
                self.model[prefix] = [table[i], self.now]
                self.registered += M_BS
            chain.append(prefix)
        self.touch_chain(chain)

    def idle_now(self) -> set[int]:
        return {b for b in self.actual() if self.pool.refcount(b) == 1}

    def sync(self, idle_before: set[int]) -> set[int]:
        """Drop model entries the cache no longer has; each must have been idle."""
        actual = self.actual()
        gone = [p for p, (b, _) in self.model.items() if actual.get(b) != p[-M_BS:]]
        removed = set()
        for prefix in gone:
            block = self.model.pop(prefix)[0]
            assert block in idle_before, f"evicted block {block} was held"
            removed.add(block)
        self.evictions += len(gone)
        return removed

    def finishing(self, seq: Sequence) -> tuple[list[int], list[int]]:
        return seq.history()[: seq.num_cached], self.pool.table(seq.id)

    # -- rules ----------------------------------------------------------------
    @precondition(lambda self: len(self.live()) < 6)
    @rule(
        prompt=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=9),
        max_tokens=st.integers(1, 3),
    )
    def request(self, prompt, max_tokens):
        self.counter += 1
        seq = build_seq(self.tok, f"s{self.counter}", prompt, max_tokens)
        self.policy.enqueue(seq)

    @precondition(lambda self: self.policy.waiting)
    @rule()
    def admit(self):
        idle_before = self.idle_now()
        model_before = {p: b for p, (b, _) in self.model.items()}
        admitted = self.policy.admit(self.now)
        self.sync(idle_before)
        for seq in admitted:
            k, rem = divmod(seq.num_cached, M_BS)
            assert rem == 0
            assert k <= (len(seq.prompt_ids) - 1) // M_BS
            table = self.pool.table(seq.id)
            assert len(table) == blocks_needed(seq.max_total, M_BS)
            hits = []
            for i in range(k):
                prefix = tuple(seq.prompt_ids[: (i + 1) * M_BS])
                assert model_before.get(prefix) == table[i]
                hits.append(prefix)
            self.touch_chain(hits)
            # Maximal: the next prefix was not cached all along.
            nxt = tuple(seq.prompt_ids[: (k + 1) * M_BS])
            if k < (len(seq.prompt_ids) - 1) // M_BS:
                assert nxt not in self.model
            self.queries += 1
            self.query_tokens += len(seq.prompt_ids)
            self.hit_tokens += seq.num_cached
        # The head that did not fit was matched too (and touched its hits).
        if self.policy.waiting and len(self.policy.running) < self.policy.max_num_seqs:
            head = self.policy.waiting[0]
            assert self.pool.table(head.id) == []
            self.touch_chain([tuple(head.prompt_ids[: (i + 1) * M_BS]) for i in range(self.chain(head.prompt_ids))])

    @precondition(lambda self: self.live())
    @rule(tokens=st.lists(st.sampled_from([*ALPHABET, ALPHABET[0], 2]), min_size=1, max_size=4))
    def run_steps(self, tokens):
        """Admit what fits, then one step per token (each sampling row commits it)."""
        self.admit()
        for token in tokens:
            if not self.policy.running:
                break
            self.step(token)

    def step(self, token: int) -> None:
        rows = self.policy.plan()
        assert rows
        for row in rows:
            table = self.pool.table(row.seq.id)
            for j, t in enumerate(row.tokens):
                pos = row.start + j
                block = table[pos // M_BS]
                assert self.pool.refcount(block) == 1, "writing into a shared block"
                self.content[block][pos % M_BS] = t
        self.policy.stepped(rows)
        for row in rows:
            if row.samples:
                seq = row.seq
                outcome = seq.commit(token, 0, self.now)
                if outcome.finish_reason is not None:
                    self.finish_through_policy(seq, outcome.finish_reason)

    def finish_through_policy(self, seq: Sequence, reason: str) -> None:
        tokens, table = self.finishing(seq)
        # The sequence's own blocks are idle once it lets go, so the limits
        # may take them at once (when every older entry is held).
        idle_before = self.idle_now() | {b for b in table if self.pool.refcount(b) - (b in self.actual()) == 1}
        self.policy.finish(seq, reason)
        self.model_register(tokens, table)
        self.sync(idle_before)

    @precondition(lambda self: self.policy.running)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.policy.running))
        self.finish_through_policy(seq, "abort")

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def cancel(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        was_running = seq in self.policy.running
        tokens, table = self.finishing(seq)
        idle_before = self.idle_now()
        seq.cancelled = True
        assert self.policy.drop_cancelled() == [seq]
        assert seq not in self.live() and self.pool.table(seq.id) == []
        if was_running:
            self.model_register(tokens, table)
        self.sync(idle_before)

    @rule(
        action=st.one_of(
            st.tuples(st.just("evict"), st.integers(0, 4)),
            st.tuples(st.just("trim"), st.sampled_from([0.0, 1.0, 5.0])),
            st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 3.0, 5.0])),
            st.tuples(st.just("clear"), st.none()),
            st.tuples(st.just("fail_all"), st.integers(0, 7)),  # rare: only at 0
        )
    )
    def housekeeping(self, action):
        name, arg = action
        if name == "evict":
            self.evict(arg)
        elif name == "trim":
            self.trim(arg)
        elif name == "tick":
            self.now += arg
        elif name == "clear":
            self.clear()
        elif arg == 0:
            self.fail_all()

    def evict(self, n: int) -> None:
        idle = {b for b, _ in self.model.values() if b not in self.held()}
        expected = [b for b, _ in self.model.values() if b in idle][:n]
        idle_before = self.idle_now()
        assert self.cache.evict(n) == len(expected)
        assert self.sync(idle_before) == set(expected)

    def trim(self, dt: float) -> None:
        self.now += dt
        idle_before = self.idle_now()
        size_before = len(self.model)
        last_use = {b: lu for b, lu in self.model.values()}
        self.cache.trim(self.now)
        removed = self.sync(idle_before)
        idle_after = self.idle_now()
        assert all(self.now - last_use[b] <= M_IDLE_S for b in idle_after)
        assert len(self.model) <= M_MAX_CACHED or not idle_after
        young = [b for b in removed if self.now - last_use[b] <= M_IDLE_S]
        assert len(young) <= max(0, size_before - M_MAX_CACHED)

    def clear(self) -> None:
        idle_before = self.idle_now()
        self.cache.clear()
        assert self.sync(idle_before) == idle_before
        assert self.cache.idle_blocks() == 0

    def fail_all(self) -> None:
        before = dict(self.actual())
        last_use = {b: lu for b, lu in self.model.values()}
        self.policy.fail_all()
        # Nothing is registered; the freed blocks let the limits apply, so
        # only entries idle now (the failed sequences' included) and expired
        # or over the count limit may go.
        idle_after = self.idle_now()
        removed = self.sync(idle_after | set(before) - self.held())
        assert set(self.actual().items()) <= set(before.items())
        assert all(self.now - last_use[b] <= M_IDLE_S for b in idle_after)
        young = [b for b in removed if self.now - last_use[b] <= M_IDLE_S]
        assert len(young) <= max(0, len(before) - M_MAX_CACHED)

    # -- invariants -----------------------------------------------------------
    @invariant()
    def blocks_add_up(self):
        tables = [self.pool.table(s.id) for s in self.policy.running]
        for s in self.policy.waiting:
            assert self.pool.table(s.id) == []
        for t in tables:
            assert len(t) == len(set(t))
        cached = cached_blocks(self.cache)
        assert len(cached) == len(self.cache)  # one block per entry
        held = set(cached).union(*map(set, tables))
        assert self.pool.num_free + len(held) == M_BLOCKS
        free = self.pool.free_blocks()
        assert len(free) == len(set(free)) and held.isdisjoint(free)
        for b in range(M_BLOCKS):
            expected = sum(b in t for t in tables) + (b in cached)
            assert self.pool.refcount(b) == expected, f"block {b}"

    @invariant()
    def cache_matches_model(self):
        actual = self.actual()
        assert {b: p[-M_BS:] for p, (b, _) in self.model.items()} == actual
        assert [e.block for e in self.cache._entries.values()] == [b for b, _ in self.model.values()]
        for block, tokens in actual.items():
            assert tuple(self.content[block]) == tokens  # the KV holds what the key says

    @invariant()
    def running_sequences_read_their_own_tokens(self):
        for seq in self.policy.running:
            table = self.pool.table(seq.id)
            history = seq.history()
            for p in range(seq.num_cached):
                assert self.content[table[p // M_BS]][p % M_BS] == history[p]

    @invariant()
    def counts(self):
        s = self.cache.stats()
        assert (s.queries, s.query_tokens, s.hit_tokens) == (self.queries, self.query_tokens, self.hit_tokens)
        assert s.registered_tokens == self.registered
        assert s.evictions == self.evictions
        assert s.cached_blocks == len(self.model)
        assert s.idle_blocks == len({b for b, _ in self.model.values()} - self.held())

    def teardown(self):
        for seq in list(self.policy.running):
            self.finish_through_policy(seq, "abort")
        self.policy.waiting.clear()
        self.cache.clear()
        assert len(self.cache) == 0
        assert self.pool.num_free == M_BLOCKS


def test_prefix_cache_state_machine(tok):
    run_state_machine_as_test(
        lambda: PrefixMachine(tok),
        settings=settings(
            max_examples=100,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.parametrize("share", [True, False])
def test_generated_tokens_blocks_are_shared_only_when_allowed(make, share):
    """Batch-invariant mode (share_generated_kv=False): KV written while
    generating comes from other arithmetic than a prompt's, so a finished
    sequence leaves only its prompt's full blocks; a later prompt that
    repeats the generated text prefills it again (docs/determinism.md)."""
    pool = BlockPool(32, BS)
    p = SchedulingPolicy(
        pool, max_num_seqs=8, max_model_len=512, prefill_budget=16, max_queue=64,
        prefix_cache=PrefixCache(pool), share_generated_kv=share, clock=Clock(),
    )
    first = make("first", A + B, 6)  # step() commits token 100 each time
    p.enqueue(first)
    p.admit(0.0)
    run_to_end(p, first)
    assert first.num_cached == 8 + 5  # the last generated token is never fed back
    assert len(p.cache) == (3 if share else 2)

    repeat = make("repeat", A + B + [100] * 4 + [7], 1)
    p.enqueue(repeat)
    p.admit(1.0)
    assert repeat.num_cached == (12 if share else 8)
    assert [(r.tokens, r.start) for r in p.plan()] == ([([7], 12)] if share else [([100] * 4 + [7], 8)])
