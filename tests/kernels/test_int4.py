"""4-bit weights taken straight from GGUF Q4_0/Q4_1 blocks: the codes,
scales and zeros must reproduce the file's own dequantization, survive the
Q/K row un-permutation, and the int4 matmul must agree with the bf16 one."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from trioserve.kernels.int4 import Projection, concat_rows, parts_from_gguf
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.llama import LlamaModel
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
    assert sorted(ckpt.int4) == sorted(matrices)
    for name in matrices:
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


def test_float32_projection_never_packs():
    rng = np.random.default_rng(0)
    parts = parts_from_gguf(gguf.quants.quantize(rng.standard_normal((8, 32)).astype(np.float32), Q.Q4_0), "Q4_0")
    assert Projection(parts.dequantize(), None, parts).packed is None


def test_bf16_model_with_int4_weights_matches_without(tiny_checkpoints):
    """The int4 path is a faster way to multiply by the same weights: the
    logits of a decode-sized step agree with the bf16-only model's."""
    ckpt = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.bfloat16)
    with_int4 = LlamaModel.from_checkpoint(ckpt)
    without = LlamaModel.from_checkpoint(ckpt, use_int4=False)
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
