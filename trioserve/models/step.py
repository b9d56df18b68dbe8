"""One forward step's inputs: several sequences' new tokens packed together,
with the positions, cache slots and attention layout the model needs.
Built once per step from plain lists; every layer reuses it."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


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


@attrs.frozen
class StepBatch:
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long
    block_tables: torch.Tensor  # [S, MB] long
    pad_index: torch.Tensor  # [T] long, place of each token in the padded [S * max_q] layout
    mask: torch.Tensor  # [S, max_q, MB * block_size] bool
    last_index: torch.Tensor  # [S] long, each sequence's last token in the packed order
    num_decode: int = 0  # the first num_decode tokens are decode tokens

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])


def build_step(chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu") -> StepBatch:
    """Pack ``chunks`` into one StepBatch. Raises ValueError when a chunk is
    empty or its block table does not cover its new tokens."""
    if not chunks:
        raise ValueError("a step needs at least one sequence")
    max_q = max(len(c.token_ids) for c in chunks)
    max_blocks = max(len(c.block_table) for c in chunks)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    pad: list[int] = []
    last: list[int] = []
    tables = []
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
        ids.extend(chunk.token_ids)
        for pos in range(chunk.start, end):
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        pad.extend(range(s * max_q, s * max_q + n))
        last.append(len(ids) - 1)
        table = list(chunk.block_table)
        tables.append(table + [table[0]] * (max_blocks - len(table)))
    pos_t = torch.tensor(positions, dtype=torch.long)
    starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
    # Padded query rows get position start + offset; rows past a sequence's
    # length are never read back, so what they attend to does not matter.
    q_pos = starts[:, None] + torch.arange(max_q)[None, :]
    key_pos = torch.arange(max_blocks * block_size)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    return StepBatch(
        token_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=pos_t.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        pad_index=torch.tensor(pad, dtype=torch.long, device=device),
        mask=mask.to(device),
        last_index=torch.tensor(last, dtype=torch.long, device=device),
        num_decode=num_decode,
    )
