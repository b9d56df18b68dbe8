"""BlockPool accounting: exact counts for each operation, the errors, the
sizing helpers, and a random walk of grow / adopt / free / cancel checked
against a model of the pool kept here."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trioserve.state.kv_pool import (
    DEFAULT_BLOCK_SIZE,
    BlockPool,
    PoolExhausted,
    PoolStats,
    blocks_for_budget,
    blocks_needed,
)


def free_list(pool: BlockPool) -> list[int]:
    # The free list is private; the invariants below need to see it.
    return pool.free_blocks()


def snapshot(pool: BlockPool, seqs=()) -> tuple:
    return (
        pool.stats(),
        sorted(free_list(pool)),
        [pool.refcount(b) for b in range(pool.num_blocks)],
        {s: pool.table(s) for s in seqs},
    )


# -- raw blocks -------------------------------------------------------------


def test_new_pool_is_all_free():
    pool = BlockPool(6, block_size=4)
    assert pool.num_free == 6
    assert sorted(free_list(pool)) == list(range(6))
    assert all(pool.refcount(b) == 0 for b in range(6))
    assert pool.stats() == PoolStats(total_blocks=6, free_blocks=6, used_blocks=0, block_size=4, sequences=0)


def test_default_block_size():
    assert BlockPool(3).block_size == DEFAULT_BLOCK_SIZE


def test_allocate_takes_distinct_free_blocks_with_one_reference():
    pool = BlockPool(8)
    got = pool.allocate(3)
    assert len(got) == 3 and len(set(got)) == 3
    assert all(0 <= b < 8 for b in got)
    assert pool.num_free == 5
    assert all(pool.refcount(b) == 1 for b in got)
    assert not set(got) & set(free_list(pool))
    more = pool.allocate(5)
    assert set(got) | set(more) == set(range(8))
    assert pool.num_free == 0
    assert pool.allocate(0) == []


def test_release_returns_blocks_and_they_are_reused():
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.release(a[:2])
    assert pool.num_free == 2
    assert sorted(free_list(pool)) == sorted(a[:2])
    assert [pool.refcount(b) for b in a] == [0, 0, 1, 1]
    again = pool.allocate(2)
    assert sorted(again) == sorted(a[:2])
    assert all(pool.refcount(b) == 1 for b in again)


def test_share_counts_references_and_block_frees_on_last_release():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.share([b])
    pool.share([b])
    assert pool.refcount(b) == 3
    pool.release([b])
    pool.release([b])
    assert pool.refcount(b) == 1
    assert pool.num_free == 3 and b not in free_list(pool)
    pool.release([b])
    assert pool.refcount(b) == 0
    assert pool.num_free == 4 and b in free_list(pool)


def test_share_with_repeated_id_adds_one_reference_per_mention():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.share([b, b])
    assert pool.refcount(b) == 3


def test_can_allocate_bounds():
    pool = BlockPool(5)
    pool.allocate(2)
    assert pool.can_allocate(0)
    assert pool.can_allocate(3)
    assert not pool.can_allocate(4)
    assert not pool.can_allocate(-1)


# -- errors -----------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -3])
def test_pool_needs_a_block(n):
    with pytest.raises(ValueError, match=str(n)):
        BlockPool(n)


def test_exhausted_message_has_the_numbers_and_nothing_changes():
    pool = BlockPool(9)
    pool.allocate(7)
    before = snapshot(pool)
    with pytest.raises(PoolExhausted) as info:
        pool.allocate(5)
    numbers = set(re.findall(r"\d+", str(info.value)))
    assert {"5", "2", "9"} <= numbers  # asked for, free, total
    assert snapshot(pool) == before


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.release([a])
    before = snapshot(pool)
    with pytest.raises(ValueError, match=str(a)):
        pool.release([b, a])
    # b was not released either: the call is all or nothing.
    assert snapshot(pool) == before
    assert pool.refcount(b) == 1


def test_double_free_within_one_call_raises():
    # A repeated id in one call must be counted against the refcount, or
    # release([b, b]) on a once-held block would drive it to -1.
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.release([b, b])
    assert pool.refcount(b) >= 0


def test_sharing_a_free_block_raises_and_changes_nothing():
    pool = BlockPool(3)
    (held,) = pool.allocate(1)
    free = next(b for b in range(3) if b != held)
    before = snapshot(pool)
    with pytest.raises(ValueError, match=str(free)):
        pool.share([held, free])
    assert snapshot(pool) == before
    assert pool.refcount(held) == 1


# -- per-sequence tables ----------------------------------------------------


def test_grow_extends_to_cover_tokens():
    pool = BlockPool(8, block_size=4)
    t1 = pool.grow("a", 1)  # 1 token -> 1 block
    assert len(t1) == 1 and pool.num_free == 7
    assert pool.grow("a", 4) == t1  # still fits in one block
    t2 = pool.grow("a", 5)  # 5 tokens -> 2 blocks, old one kept first
    assert len(t2) == 2 and t2[0] == t1[0]
    t3 = pool.grow("a", 13)  # 13 tokens -> 4 blocks
    assert len(t3) == 4 and t3[:2] == t2
    assert len(set(t3)) == 4
    assert pool.num_free == 4
    assert pool.grow("a", 3) == t3  # never shrinks
    assert pool.table("a") == t3
    assert all(pool.refcount(b) == 1 for b in t3)


def test_table_is_a_copy_and_unknown_seq_is_empty():
    pool = BlockPool(4, block_size=2)
    pool.grow("a", 3)
    t = pool.table("a")
    t.append(99)
    t.clear()
    assert len(pool.table("a")) == 2
    assert pool.table("nobody") == []


def test_can_grow_is_exact():
    pool = BlockPool(6, block_size=4)
    pool.grow("other", 8)  # 2 blocks, 4 free
    pool.grow("a", 2)  # 1 block, 3 free
    assert pool.can_grow("a", 16)  # needs 4 blocks total, has 1, 3 free
    assert not pool.can_grow("a", 17)  # needs 5
    assert pool.can_grow("a", 0)
    assert pool.can_grow("new", 12)
    assert not pool.can_grow("new", 13)
    assert pool.num_free == 3  # can_grow does not allocate
    first = pool.table("a")[0]
    assert pool.grow("a", 16)[0] == first
    assert pool.num_free == 0


def test_failed_grow_of_existing_seq_changes_nothing():
    pool = BlockPool(3, block_size=4)
    pool.grow("a", 4)
    before = snapshot(pool, ["a"])
    with pytest.raises(PoolExhausted):
        pool.grow("a", 13)  # needs 4 blocks, has 1, 2 free
    assert snapshot(pool, ["a"]) == before


def test_failed_grow_of_new_seq_leaves_no_sequence_behind():
    # A refused grow of a new sequence must not leave an empty table behind
    # (stats().sequences would count a sequence that holds nothing).
    pool = BlockPool(2, block_size=4)
    pool.grow("a", 4)
    before = snapshot(pool, ["a"])
    with pytest.raises(PoolExhausted):
        pool.grow("b", 9)  # needs 3 blocks, 1 free
    assert snapshot(pool, ["a"]) == before
    assert pool.stats().sequences == 1


def test_adopt_shares_a_prefix_and_free_sequence_releases_one_reference():
    pool = BlockPool(8, block_size=4)
    a = pool.grow("a", 12)  # 3 blocks
    pool.adopt("b", a[:2])
    assert pool.table("b") == a[:2]
    assert [pool.refcount(x) for x in a] == [2, 2, 1]
    assert pool.num_free == 5  # adopting takes no new blocks
    b = pool.grow("b", 10)  # 3 blocks: the two shared plus a fresh one
    assert b[:2] == a[:2] and b[2] not in a
    assert pool.num_free == 4
    assert pool.stats().sequences == 2

    assert pool.free_sequence("a") == 3
    assert pool.table("a") == []
    assert [pool.refcount(x) for x in a] == [1, 1, 0]
    assert pool.num_free == 5 and a[2] in free_list(pool)
    assert pool.free_sequence("b") == 3
    assert pool.num_free == 8
    assert sorted(free_list(pool)) == list(range(8))
    assert pool.stats() == PoolStats(8, 8, 0, 4, 0)


def test_adopt_onto_a_seq_with_blocks_raises_and_changes_nothing():
    pool = BlockPool(6, block_size=4)
    a = pool.grow("a", 8)
    pool.grow("b", 4)
    before = snapshot(pool, ["a", "b"])
    with pytest.raises(ValueError, match="b"):
        pool.adopt("b", a[:1])
    assert snapshot(pool, ["a", "b"]) == before


def test_adopt_of_a_free_block_raises_and_makes_no_table():
    pool = BlockPool(4, block_size=4)
    (held,) = pool.grow("a", 1)
    free = next(b for b in range(4) if b != held)
    before = snapshot(pool, ["a"])
    with pytest.raises(ValueError):
        pool.adopt("b", [held, free])
    assert snapshot(pool, ["a"]) == before
    assert pool.table("b") == []
    assert pool.stats().sequences == 1


def test_free_unknown_sequence_is_zero():
    pool = BlockPool(2)
    assert pool.free_sequence("ghost") == 0
    assert pool.num_free == 2


def test_stats_track_used_and_sequences():
    pool = BlockPool(10, block_size=2)
    pool.grow(1, 5)  # 3 blocks
    pool.grow(2, 2)  # 1 block
    pool.adopt(3, pool.table(1))  # shares, uses nothing new
    assert pool.stats() == PoolStats(total_blocks=10, free_blocks=6, used_blocks=4, block_size=2, sequences=3)
    pool.free_sequence(1)
    assert pool.stats() == PoolStats(10, 6, 4, 2, 2)  # 1's blocks still held by 3
    pool.free_sequence(3)
    assert pool.stats() == PoolStats(10, 9, 1, 2, 1)


# -- sizing helpers -----------------------------------------------------------



# -- where blocks come from ------------------------------------------------
# A sequence's blocks side by side let attention read its keys as one
# stream (bench/attention.py: 1.7x at 32 rows against scattered blocks).


def test_blocks_come_in_runs_and_a_hole_is_filled_by_what_fits_it():
    pool = BlockPool(12)
    a, b, c = pool.allocate(3), pool.allocate(3), pool.allocate(3)
    assert (a, b, c) == ([0, 1, 2], [3, 4, 5], [6, 7, 8])
    pool.release(b)  # free: 3 4 5, 9 10 11
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(3) == [9, 10, 11]  # the first run of three, not 5 and two others
    assert pool.free_blocks() == [5]


def test_without_a_long_enough_run_the_longest_runs_are_taken_first():
    pool = BlockPool(9)
    held = pool.allocate(9)
    pool.release([held[0], held[2], held[3], held[4], held[7], held[8]])  # free: 0 | 2 3 4 | 7 8
    assert pool.allocate(4) == [2, 3, 4, 7]
    assert pool.free_blocks() == [0, 8]


def test_a_growing_table_takes_the_blocks_right_after_its_last_when_free():
    pool = BlockPool(16, block_size=4)
    pool.grow("a", 8)  # [0, 1]
    pool.grow("b", 4)  # [2]
    pool.free_sequence("b")
    assert pool.grow("a", 16) == [0, 1, 2, 3]
    pool.grow("c", 4)  # [4]
    assert pool.grow("a", 24) == [0, 1, 2, 3, 5, 6]  # 4 is taken: the next run that fits
    pool.adopt("d", [1])
    assert pool.grow("d", 12) == [1, 7, 8]  # after a shared block: the run right after it is not free

@pytest.mark.parametrize(
    ("tokens", "block_size", "expected"),
    [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (7, 1, 7), (9, 4, 3)],
)
def test_blocks_needed(tokens, block_size, expected):
    assert blocks_needed(tokens, block_size) == expected


@given(st.integers(1, 10_000), st.integers(1, 256))
def test_blocks_needed_is_the_ceiling(tokens, block_size):
    n = blocks_needed(tokens, block_size)
    assert n * block_size >= tokens > (n - 1) * block_size


def test_blocks_for_budget():
    # one block of 16 tokens at 100 bytes a token is 1600 bytes
    assert blocks_for_budget(9600, 100) == 6
    assert blocks_for_budget(9599, 100) == 5
    assert blocks_for_budget(11199, 100) == 6
    assert blocks_for_budget(1599, 100) == 0
    assert blocks_for_budget(0, 100) == 0
    # block size 4 at 10 bytes a token: 40 bytes a block
    assert blocks_for_budget(1000, 10, block_size=4) == 25
    assert blocks_for_budget(1039, 10, 4) == 25


@pytest.mark.parametrize(("per_token", "block_size"), [(0, 16), (-1, 16), (100, 0), (100, -4)])
def test_blocks_for_budget_rejects_nonpositive(per_token, block_size):
    with pytest.raises(ValueError):
        blocks_for_budget(10_000, per_token, block_size)


# -- random walk against a model ------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Sequences grow toward a target length in chunks, start from a shared
    prefix of a live sequence, finish, or are cancelled part way. The model
    keeps each sequence's table, token count and target."""

    BLOCKS = 12
    BLOCK = 4

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.BLOCKS, block_size=self.BLOCK)
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, int] = {}
        self.target: dict[int, int] = {}
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _check_grow(self, seq: int, new_tokens: int) -> None:
        old = self.tables.get(seq, [])
        free_before = set(free_list(self.pool))
        want = max(len(old), blocks_needed(new_tokens, self.BLOCK))
        assert self.pool.can_grow(seq, new_tokens)
        table = self.pool.grow(seq, new_tokens)
        assert len(table) == want
        assert table[: len(old)] == old
        assert set(table[len(old) :]) <= free_before
        self.tables[seq] = table
        self.tokens[seq] = max(self.tokens.get(seq, 0), new_tokens)

    @rule(target_tokens=st.integers(1, 30), first=st.integers(1, 30))
    def start(self, target_tokens, first):
        first = min(first, target_tokens)
        seq = self._new_id()
        if self.pool.can_grow(seq, first):
            self.target[seq] = target_tokens
            self._check_grow(seq, first)
        else:
            assert blocks_needed(first, self.BLOCK) > self.pool.num_free

    @precondition(lambda self: any(self.tokens[s] < self.target[s] for s in self.tables))
    @rule(data=st.data())
    def step(self, data):
        growing = sorted(s for s in self.tables if self.tokens[s] < self.target[s])
        seq = data.draw(st.sampled_from(growing))
        n = data.draw(st.integers(1, self.target[seq] - self.tokens[seq]))
        new = self.tokens[seq] + n
        if self.pool.can_grow(seq, new):
            self._check_grow(seq, new)
        else:
            assert blocks_needed(new, self.BLOCK) - len(self.tables[seq]) > self.pool.num_free
            before = snapshot(self.pool, self.tables)
            with pytest.raises(PoolExhausted):
                self.pool.grow(seq, new)
            assert snapshot(self.pool, self.tables) == before

    @precondition(lambda self: any(len(t) >= 1 for t in self.tables.values()))
    @rule(data=st.data())
    def adopt_prefix(self, data):
        donor = data.draw(st.sampled_from(sorted(s for s, t in self.tables.items() if t)))
        # Only full blocks are shared, as a prefix cache would.
        full = min(len(self.tables[donor]), self.tokens[donor] // self.BLOCK)
        k = data.draw(st.integers(0, full))
        prefix = self.tables[donor][:k]
        seq = self._new_id()
        self.pool.adopt(seq, prefix)
        self.tables[seq] = list(prefix)
        self.tokens[seq] = k * self.BLOCK
        self.target[seq] = k * self.BLOCK + data.draw(st.integers(0, 20))

    @precondition(lambda self: any(self.tables.values()))
    @rule(data=st.data())
    def adopt_onto_live_fails(self, data):
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.tables.items() if t)))
        before = snapshot(self.pool, self.tables)
        with pytest.raises(ValueError):
            self.pool.adopt(seq, self.tables[seq][:1])
        assert snapshot(self.pool, self.tables) == before

    def _free(self, seq: int) -> None:
        expect_freed = [b for b in set(self.tables[seq]) if self.pool.refcount(b) == self.tables[seq].count(b)]
        free_before = self.pool.num_free
        assert self.pool.free_sequence(seq) == len(self.tables[seq])
        assert self.pool.num_free == free_before + len(expect_freed)
        del self.tables[seq], self.tokens[seq], self.target[seq]
        assert self.pool.table(seq) == []

    @precondition(lambda self: any(self.tokens[s] >= self.target[s] for s in self.tables))
    @rule(data=st.data())
    def finish(self, data):
        self._free(data.draw(st.sampled_from(sorted(s for s in self.tables if self.tokens[s] >= self.target[s]))))

    @precondition(lambda self: any(self.tokens[s] < self.target[s] for s in self.tables))
    @rule(data=st.data())
    def cancel(self, data):
        self._free(data.draw(st.sampled_from(sorted(s for s in self.tables if self.tokens[s] < self.target[s]))))

    @invariant()
    def accounting_matches_model(self):
        pool = self.pool
        free = free_list(pool)
        held = Counter(b for t in self.tables.values() for b in t)
        assert len(free) == len(set(free)), "free list has duplicates"
        assert not set(free) & set(held), "block both free and held"
        assert pool.num_free + len(held) == self.BLOCKS
        for b in range(self.BLOCKS):
            assert pool.refcount(b) == held[b]
        for seq, table in self.tables.items():
            assert pool.table(seq) == table
            assert len(table) >= blocks_needed(self.tokens[seq], self.BLOCK)
        assert pool.stats() == PoolStats(
            self.BLOCKS, len(free), self.BLOCKS - len(free), self.BLOCK, len(self.tables)
        )

    def teardown(self):
        for seq in list(self.tables):
            self._free(seq)
        assert self.pool.num_free == self.BLOCKS
        assert sorted(free_list(self.pool)) == list(range(self.BLOCKS))
        assert all(self.pool.refcount(b) == 0 for b in range(self.BLOCKS))
        assert self.pool.stats().sequences == 0


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
