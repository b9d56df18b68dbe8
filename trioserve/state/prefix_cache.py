"""Automatic prefix caching: full KV blocks remembered by their content, so a
request whose prompt starts like an earlier one skips prefilling that part.

A block's key is SHA-256 over (parent block's key, the block's token ids), so
a key names the whole prefix up to and including that block. The cache holds
one pool reference on each block it remembers; requests that reuse a block
add their own, so nothing is copied. Blocks only the cache holds are idle and
are evicted least recently used, under a count limit and an idle-time limit,
or when admission needs room.

An *owner* (a session) can pin the cached chain of its history: each pinned
block gets one more pool reference, so the limits above never take it. Pins
are let go explicitly (the session ends), replaced by the owner's next pin,
or, when admission cannot find room any other way, taken from the owners
pinned least recently (their history is then prefilled again on the next
turn). Pure Python: no torch, no trio."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence

import attrs

from trioserve.state.kv_pool import BlockPool

ROOT = b"trioserve-prefix-root"


@attrs.frozen
class PrefixStats:
    queries: int
    query_tokens: int  # prompt tokens looked up
    hit_tokens: int  # of those, found in the cache
    cached_blocks: int  # blocks the cache remembers now
    idle_blocks: int  # of those, held by no request
    registered_tokens: int  # tokens ever added to the cache
    evictions: int
    pinned_blocks: int = 0  # distinct blocks some owner pins
    pinned_owners: int = 0
    pin_evictions: int = 0  # owners whose pins were taken for room

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@attrs.define
class _Entry:
    block: int
    tokens: tuple[int, ...]
    last_used: float


def held_key(owner: str) -> str:
    """Where a finished turn's KV waits for its owner's commit or cancel."""
    return f"{owner}\x00held"


def chain_root(adapter: str | None, salt: str | None = None) -> bytes:
    """Where a sequence's chain of block keys starts: one root for the base
    model, and one per LoRA adapter, so no two adapters (nor an adapter and
    the base model) ever share a cached block; and with a ``salt`` (a
    tenant's, or a request's cache_salt: types.GenerateRequest.cache_salt)
    one per salt as well, so requests of different salts never hit, time or
    count each other's blocks."""
    root = ROOT if adapter is None else hashlib.sha256(b"lora\0" + adapter.encode()).digest()
    return root if salt is None else hashlib.sha256(b"salt\0" + root + salt.encode()).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCache:
    def __init__(self, pool: BlockPool, *, max_blocks: int | None = None, idle_s: float | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_blocks = max_blocks
        self.idle_s = idle_s
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._queries = self._query_tokens = self._hit_tokens = 0
        self._registered = self._evictions = 0
        self._pins: OrderedDict[str, list[int]] = OrderedDict()  # owner -> pinned blocks, least recent first
        self._pin_counts: Counter[int] = Counter()  # block -> how many owners pin it
        self._pin_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, tokens: Sequence[int], now: float, root: bytes = ROOT) -> list[int]:
        """Blocks holding the longest cached prefix of ``tokens`` in whole
        blocks, leaving at least the last token uncached: a request always
        computes its own last prompt token, so its first new token is sampled
        from its own logits. Marks the hits as used now; counts nothing
        (see `record`), since a request may be matched again while it waits."""
        blocks, keys = self._cached_chain(tokens, (len(tokens) - 1) // self.block_size, root)
        self._touch(keys, now)
        return blocks

    def _cached_chain(self, tokens: Sequence[int], limit: int, root: bytes = ROOT) -> tuple[list[int], list[bytes]]:
        """Blocks and keys of the cached chain of ``tokens``' first ``limit``
        whole blocks (from ``root``: `chain_root`), up to the first block the
        cache does not hold."""
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = root
        for i in range(limit):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            key = block_key(parent, chunk)
            entry = self._entries.get(key)
            if entry is None or entry.tokens != chunk:
                break
            blocks.append(entry.block)
            keys.append(key)
            parent = key
        return blocks, keys

    def _touch(self, chain: list[bytes], now: float) -> None:
        """Mark a chain used, its first block most recent: eviction then takes
        a chain's tail before its head, so what stays is still reachable."""
        for key in reversed(chain):
            self._entries[key].last_used = now
            self._entries.move_to_end(key)

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's lookup."""
        self._queries += 1
        self._query_tokens += query_tokens
        self._hit_tokens += hit_tokens

    def register(self, tokens: Sequence[int], table: Sequence[int], now: float, root: bytes = ROOT) -> int:
        """Remember the full blocks of ``tokens`` (whose KV is in ``table``).
        Blocks already known keep their existing copy. Returns how many
        blocks were added. Limits are applied by `trim`, once the caller
        has let go of the blocks."""
        added = 0
        keys: list[bytes] = []
        parent = root
        for i in range(len(tokens) // self.block_size):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            key = block_key(parent, chunk)
            if key not in self._entries:
                self.pool.share([table[i]])
                self._entries[key] = _Entry(table[i], chunk, now)
                self._registered += self.block_size
                added += 1
            keys.append(key)
            parent = key
        self._touch(keys, now)
        return added

    def idle_blocks(self) -> int:
        return sum(1 for e in self._entries.values() if self.pool.refcount(e.block) == 1)

    # -- pins ---------------------------------------------------------------
    def pin(self, owner: str, tokens: Sequence[int], now: float, root: bytes = ROOT) -> int:
        """Pin the cached chain of ``tokens``' full blocks for ``owner``,
        replacing what it pinned before. Returns the tokens pinned (the
        chain stops at the first block not in the cache)."""
        blocks, keys = self._cached_chain(tokens, len(tokens) // self.block_size, root)
        self.pool.share(blocks)  # before letting the old pins go: they may overlap
        self._pin_counts.update(blocks)
        self.unpin(owner)
        if blocks:  # an owner with nothing pinned is no owner
            self._pins[owner] = blocks
        self._touch(keys, now)
        return len(blocks) * self.block_size

    def move_pin(self, source: str, owner: str) -> int:
        """Give ``source``'s pins to ``owner`` (replacing ``owner``'s); the
        owner becomes the most recently pinned. Returns the tokens moved."""
        blocks = self._pins.pop(source, None)
        if blocks is None:
            return 0
        self.unpin(owner)
        self._pins[owner] = blocks
        return len(blocks) * self.block_size

    def unpin(self, owner: str) -> int:
        """Let go of ``owner``'s pins; returns how many blocks it had."""
        blocks = self._pins.pop(owner, None)
        if not blocks:
            return 0
        self._pin_counts.subtract(blocks)
        self._pin_counts = +self._pin_counts  # drop zeros
        self.pool.release(blocks)
        return len(blocks)

    def pinned_tokens(self, owner: str) -> int:
        return len(self._pins.get(owner, ())) * self.block_size

    def freeable_blocks(self) -> int:
        """Cached blocks held by nothing but the cache and pins: what
        `make_room` could free."""
        return sum(1 for e in self._entries.values() if self.pool.refcount(e.block) == 1 + self._pin_counts[e.block])

    def make_room(self, wanted: int) -> int:
        """Free ``wanted`` blocks if that is possible at all (else nothing):
        idle blocks first, then owners' pins, least recently pinned first.
        Returns the blocks freed."""
        if self.freeable_blocks() < wanted:
            return 0
        while self.idle_blocks() < wanted and self._pins:
            owner = next(iter(self._pins))
            self.unpin(owner)
            self._pin_evictions += 1
        return self.evict(wanted)

    def evict(self, wanted: int) -> int:
        """Free up to ``wanted`` idle blocks, least recently used first."""
        freed = 0
        for key in list(self._entries):
            if freed >= wanted:
                break
            if self._drop_if_idle(key):
                freed += 1
        return freed

    def trim(self, now: float) -> None:
        """Apply the idle-time and count limits to idle blocks."""
        for key in list(self._entries):
            entry = self._entries[key]
            too_many = self.max_blocks is not None and len(self._entries) > self.max_blocks
            too_old = self.idle_s is not None and now - entry.last_used > self.idle_s
            if not (too_many or too_old):
                break  # entries are in last-use order: the rest are newer
            self._drop_if_idle(key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop_if_idle(key)

    def _drop_if_idle(self, key: bytes) -> bool:
        entry = self._entries[key]
        if self.pool.refcount(entry.block) != 1:
            return False
        del self._entries[key]
        self.pool.release([entry.block])
        self._evictions += 1
        return True

    def stats(self) -> PrefixStats:
        return PrefixStats(
            queries=self._queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            cached_blocks=len(self._entries),
            idle_blocks=self.idle_blocks(),
            registered_tokens=self._registered,
            evictions=self._evictions,
            pinned_blocks=len(self._pin_counts),
            pinned_owners=len(self._pins),
            pin_evictions=self._pin_evictions,
        )
