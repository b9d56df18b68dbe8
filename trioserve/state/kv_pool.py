"""Accounting for the fixed pool of KV cache blocks. Pure Python: no torch, no
trio. The tensors live with the worker; this decides which block ids are whose.

Blocks are reference counted so prefix sharing can hand one block to several
sequences; a block is free again when its last holder lets go.

Free blocks are handed out in runs of consecutive ids where the pool has
them: a sequence's blocks then lie side by side in the KV tensors, and
attention reads its keys as one stream the CPU's prefetchers follow
instead of scattered 2 KiB pieces (1.7x faster at 32 decode rows,
bench/attention.py). The first-in, first-out free list this replaced
scattered them as soon as the prefix cache evicted blocks out of order:
over a multi-turn run with a pool small enough to evict (bench/multiturn.py
--kv-cache-mib 24), 41% of neighbouring blocks in a table were adjacent
with it, 77% with runs (bench/README.md, "The fourth round")."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Hashable, Iterable

import attrs

DEFAULT_BLOCK_SIZE = 16


class PoolExhausted(Exception):
    """Raised by `allocate` when fewer blocks are free than asked for. Callers
    that plan ahead check `can_allocate` first and never see it."""


@attrs.frozen
class PoolStats:
    total_blocks: int
    free_blocks: int
    used_blocks: int
    block_size: int
    sequences: int


def blocks_for_budget(budget_bytes: int, bytes_per_token: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """How many whole blocks fit in ``budget_bytes``."""
    if bytes_per_token <= 0 or block_size <= 0:
        raise ValueError("bytes_per_token and block_size must be positive")
    if budget_bytes < 0:
        raise ValueError(f"a KV budget cannot be negative ({budget_bytes} bytes)")
    return budget_bytes // (bytes_per_token * block_size)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    """Block ids 0 .. num_blocks-1, each free or held by one or more owners."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = bytearray(b"\x01" * num_blocks)  # 1: free
        self._num_free = num_blocks
        self._refs = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}

    # -- blocks -----------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self._num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` free blocks, each with one reference: the ``n`` right
        after block ``after`` when they are free, else the first run of
        ``n`` free ones, else the longest runs there are."""
        if not self.can_allocate(n):
            raise PoolExhausted(f"asked for {n} blocks, {self._num_free} free of {self.num_blocks}")
        if n == 0:
            return []
        run = b"\x01" * n
        start = after + 1 if after is not None and self._free.startswith(run, after + 1) else self._free.find(run)
        if start >= 0:
            out = list(range(start, start + n))
        else:
            runs = sorted(((m.end() - m.start(), m.start()) for m in re.finditer(b"\x01+", self._free)), key=lambda r: (-r[0], r[1]))
            out = []
            for length, first in runs:
                out.extend(range(first, first + min(length, n - len(out))))
                if len(out) == n:
                    break
        for b in out:
            self._free[b] = 0
            self._refs[b] = 1
        self._num_free -= n
        return out

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to blocks someone already holds."""
        blocks = list(blocks)
        for b in blocks:
            self._check_id(b)
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
        for b in blocks:
            self._refs[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; a block nobody holds is free again.
        Checks the whole list before changing anything, repeats included."""
        blocks = list(blocks)
        for b, times in Counter(blocks).items():
            self._check_id(b)
            if self._refs[b] < times:
                raise ValueError(f"block {b} released {times} times but held {self._refs[b]} times (double free)")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = 1
                self._num_free += 1

    def free_blocks(self) -> list[int]:
        """The free block ids, in order."""
        return [b for b, free in enumerate(self._free) if free]

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refs[block]

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} is outside the pool (0..{self.num_blocks - 1})")

    # -- per-sequence tables ---------------------------------------------
    def table(self, seq: Hashable) -> list[int]:
        """The blocks of ``seq`` in position order (a copy)."""
        return list(self._tables.get(seq, ()))

    def can_grow(self, seq: Hashable, num_tokens: int) -> bool:
        return self.can_allocate(self._missing(seq, num_tokens))

    def grow(self, seq: Hashable, num_tokens: int) -> list[int]:
        """Make ``seq``'s table cover ``num_tokens`` tokens; returns the table."""
        have = self._tables.get(seq)
        new = self.allocate(self._missing(seq, num_tokens), have[-1] if have else None)  # may raise; nothing changed then
        table = self._tables.setdefault(seq, [])
        table.extend(new)
        return list(table)

    def adopt(self, seq: Hashable, blocks: Iterable[int]) -> None:
        """Start ``seq``'s table with blocks shared from elsewhere (prefix hits)."""
        if self._tables.get(seq):
            raise ValueError(f"sequence {seq!r} already has blocks")
        blocks = list(blocks)
        self.share(blocks)
        self._tables[seq] = blocks

    def free_sequence(self, seq: Hashable) -> int:
        """Release all of ``seq``'s blocks; returns how many it held."""
        table = self._tables.pop(seq, [])
        self.release(table)
        return len(table)

    def _missing(self, seq: Hashable, num_tokens: int) -> int:
        have = len(self._tables.get(seq, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - have)

    def stats(self) -> PoolStats:
        free = self._num_free
        return PoolStats(self.num_blocks, free, self.num_blocks - free, self.block_size, len(self._tables))
