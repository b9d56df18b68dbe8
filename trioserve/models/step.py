"""One forward step's inputs: several sequences' new tokens packed together,
with the positions, cache slots and attention layout the model needs.
Built once per step from plain lists; every layer reuses it.

Shapes are bucketed. A server's steps come in endlessly varying sizes (how
many prompt tokens, how many sequences, how long their contexts), and every
new size makes the allocator carve out new blocks and oneDNN build and
cache new matmul kernels: resident memory then grows without end. So the
prompt tokens of a step are padded to `bucket(n)` tokens, and each attention
group's query rows and key blocks are padded likewise, leaving a few dozen
sizes in all. Padding never changes a result: pad tokens are never written to
the cache nor read back, and padded keys are masked out."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from trioserve.kernels.reference import KV_TILE, SDPA_MIN_QUERIES


def bucket(n: int) -> int:
    """``n`` rounded up to one of four sizes per power of two: exact up to 8,
    then multiples of 2**(k - 2) for n in (2**k, 2**(k + 1)] -- under 25% over."""
    if n <= 8:
        return n
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


@attrs.frozen
class SeqChunk:
    """New tokens of one sequence for this step.

    token_ids: the tokens to feed (a prefill chunk, or one decode token).
    start: how many tokens of this sequence are already in the KV cache; the
        new tokens take positions start, start + 1, ...
    block_table: KV block ids covering positions [0, start + len(token_ids)).
    decode: the token is a generated one (not part of the prompt). Decode
        chunks come first in a step and are one token each; models with
        4-bit weights multiply them with those, prompt tokens with bf16, so
        a token's arithmetic never depends on what shares its step."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    decode: bool = False
    adapter: str | None = None  # the LoRA adapter these tokens run with (models/lora_set.py)


@attrs.frozen
class AttentionGroup:
    """Sequences whose queries attend together: the real tokens
    [first, first + count) of the packed order, scattered into a padded
    [S, max_q] layout. Decode rows (one query each) form one group and
    prompt chunks another, so a one-token row is never padded to a prompt
    chunk's length.

    flash: use the fused attention kernel; decided from the real longest
    chunk (not its bucket), so padding never switches kernels.
    fixed: batch-invariant attention (kernels.reference.fixed_order_attention);
    the key length is then a multiple of KV_TILE."""

    first: int
    count: int
    block_tables: torch.Tensor  # [S, MB] long, padded with a valid id
    pad_index: torch.Tensor  # [count] long, place of each token in [S * max_q]
    mask: torch.Tensor  # [S, max_q, MB * block_size] bool, True = may attend
    flash: bool
    fixed: bool = False
    lengths: torch.Tensor | None = None  # [S] long, keys each sequence attends to (start + new tokens)
    decode: bool = False  # the step's decode rows, one query each
    # Per real token of a prompt group (None for the decode group), for
    # attention read row by row (kernels/native.py): its sequence (a row of
    # block_tables) and the keys it attends to (its position + 1).
    row_seq: torch.Tensor | None = None  # [count] long
    row_lengths: torch.Tensor | None = None  # [count] long


