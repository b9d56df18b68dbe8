"""4-bit weights taken straight from GGUF Q4_0/Q4_1 blocks: the codes,
scales and zeros must reproduce the file's own dequantization, survive the
Q/K row un-permutation, and the int4 matmul must agree with the bf16 one."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from trioserve.kernels import native
from trioserve.kernels.int4 import concat_rows, parts_from_gguf
from trioserve.kernels.projection import Int8Rows, Projection
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_parts_reproduce_gguf_dequantization(qtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 96)).astype(np.float32) * 0.3 + 0.05
    raw = gguf.quants.quantize(w, qtype)
    expected = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    parts = parts_from_gguf(raw, qtype.name)
    assert parts.q.shape == (24, 96) and int(parts.q.max()) <= 15
    np.testing.assert_allclose(parts.dequantize().numpy(), expected, atol=1e-6, rtol=0)


def test_q4_1_checkpoint_keeps_int4_parts_in_unpermuted_row_order(tiny_checkpoints):
    """Every layer matrix of the Q4_1 file has 4-bit parts whose values are
    exactly the dequantized weights under the same (HF, un-permuted) rows."""
    ckpt = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.float32)
    matrices = [n for n, t in ckpt.weights.items() if n.startswith("model.layers.") and t.ndim == 2]
    assert sorted(ckpt.int4) == sorted([*matrices, "lm_head.weight"])  # the head's codes too (for the head on the 4-bit kernel)
    for name in [*matrices, "lm_head.weight"]:
        torch.testing.assert_close(ckpt.int4[name].dequantize(), ckpt.weights[name], atol=1e-6, rtol=0, msg=name)
    f32 = load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32)
    assert f32.int4 == {}


@pytest.mark.parametrize(("rows", "int4_rows"), [(1, 1), (5, 5), (20, 0), (20, 7), (20, 20)])
def test_projection_int4_and_bf16_paths_agree(rows, int4_rows):
    rng = np.random.default_rng(rows)
    pieces = [gguf.quants.quantize(rng.standard_normal((n, 64)).astype(np.float32), Q.Q4_1) for n in (32, 16)]
    parts = concat_rows([parts_from_gguf(p, "Q4_1") for p in pieces])
    exact = parts.dequantize()
    proj = Projection(exact.to(torch.bfloat16), None, parts)
    assert proj.packed is not None
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    reference = x.float() @ exact.T
    out = proj(x, int4_rows).float()
    # Both paths round to bf16; the error is bf16's, relative to the output scale.
    assert (out - reference).abs().max() <= 0.02 * reference.abs().max()
    # The leading int4_rows rows went through the int4 kernel, the rest through bf16.
    bf16_rows = torch.nn.functional.linear(x, exact.to(torch.bfloat16)).float()
    assert torch.equal(out[int4_rows:], bf16_rows[int4_rows:])
    if int4_rows:
        alone = torch._weight_int4pack_mm_for_cpu(x[:int4_rows].contiguous(), proj.packed, 32, proj.scales_zeros).float()
        assert torch.equal(out[:int4_rows], alone)


def test_float32_projection_packs_and_gives_a_bf16_models_int4_arithmetic():
    """With float32 weights (the default where bf16 is slow, kernels/cpu.py)
    the int4 rows are the bf16 model's int4 rows, cast: the same bits; the
    other rows stay float32. float16 weights never pack."""
    rng = np.random.default_rng(0)
    parts = parts_from_gguf(gguf.quants.quantize(rng.standard_normal((16, 32)).astype(np.float32), Q.Q4_0), "Q4_0")
    f32 = Projection(parts.dequantize(), None, parts)
    bf16 = Projection(parts.dequantize().to(torch.bfloat16), None, parts)
    assert f32.packed is not None
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    out = f32(x, 3)
    assert out.dtype == torch.float32
    assert torch.equal(out[:3], bf16(x[:3].to(torch.bfloat16), 3).float())
    assert torch.equal(out[3:], torch.nn.functional.linear(x[3:], parts.dequantize()))
    assert Projection(parts.dequantize().half(), None, parts).packed is None


@pytest.mark.parametrize("n", [96, 8192 + 64])
def test_an_8_bit_head_made_slice_by_slice_is_the_one_made_whole(n):
    """`Int8Rows.from_rows` (the file's rows, a slice at a time, packed as
    they come) holds the same codes, scales and kernel layout as the head
    made from the whole weight, and gives the same logits; its codes exist
    once (in the kernel's layout where the C kernel runs)."""
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, 64, generator=gen) * torch.rand(n, 1, generator=gen)
    asked = []

    def fetch(start, end):
        asked.append((start, end))
        return weight[start:end].clone()

    whole, sliced = Int8Rows(weight), Int8Rows.from_rows(fetch, n, 64)
    assert asked == [(s, min(n, s + 4096)) for s in range(0, n, 4096)]
    assert torch.equal(whole.q, sliced.q) and torch.equal(whole.scale, sliced.scale)
    assert (whole.native is None) == (sliced.native is None)
    if sliced.native is not None:
        assert torch.equal(whole.native.packed, sliced.native.packed) and sliced._q is None
    x = torch.randn(5, 64, generator=gen)
    assert torch.equal(whole(x), sliced(x))


