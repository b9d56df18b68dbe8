"""The batch-invariant kernels (docs/determinism.md): `tiled_linear` and
`fixed_order_attention` give each row the same bits whatever the other rows,
their number and the padding, and agree with the plain versions to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trioserve.kernels.tiled import PROMPT_TILE, ROW_TILE, float_logits_mm, tiled_head, tiled_linear
from trioserve.kernels.reference import KV_TILE, _grouped_attention, fixed_order_attention


@pytest.mark.parametrize("tile", [ROW_TILE, PROMPT_TILE])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536)])
def test_tiled_linear_rows_do_not_depend_on_their_company(tile, out_features, in_features):
    gen = torch.Generator().manual_seed(tile + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(300, in_features, generator=gen).bfloat16()
    whole = tiled_linear(x, weight, bias, tile)
    assert whole.shape == (300, out_features)
    torch.testing.assert_close(whole.float(), F.linear(x, weight, bias).float(), atol=0.05, rtol=0.02)
    # The same rows alone, a few at a time, and shifted inside the tiles.
    for start, stop in [(0, 1), (7, 8), (5, 37), (100, 300), (tile - 1, tile + 3)]:
        assert torch.equal(tiled_linear(x[start:stop], weight, bias, tile), whole[start:stop]), (start, stop)
    assert tiled_linear(x[:0], weight, bias, tile).shape == (0, out_features)


def test_tiled_head_rows_do_not_depend_on_their_company():
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(4096, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(40, 576, generator=gen).bfloat16()
    whole = tiled_head(x, weight)
    assert whole.shape == (40, 4096)
    torch.testing.assert_close(whole.float(), F.linear(x, weight).float(), atol=0.05, rtol=0.02)
    for start, stop in [(0, 1), (3, 4), (2, 19), (17, 40)]:
        assert torch.equal(tiled_head(x[start:stop], weight), whole[start:stop]), (start, stop)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="float32 logits from a bf16 head need torch.mm's out_dtype, which only the GPU backend has")
def test_a_gpu_head_keeps_float32_logits_and_its_rows_their_bits():
    # bf16 logits near 20 step by 0.125, so two tokens often tie exactly;
    # the GPU head keeps the float32 sums (docs/kernels.md, "The GPU check").
    gen = torch.Generator().manual_seed(6)
    weight = (torch.randn(8192, 576, generator=gen) * 0.5).bfloat16().cuda()
    x = torch.randn(40, 576, generator=gen).bfloat16().cuda()
    assert float_logits_mm(weight)
    whole = tiled_head(x, weight, out_dtype=torch.float32)
    assert whole.dtype == torch.float32
    exact = (x.double() @ weight.double().t()).float()
    torch.testing.assert_close(whole, exact, atol=2e-3, rtol=1e-5)
    assert not torch.equal(whole, whole.bfloat16().float())  # not rounded to bf16
    for start, stop in [(0, 1), (3, 4), (2, 19), (17, 40)]:
        assert torch.equal(tiled_head(x[start:stop], weight, out_dtype=torch.float32), whole[start:stop]), (start, stop)


def test_a_cpu_or_float32_head_is_not_asked_for_float32_sums():
    # torch's CPU backend has no mm with out_dtype; a float32 head needs none.
    assert not float_logits_mm(torch.zeros(4, 4))
    assert not float_logits_mm(torch.zeros(4, 4, dtype=torch.bfloat16, device="meta"))
    if not torch.cuda.is_available():
        assert not float_logits_mm(torch.zeros(4, 4, dtype=torch.bfloat16))


def attention_inputs(seed: int, n_seqs: int, n_q: int, length: int, *, heads: int = 9, kv_heads: int = 3, dim: int = 64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_seqs, n_q, heads, dim, generator=gen).bfloat16()
    keys = torch.randn(kv_heads, n_seqs, length, dim, generator=gen).bfloat16()
    values = torch.randn(kv_heads, n_seqs, length, dim, generator=gen).bfloat16()
    starts = torch.randint(0, length - n_q + 1, (n_seqs,), generator=gen)
    positions = starts[:, None] + torch.arange(n_q)[None, :]
    mask = torch.arange(length)[None, None, :] <= positions[:, :, None]
    return q, keys, values, mask


def test_fixed_order_attention_matches_the_matmul_path_to_rounding():
    q, keys, values, mask = attention_inputs(0, 3, 37, 3 * KV_TILE)
    got = fixed_order_attention(q, keys, values, mask, 0.125)
    torch.testing.assert_close(got.float(), _grouped_attention(q, keys, values, mask, 0.125).float(), atol=0.02, rtol=0.02)


def test_fixed_order_attention_rows_ignore_padding_and_company():
    """Sequence 0's rows: alone with its own keys, padded with two more tiles
    of keys it may not see, and beside two other sequences -- bit-identical."""
    q, keys, values, mask = attention_inputs(1, 3, 20, 2 * KV_TILE)
    alone = fixed_order_attention(q[:1], keys[:, :1], values[:, :1], mask[:1], 0.125)
    crowd = fixed_order_attention(q, keys, values, mask, 0.125)
    assert torch.equal(crowd[:1], alone)

    extra = 2 * KV_TILE
    pad_kv = torch.randn(keys.shape[0], 1, extra, keys.shape[-1]).bfloat16()
    padded_keys = torch.cat([keys[:, :1], pad_kv], dim=2)
    padded_values = torch.cat([values[:, :1], pad_kv], dim=2)
    padded_mask = torch.cat([mask[:1], torch.zeros(1, mask.shape[1], extra, dtype=torch.bool)], dim=2)
    assert torch.equal(fixed_order_attention(q[:1], padded_keys, padded_values, padded_mask, 0.125), alone)

    # One query at a time (as decode rows) gives each row the same bits.
    for i in (0, 7, 19):
        single = fixed_order_attention(q[:1, i : i + 1], keys[:, :1], values[:, :1], mask[:1, i : i + 1], 0.125)
        assert torch.equal(single[0, 0], alone[0, i]), i


def test_fixed_order_attention_refuses_a_partial_tile():
    q, keys, values, mask = attention_inputs(2, 1, 4, KV_TILE + 16)
    with pytest.raises(ValueError, match=f"multiple of {KV_TILE}"):
        fixed_order_attention(q, keys, values, mask, 0.125)