@attrs.frozen
class StepBatch:
    """token_ids and positions hold ``num_tokens`` real tokens then pad
    tokens (id 0 at position 0) up to a bucketed length; slot_mapping covers
    the real tokens only."""

    token_ids: torch.Tensor  # [T_padded] long
    positions: torch.Tensor  # [T_padded] long
    slot_mapping: torch.Tensor  # [T] long
    last_index: torch.Tensor  # [S] long, each sequence's last token in the packed order
    groups: tuple[AttentionGroup, ...]
    num_decode: int = 0  # the first num_decode tokens are decode tokens
    block_size: int = 1
    chunks: tuple[SeqChunk, ...] = ()
    fixed: bool = False  # batch-invariant arithmetic (DecoderModel.batch_invariant)
    # The packed tokens of each LoRA adapter in the step, by adapter key
    # (empty: every token runs on the base model alone).
    lora_rows: tuple[tuple[str, torch.Tensor], ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    # The whole step as ONE exact (unbucketed) padded layout: what
    # `paged_attention` takes for a single group. The model uses `groups`.
    @property
    def block_tables(self) -> torch.Tensor:  # [S, MB] long
        return _block_tables(self.chunks, max(len(c.block_table) for c in self.chunks), self.positions.device)

    @property
    def pad_index(self) -> torch.Tensor:  # [T] long
        return _pad_index(self.chunks, max(len(c.token_ids) for c in self.chunks), self.positions.device)

    @property
    def mask(self) -> torch.Tensor:  # [S, max_q, MB * block_size] bool
        max_q = max(len(c.token_ids) for c in self.chunks)
        max_blocks = max(len(c.block_table) for c in self.chunks)
        return _mask(self.chunks, max_q, max_blocks * self.block_size, self.positions.device)


def _check(chunks: Sequence[SeqChunk], block_size: int) -> int:
    """Refuse what no step can run; return the number of leading decode chunks."""
    if not chunks:
        raise ValueError("a step needs at least one sequence")
    num_decode = 0
    for s, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        if chunk.decode:
            if num_decode != s:
                raise ValueError(f"sequence {s}: decode chunks must come before prefill chunks")
            if n != 1:
                raise ValueError(f"sequence {s}: a decode chunk has exactly one token, got {n}")
            num_decode += 1
        if n == 0:
            raise ValueError(f"sequence {s} has no new tokens")
        if chunk.start < 0:
            raise ValueError(f"sequence {s} starts at negative position {chunk.start}")
        end = chunk.start + n
        if len(chunk.block_table) * block_size < end:
            raise ValueError(f"sequence {s}: {len(chunk.block_table)} blocks cannot hold {end} tokens")
    return num_decode


def _block_tables(chunks: Sequence[SeqChunk], max_blocks: int, device) -> torch.Tensor:
    rows = [list(c.block_table) + [c.block_table[0]] * (max_blocks - len(c.block_table)) for c in chunks]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _pad_index(chunks: Sequence[SeqChunk], max_q: int, device) -> torch.Tensor:
    pad: list[int] = []
    for s, chunk in enumerate(chunks):
        pad.extend(range(s * max_q, s * max_q + len(chunk.token_ids)))
    return torch.tensor(pad, dtype=torch.long, device=device)


def _mask(chunks: Sequence[SeqChunk], max_q: int, keys: int, device) -> torch.Tensor:
    # Padded query rows get position start + offset; rows past a sequence's
    # length are never read back, so what they attend to does not matter
    # (but it is never nothing, which would make softmax NaN).
    starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
    q_pos = starts[:, None] + torch.arange(max_q)[None, :]
    mask = torch.arange(keys)[None, None, :] <= q_pos[:, :, None]
    return mask.to(device)


def _group(
    chunks: Sequence[SeqChunk], first: int, block_size: int, buckets: bool, fixed: bool, device, *, decode: bool = False
) -> AttentionGroup:
    longest = max(len(c.token_ids) for c in chunks)
    most_blocks = max(len(c.block_table) for c in chunks)
    max_q = bucket(longest) if buckets else longest
    max_blocks = bucket(most_blocks) if buckets else most_blocks
    if fixed:  # whole KV tiles: a multiple of both the block size and KV_TILE keys
        per_tile = math.lcm(block_size, KV_TILE) // block_size
        max_blocks = -(-max_blocks // per_tile) * per_tile
    return AttentionGroup(
        first=first,
        count=sum(len(c.token_ids) for c in chunks),
        block_tables=_block_tables(chunks, max_blocks, device),
        pad_index=_pad_index(chunks, max_q, device),
        mask=_mask(chunks, max_q, max_blocks * block_size, device),
        flash=not fixed and longest >= SDPA_MIN_QUERIES,
        fixed=fixed,
        lengths=torch.tensor([c.start + len(c.token_ids) for c in chunks], dtype=torch.long, device=device),
        decode=decode,
        # Decode rows read row s of the tables up to lengths[s]: these are for prompt rows.
        row_seq=None if decode else torch.tensor([s for s, c in enumerate(chunks) for _ in c.token_ids], dtype=torch.long, device=device),
        row_lengths=None
        if decode
        else torch.tensor([c.start + i + 1 for c in chunks for i in range(len(c.token_ids))], dtype=torch.long, device=device),
    )


def build_step(
    chunks: Sequence[SeqChunk],
    block_size: int,
    device: torch.device | str = "cpu",
    *,
    buckets: bool = True,
    fixed: bool = False,
) -> StepBatch:
    """Pack ``chunks`` into one StepBatch; ``buckets=False`` pads nothing
    (the same results, for tests); ``fixed`` lays attention out for the
    batch-invariant path. Raises ValueError when a chunk is empty or its
    block table does not cover its new tokens."""
    num_decode = _check(chunks, block_size)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last: list[int] = []
    for chunk in chunks:
        ids.extend(chunk.token_ids)
        for pos in range(chunk.start, chunk.start + len(chunk.token_ids)):
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        last.append(len(ids) - 1)
    # Only prompt tokens are padded: decode rows use the 4-bit weights, whose
    # kernel keeps no per-shape state and costs in proportion to its rows.
    prompt_tokens = len(ids) - num_decode
    if buckets and prompt_tokens:
        pad = bucket(prompt_tokens) - prompt_tokens
        ids.extend([0] * pad)
        positions.extend([0] * pad)
    by_adapter: dict[str, list[int]] = {}
    at = 0
    for chunk in chunks:
        if chunk.adapter is not None:
            by_adapter.setdefault(chunk.adapter, []).extend(range(at, at + len(chunk.token_ids)))
        at += len(chunk.token_ids)
    groups = []
    if num_decode:
        groups.append(_group(chunks[:num_decode], 0, block_size, buckets, fixed, device, decode=True))
    if num_decode < len(chunks):
        groups.append(_group(chunks[num_decode:], num_decode, block_size, buckets, fixed, device))
    return StepBatch(
        token_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        last_index=torch.tensor(last, dtype=torch.long, device=device),
        groups=tuple(groups),
        num_decode=num_decode,
        block_size=block_size,
        chunks=tuple(chunks),
        fixed=fixed,
        lora_rows=tuple((key, torch.tensor(rows, dtype=torch.long, device=device)) for key, rows in by_adapter.items()),
    )