@pytest.mark.parametrize("rows", [1, 3, 7, 32, 33, 129])
def test_int8_rows_are_close_and_each_row_is_computed_on_its_own(rows):
    """The 8-bit head: within 8-bit rounding of the float32 product, and a
    row's logits are the same bits alone and beside 31 (or more) others."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 96, generator=gen) * torch.rand(1000, 1, generator=gen)
    head = Int8Rows(weight)
    assert head.q.dtype == torch.int8 and head.scale.shape == (1000,)
    # Rounding to nearest with the (bf16) scale the kernel uses: at most half a step per weight.
    assert ((head.dequantize() - weight).abs() <= head.scale.float()[:, None] * 0.5 * (1 + 1e-5)).all()
    crowd = torch.randn(max(32, rows), 96, generator=gen)
    x = crowd[:rows]
    out = head(x)
    reference = x.to(torch.bfloat16).float() @ weight.T
    assert out.dtype == torch.float32 and out.shape == (rows, 1000)
    assert (out - reference).abs().max() <= 0.02 * reference.abs().max()
    together = head(crowd)
    for r in range(rows):
        assert torch.equal(out[r], together[r])
        assert torch.equal(head(crowd[r : r + 1])[0], together[r])


@pytest.mark.parametrize("activations", ["int8", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_model_with_int4_weights_has_a_quantized_head(tiny_checkpoints, dtype, activations):
    """A model with 4-bit projections (float32 or bf16) computes its head on
    the file's 4-bit codes with int8 activations (as the layers), or on an
    8-bit copy with bf16 ones; one without them keeps the dense head.
    Greedy picks match the dense model's and the logits stay close. Without
    an int8-activation C kernel (no C compiler) int8 runs on the torch twin."""
    kernels = "reference" if activations == "int8" and not native.int4_q8_supported(16, 32) else "auto"
    quantized = DecoderModel.from_checkpoint(load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=dtype), activations=activations, kernels=kernels)
    assert quantized.layers[0].qkv.packed is not None or quantized.layers[0].qkv.q8_twin is not None
    if activations == "int8":
        assert quantized.head_codes.kind == "4-bit" and quantized.head_int8 is None and quantized.lm_head.is_meta
    else:
        assert quantized.head_int8 is not None and quantized.head_codes is None
    dense = DecoderModel.from_checkpoint(load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.float32), use_int4=False)
    assert dense.head_int8 is None and dense.head_codes is None
    step = build_step([SeqChunk([3], 4, [2, 3], decode=True), SeqChunk([5, 9, 33, 7], 0, [0, 1])], 4)
    a = quantized.forward(step, quantized.new_kv_cache(4, 4))
    b = dense.forward(step, dense.new_kv_cache(4, 4))
    assert a.shape == b.shape == (2, dense.config.vocab_size) and a.dtype == torch.float32
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_bf16_model_with_int4_weights_matches_without(tiny_checkpoints):
    """The int4 path is a faster way to multiply by the same weights: the
    logits of a decode-sized step agree with the bf16-only model's."""
    ckpt = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.bfloat16)
    with_int4 = DecoderModel.from_checkpoint(ckpt)
    without = DecoderModel.from_checkpoint(ckpt, use_int4=False)
    assert with_int4.layers[0].qkv.packed is not None and without.layers[0].qkv.packed is None
    step = build_step([SeqChunk([3], 4, [2, 3], decode=True), SeqChunk([5, 9, 33, 7], 0, [0, 1])], 4)
    assert step.num_decode == 1
    a = with_int4.forward(step, with_int4.new_kv_cache(4, 4))
    b = without.forward(step, without.new_kv_cache(4, 4))
    prompt_only = with_int4.forward(build_step([SeqChunk([5, 9, 33, 7], 0, [0, 1])], 4), with_int4.new_kv_cache(4, 4))
    # Prompt tokens use bf16 weights whether or not a decode row shares the step.
    assert torch.equal(a[1], prompt_only[0])
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("n", "k", "with_bias"), [(96, 64, False), (64, 160, True)])
def test_prompt_tiles_join_only_where_they_round_as_single_tiles(dtype, n, k, with_bias):
    """Prompt rows in calls of several 128-row tiles give the bits of one
    tile at a time, at every row count; the check says how many tiles may
    join, and says 1 where a bigger call would round otherwise."""
    from trioserve.kernels import tiled

    joined = tiled.prompt_tiles_per_call(n, k, dtype, with_bias, torch.get_num_threads())
    assert 1 <= joined <= tiled.MOST_TILES_PER_CALL
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    for rows in (1, 128, 300, 5 * 128 + 17):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        assert torch.equal(tiled.tiled_linear(x, weight, bias, 128, joined), tiled.tiled_linear(x, weight, bias, 128, 1))


