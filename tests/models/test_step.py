"""build_step on a small example worked out by hand, and its refusals."""

from __future__ import annotations

import pytest
import torch

from trioserve.models.step import SeqChunk, build_step

BS = 4  # block size

# Three sequences, worked by hand (slot = block * 4 + position % 4):
#   s0: prefill of 3 tokens from scratch, table [7]
#       positions 0, 1, 2 -> block 7 offsets 0..2 -> slots 28, 29, 30
#   s1: decode of 1 token with 5 cached, table [2, 9]
#       position 5 -> table[5 // 4] = 9, offset 1 -> slot 37
#   s2: chunk of 2 tokens with 3 cached, table [4, 0]
#       position 3 -> block 4 offset 3 -> slot 19
#       position 4 -> table[1] = 0, offset 0 -> slot 0
# max_q = 3 (s0), so the padded layout is [3 seqs * 3 rows]:
#   s0 rows 0, 1, 2; s1 row 3; s2 rows 6, 7.
# Packed order is s0, s1, s2, so the last tokens sit at 2, 3, 5.
# Keys span 2 blocks * 4 = 8 positions; row j of sequence s sees keys
# 0 .. start_s + j.
CHUNKS = [
    SeqChunk(token_ids=[11, 12, 13], start=0, block_table=[7]),
    SeqChunk(token_ids=[21], start=5, block_table=[2, 9]),
    SeqChunk(token_ids=[31, 32], start=3, block_table=[4, 0]),
]


@pytest.fixture
def step():
    return build_step(CHUNKS, BS)


def test_tokens_positions_slots(step):
    assert step.token_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert step.positions.tolist() == [0, 1, 2, 5, 3, 4]
    assert step.slot_mapping.tolist() == [28, 29, 30, 37, 19, 0]


def test_padded_layout_and_last_index(step):
    assert step.num_seqs == 3
    assert step.pad_index.tolist() == [0, 1, 2, 3, 6, 7]
    assert step.last_index.tolist() == [2, 3, 5]
    # the last token of each sequence is the one fed last for it
    assert step.token_ids[step.last_index].tolist() == [13, 21, 32]


def test_block_tables_padded_with_valid_ids(step):
    assert step.block_tables.shape == (3, 2)
    tables = step.block_tables.tolist()
    assert tables[0][0] == 7
    assert tables[1] == [2, 9]
    assert tables[2] == [4, 0]
    # s0's second entry is padding: any id that exists in the pool is fine
    used = {7, 2, 9, 4, 0}
    assert tables[0][1] in used


def test_mask_on_real_rows(step):
    assert step.mask.shape == (3, 3, 8)
    assert step.mask.dtype == torch.bool
    m = step.mask.int().tolist()
    assert m[0][0] == [1, 0, 0, 0, 0, 0, 0, 0]  # s0 pos 0
    assert m[0][1] == [1, 1, 0, 0, 0, 0, 0, 0]  # s0 pos 1
    assert m[0][2] == [1, 1, 1, 0, 0, 0, 0, 0]  # s0 pos 2
    assert m[1][0] == [1, 1, 1, 1, 1, 1, 0, 0]  # s1 pos 5
    assert m[2][0] == [1, 1, 1, 1, 0, 0, 0, 0]  # s2 pos 3
    assert m[2][1] == [1, 1, 1, 1, 1, 0, 0, 0]  # s2 pos 4
    # padded rows are never read back, but must not be empty (an all-masked
    # row would turn softmax into NaN)
    assert step.mask.any(-1).all()


def test_dtypes_are_long():
    step = build_step(CHUNKS, BS)
    for t in (step.token_ids, step.positions, step.slot_mapping, step.block_tables, step.pad_index, step.last_index):
        assert t.dtype == torch.long


def test_single_sequence_crossing_blocks():
    # 6 tokens from position 2 with block size 4 and table [5, 1]:
    # positions 2, 3 in block 5 (slots 22, 23); 4..7 in block 1 (slots 4..7)
    step = build_step([SeqChunk(list(range(6)), 2, [5, 1])], BS)
    assert step.positions.tolist() == [2, 3, 4, 5, 6, 7]
    assert step.slot_mapping.tolist() == [22, 23, 4, 5, 6, 7]
    assert step.pad_index.tolist() == list(range(6))
    assert step.last_index.tolist() == [5]
    assert step.mask[0, 5].all()  # position 7 sees all 8 keys


def test_table_exactly_full_is_accepted():
    # start 6 + 2 new = 8 tokens = 2 blocks of 4, exactly
    step = build_step([SeqChunk([1, 2], 6, [3, 8])], BS)
    assert step.slot_mapping.tolist() == [8 * 4 + 2, 8 * 4 + 3]


def test_no_chunks():
    with pytest.raises(ValueError):
        build_step([], BS)


def test_empty_chunk():
    with pytest.raises(ValueError, match="1"):
        build_step([SeqChunk([1], 0, [0]), SeqChunk([], 2, [1])], BS)


@pytest.mark.parametrize(
    ("tokens", "start", "table"),
    [
        ([1], 8, [0, 1]),  # 9 tokens, 2 blocks of 4 hold 8
        ([1, 2, 3], 6, [0, 1]),  # 9 tokens
        ([1] * 5, 0, [0]),  # 5 tokens, 1 block
        ([1], 0, []),  # no blocks at all
    ],
)
def test_block_table_too_short(tokens, start, table):
    with pytest.raises(ValueError, match="blocks cannot hold"):
        build_step([SeqChunk([7], 0, [3]), SeqChunk(tokens, start, table)], BS)


def test_decode_chunks_lead_and_are_counted():
    step = build_step([SeqChunk([7], 5, [0, 1], decode=True), SeqChunk([8], 3, [2], decode=True), SeqChunk([1, 2, 3], 0, [3])], 4)
    assert step.num_decode == 2
    assert build_step([SeqChunk([1, 2], 0, [0])], 4).num_decode == 0


def test_decode_chunks_after_prefill_or_longer_than_one_token_are_refused():
    with pytest.raises(ValueError, match="decode chunks must come before prefill chunks"):
        build_step([SeqChunk([1, 2], 0, [0]), SeqChunk([7], 5, [1, 2], decode=True)], 4)
    with pytest.raises(ValueError, match="a decode chunk has exactly one token, got 2"):
        build_step([SeqChunk([7, 8], 5, [1, 2], decode=True)], 4)
