"""The Triton paged attention (kernels/gpu/attention.py) against its torch
twin (kernels/reference.paged_attention), decode rows and prompt rows; its
batch invariance; and its refusals. On a machine without a GPU the kernels
run under Triton's interpreter (tests/conftest.py), so shapes are tiny.

Tolerances: float32 within 2e-6 of the twin. float16 within 5e-3 of the
twin, which rounds scores and probabilities to fp16 (the kernel keeps
scores in fp32 and rounds only the probabilities it multiplies the values
by), and within 1e-3 of the fp32 twin run on the same fp16 values.
bfloat16 is not tested: the interpreter computes it wrongly (see
shared/NOTES.md); on a GPU it takes the float16 path's code.

The pools are poisoned: every slot no row may read (unused blocks, the
slots past a sequence's length in its last block, and the tables' padding
entries, pointed at an unused block) holds NaN, so a read outside a row's
keys shows as NaN in its output. The twin runs on the clean pool."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_native import scattered_prompt_chunks
from trioserve.kernels import reference
from trioserve.kernels.gpu import attention
from trioserve.models.step import SeqChunk, build_step

FP16_TO_TWIN = 5e-3
FP16_TO_FP32 = 1e-3


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _pool(gen, chunks, *, kv_heads, num_blocks, block_size, dim, dtype):
    """K and V pools (clean, poisoned) for ``chunks``, each sequence's keys
    being its first start + len(token_ids) slots through its table."""
    k = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    live = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for c in chunks:
        end = c.start + len(c.token_ids)
        for i, block in enumerate(c.block_table):
            live[block, : max(0, min(block_size, end - i * block_size))] = True
    poisoned = [x.masked_fill(~live[None, :, :, None], float("nan")) for x in (k, v)]
    return (k, v), tuple(poisoned), int((~live.any(dim=1)).nonzero()[0])


def _pad_table(tables: torch.Tensor, chunks, width: int, dead: int) -> torch.Tensor:
    """Tables of ``width`` columns, every entry past a sequence's own
    blocks pointing at the unused block ``dead``."""
    out = torch.full((tables.shape[0], width), dead, dtype=torch.long)
    for s, c in enumerate(chunks):
        out[s, : len(c.block_table)] = torch.tensor(list(c.block_table))
    return out


def _decode_case(gen, *, seqs, block_size, long_row=False):
    """Decode chunks with ragged lengths: one of a single key, one of
    exactly full blocks, one (``long_row``) across several splits, the rest
    not multiples of the block size; blocks scattered over a pool with
    spare blocks."""
    lengths = [1 + (17 * s + 5) % (3 * block_size) for s in range(seqs)]
    lengths[0] = 1
    if seqs > 1:
        lengths[1] = 3 * block_size
    if long_row and seqs > 2:
        lengths[2] = 3 * attention._split_keys(block_size) + 5
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, used = [], 0
    for n in lengths:
        nb = -(-n // block_size)
        chunks.append(SeqChunk([1], n - 1, order[used : used + nb], decode=True))
        used += nb
    return chunks, num_blocks


DECODE_CASES = [
    # seqs, heads, kv_heads, dim, block_size, dtype
    (1, 2, 2, 64, 16, torch.float32),
    (3, 3, 1, 128, 32, torch.float32),
    (33, 4, 1, 64, 16, torch.float32),
    (3, 8, 2, 64, 32, torch.float16),
    (33, 3, 1, 128, 16, torch.float16),
]


@pytest.mark.parametrize(("seqs", "heads", "kv_heads", "dim", "block_size", "dtype"), DECODE_CASES)
def test_decode_rows_match_the_torch_twin(seqs, heads, kv_heads, dim, block_size, dtype):
    gen = torch.Generator().manual_seed(seqs * 100 + heads * 10 + dim)
    chunks, num_blocks = _decode_case(gen, seqs=seqs, block_size=block_size, long_row=True)
    (k, v), (k_bad, v_bad), dead = _pool(gen, chunks, kv_heads=kv_heads, num_blocks=num_blocks, block_size=block_size, dim=dim, dtype=dtype)
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    g = build_step(chunks, block_size).groups[0]
    assert g.decode
    tables = _pad_table(g.block_tables, chunks, g.block_tables.shape[1] + 2, dead)  # padding entries
    scale = dim**-0.5
    got = attention.decode_attention(q, k_bad, v_bad, tables, g.lengths, scale)
    assert got.dtype == torch.float32 and got.shape == (seqs, heads, dim)
    want = reference.paged_attention(q, k, v, g.block_tables, g.pad_index, g.mask, scale).float()
    if dtype == torch.float32:
        _close(got, want, 2e-6)
    else:
        _close(got, want, FP16_TO_TWIN)
        exact = reference.paged_attention(q.float(), k.float(), v.float(), g.block_tables, g.pad_index, g.mask, scale)
        _close(got, exact, FP16_TO_FP32)


def test_a_decode_row_is_the_same_bits_alone_in_company_and_with_a_wider_table():
    gen = torch.Generator().manual_seed(7)
    block_size = 16
    chunks, num_blocks = _decode_case(gen, seqs=12, block_size=block_size, long_row=True)
    (_, _), (k, v), dead = _pool(gen, chunks, kv_heads=2, num_blocks=num_blocks, block_size=block_size, dim=64, dtype=torch.float32)
    q = torch.randn(12, 6, 64, generator=gen)
    crowd = build_step(chunks, block_size, fixed=True).groups[0]  # tables padded to whole KV tiles
    together = attention.decode_attention(q, k, v, crowd.block_tables, crowd.lengths, 0.125)
    assert not together.isnan().any()
    assert not torch.equal(together[3], together[4])  # rows are not all alike
    wider = _pad_table(crowd.block_tables, chunks, crowd.block_tables.shape[1] + 9, dead)
    assert torch.equal(attention.decode_attention(q, k, v, wider, crowd.lengths, 0.125), together)
    for s in (0, 1, 2, 11):
        alone = build_step([chunks[s]], block_size, buckets=False).groups[0]  # unpadded table
        out = attention.decode_attention(q[s : s + 1], k, v, alone.block_tables, alone.lengths, 0.125)
        assert torch.equal(out[0], together[s]), s
    picked = [9, 2, 5]  # a few others, in another order
    some = build_step([chunks[s] for s in picked], block_size).groups[0]
    assert torch.equal(attention.decode_attention(q[picked], k, v, some.block_tables, some.lengths, 0.125), together[picked])
    # A poisoned key inside row 2's length reaches row 2 only.
    k[:, chunks[2].block_table[1], 3] = float("nan")
    hit = attention.decode_attention(q, k, v, crowd.block_tables, crowd.lengths, 0.125)
    assert hit[2].isnan().all() and torch.equal(hit[torch.arange(12) != 2], together[torch.arange(12) != 2])


def _prompt_case(gen, *, block_size):
    """Three prompt chunks: one from position 0 (past the kernel's first
    chunk of keys), one after a cached prefix (a prefix-cache hit), one of
    a single token; blocks scattered."""
    specs = [(0, 70), (2 * block_size + 3, 21), (50, 1)]
    chunks, num_blocks = scattered_prompt_chunks(gen, specs, block_size, spare=3)
    return chunks, num_blocks, sum(n for _, n in specs)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "dtype"),
    [(3, 1, 64, 16, torch.float32), (2, 2, 128, 32, torch.float32), (8, 2, 64, 16, torch.float16)],
)
def test_prompt_rows_match_the_torch_twin_and_each_row_is_its_own(heads, kv_heads, dim, block_size, dtype):
    """Prompt chunks read row by row (row_seq): the twin's causal attention
    over a cached prefix; and a row's bits do not depend on how its prompt
    was chunked or what else is in the call."""
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    chunks, num_blocks, rows = _prompt_case(gen, block_size=block_size)
    (k, v), (k_bad, v_bad), dead = _pool(gen, chunks, kv_heads=kv_heads, num_blocks=num_blocks, block_size=block_size, dim=dim, dtype=dtype)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    g = build_step(chunks, block_size, buckets=False).groups[0]
    assert not g.decode and g.row_seq.tolist() == [0] * 70 + [1] * 21 + [2]
    scale = dim**-0.5
    tables = _pad_table(g.block_tables, chunks, g.block_tables.shape[1] + 1, dead)
    got = attention.decode_attention(q, k_bad, v_bad, tables, g.row_lengths, scale, row_seq=g.row_seq)
    want = reference.paged_attention(q, k, v, g.block_tables, g.pad_index, g.mask, scale).float()
    if dtype == torch.float32:
        _close(got, want, 2e-6)
    else:
        _close(got, want, FP16_TO_TWIN)
        exact = reference.paged_attention(q.float(), k.float(), v.float(), g.block_tables, g.pad_index, g.mask, scale)
        _close(got, exact, FP16_TO_FP32)
    # The first prompt cut into pieces (each after the earlier ones' KV), each alone.
    first = chunks[0]
    for cuts in ([13], [1, 20, 33, 66]):
        bounds = [0, *cuts, len(first.token_ids)]
        for lo, hi in zip(bounds, bounds[1:]):
            part = SeqChunk(first.token_ids[lo:hi], lo, first.block_table)
            alone = build_step([part], block_size, buckets=False).groups[0]
            out = attention.decode_attention(q[lo:hi], k_bad, v_bad, alone.block_tables, alone.row_lengths, scale, row_seq=alone.row_seq)
            assert torch.equal(out, got[lo:hi]), (cuts, lo)
    # The second prompt's rows, listed before the first's in one call.
    swapped = build_step([chunks[1], chunks[0]], block_size, buckets=False).groups[0]
    order = list(range(70, 91)) + list(range(70))
    out = attention.decode_attention(q[order], k_bad, v_bad, swapped.block_tables, swapped.row_lengths, scale, row_seq=swapped.row_seq)
    assert torch.equal(out, got[order])


def test_refuses_reads_outside_the_pool_and_shapes_it_does_not_take():
    gen = torch.Generator().manual_seed(3)
    chunks, num_blocks = _decode_case(gen, seqs=2, block_size=16)
    (k, v), _, _ = _pool(gen, chunks, kv_heads=2, num_blocks=num_blocks, block_size=16, dim=64, dtype=torch.float32)
    q = torch.randn(2, 4, 64, generator=gen)
    g = build_step(chunks, 16, buckets=False).groups[0]
    run = attention.decode_attention
    too_long = g.lengths.clone()
    too_long[1] = g.block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="row 1 has length 49, outside 1..48"):
        run(q, k, v, g.block_tables, too_long, 0.125)
    with pytest.raises(RuntimeError, match="row 0 has length 0"):
        run(q, k, v, g.block_tables, torch.tensor([0, 3]), 0.125)
    bad_block = g.block_tables.clone()
    bad_block[1, 2] = num_blocks
    with pytest.raises(RuntimeError, match=f"row 1 reads block id {num_blocks} .its block 2., outside the pool of {num_blocks} blocks"):
        run(q, k, v, bad_block, g.lengths, 0.125)
    bad_block[1, 2] = -1  # and a bad id past a row's length is never read
    with pytest.raises(RuntimeError, match="block id -1"):
        run(q, k, v, bad_block, g.lengths, 0.125)
    assert not run(q, k, v, bad_block, torch.tensor([1, 32]), 0.125).isnan().any()
    with pytest.raises(RuntimeError, match="prompt row 1 reads table row 2, but the block tables have 2 rows"):
        run(q, k, v, g.block_tables, g.lengths, 0.125, row_seq=torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="row 1 reads table row 1, but the block tables have 1 rows"):
        run(q, k, v, g.block_tables[:1], g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="2 query rows need 2 lengths"):
        run(q, k, v, g.block_tables, g.lengths[:1], 0.125)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16 alike"):
        run(q.half(), k, v, g.block_tables, g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16 alike"):
        run(q.double(), k.double(), v.double(), g.block_tables, g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="integer block tables"):
        run(q, k, v, g.block_tables.float(), g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="head dim 64 with 3 heads over 2 KV heads"):
        run(q[:, :3], k, v, g.block_tables, g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="head dim 32 with 4 heads"):
        run(q[..., :32], k, v, g.block_tables, g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="contiguous K and V"):
        run(q, k.transpose(1, 2), v.transpose(1, 2), g.block_tables, g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="q .R, H, D. and caches"):
        run(q[0], k, v, g.block_tables, g.lengths, 0.125)
    assert run(q[:0], k, v, g.block_tables[:0], g.lengths[:0], 0.125).shape == (0, 4, 64)