def test_prompt_tiles_stay_single_where_a_bigger_call_rounds_otherwise(monkeypatch):
    """torch's F.linear (a boundary we do not own) made to round calls of
    more than one tile differently: the check finds it and keeps tiles
    single."""
    from trioserve.kernels import tiled

    real = tiled.F.linear

    def rounding_by_rows(x, weight, bias=None):
        out = real(x, weight, bias)
        return out * (1 + 2**-7) if x.shape[0] > tiled.PROMPT_TILE else out

    monkeypatch.setattr(tiled.F, "linear", rounding_by_rows)
    tiled.prompt_tiles_per_call.cache_clear()
    try:
        assert tiled.prompt_tiles_per_call(64, 64, torch.bfloat16, False, torch.get_num_threads()) == 1
    finally:
        tiled.prompt_tiles_per_call.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("n", "k", "with_bias"), [(96, 64, False), (64, 160, True)])
def test_a_prompt_tail_cut_to_16_row_multiples_gives_the_bits_of_whole_tiles(dtype, n, k, with_bias):
    """The last, partial tile of prompt rows padded only to a multiple of
    16 rows (where the check allows it) gives every row the bits it gets
    in whole 128-row tiles, at every row count."""
    from trioserve.kernels import tiled

    threads = torch.get_num_threads()
    joined = tiled.prompt_tiles_per_call(n, k, dtype, with_bias, threads)
    tail = tiled.prompt_tail_rows(n, k, dtype, with_bias, threads)
    assert tail in (tiled.ROW_TILE, tiled.PROMPT_TILE)
    gen = torch.Generator().manual_seed(k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    for rows in (1, 17, 107, 128, 172, 300, 4 * 128 + 100):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        got = tiled.tiled_linear(x, weight, bias, 128, joined, tail)
        assert got.shape == (rows, n)
        assert torch.equal(got, tiled.tiled_linear(x, weight, bias, 128, 1)), rows


def test_the_prompt_tail_is_padded_to_16_rows_not_128(monkeypatch):
    """Which calls the tiles make (F.linear, a boundary we do not own,
    watched): a 107-row prompt is one call of 112 rows with a 16-row
    tail, of 128 without; 300 rows with joined tiles are 256 + 48."""
    from trioserve.kernels import tiled

    real, calls = tiled.F.linear, []

    def watched(x, weight, bias=None):
        calls.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(tiled.F, "linear", watched)
    weight = torch.randn(32, 64)
    for rows, joined, tail, want in ((107, 1, 16, [112]), (107, 1, 128, [128]), (300, 4, 16, [256, 48]), (300, 4, 128, [384]), (300, 1, 16, [128, 128, 48]), (256, 4, 16, [256]), (20, 4, 16, [32])):
        calls.clear()
        tiled.tiled_linear(torch.randn(rows, 64), weight, None, 128, joined, tail)
        assert calls == want, (rows, joined, tail, calls)


def test_the_prompt_tail_stays_a_whole_tile_where_smaller_calls_round_otherwise(monkeypatch):
    """F.linear (a boundary we do not own) replaced by one that computes
    each row alone, so every call size rounds alike: the check allows the
    16-row tail; the same made to round calls of 48 rows differently: the
    check finds it and keeps the tail a whole tile."""
    from trioserve.kernels import tiled

    real, odd = tiled.F.linear, []

    def row_by_row(x, weight, bias=None):
        out = torch.cat([real(x[i : i + 1], weight, bias) for i in range(x.shape[0])])
        return out * (1 + 2**-7) if x.shape[0] in odd else out

    monkeypatch.setattr(tiled.F, "linear", row_by_row)
    try:
        for rounds_otherwise, want in (([], tiled.ROW_TILE), ([48], tiled.PROMPT_TILE)):
            odd[:] = rounds_otherwise
            tiled.prompt_tail_rows.cache_clear()
            assert tiled.prompt_tail_rows(64, 64, torch.bfloat16, False, torch.get_num_threads()) == want, rounds_otherwise
    finally:
        tiled.prompt_tail_rows.cache_clear()
