"""Q4_K, the type most downloaded GGUF files (Q4_K_M) store most tensors
in: its codes run on the 4-bit kernels, and Q5_0/Q5_1's on the 6-bit one
(kernels/int6.py), never dequantized to a dense copy;
a file whose fused projections mix types (q and k in Q4_K, v in another)
runs each part its own way; the logits and greedy picks agree with the
float32 model of the dequantized weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.k_quants import quantize_q4_k, quantize_q5_k, quantize_q6_k
from tests.tiny_model import TINY, tiny_weights, write_gguf
from tests.tiny_tokenizer import train_tiny_tokenizer
from trioserve.kernels import native
from trioserve.kernels.int4 import parts_from_gguf
from trioserve.kernels.projection import Projection, StackedProjection
from trioserve.kernels.int6 import Int6Pack, Int6Parts, parts_from_gguf6
from trioserve.kernels.int8w import Int8CodesPack, Int8Parts
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step

Q = gguf.GGMLQuantizationType
# K-quants work in super-blocks of 256 inputs: hidden and FFN sizes are multiples of it.
SHAPE = {**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_the_writer_and_the_loaders_codes_are_the_files():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 512)) * 0.05 + rng.uniform(-0.02, 0.02, (8, 1))).astype(np.float32)
    raw = quantize_q4_k(w)
    assert raw.shape == (8, 2 * 144)
    file = gguf.quants.dequantize(raw, Q.Q4_K).reshape(8, 512)
    step = (w.reshape(8, 2, 8, 32).max(-1) - np.minimum(w.reshape(8, 2, 8, 32).min(-1), 0)) / 15
    assert (np.abs(file - w).reshape(8, 2, 8, 32) <= step[..., None] * 0.5 * 1.2 + 1e-4).all()  # half a step, plus the 6-bit scales
    parts = parts_from_gguf(raw, "Q4_K")
    assert parts.q.shape == (8, 512) and parts.scale.shape == (8, 16) and int(parts.q.max()) <= 15
    # The group scale and offset are rounded to f16 (the 4-bit kernels' form): within 2^-11 of each term.
    terms = (parts.q.float().view(8, 16, 32) * parts.scale[..., None].abs()).view(8, 512)
    terms = terms + (parts.zero - 8 * parts.scale).abs().repeat_interleave(32, dim=1)
    assert ((parts.dequantize() - torch.from_numpy(file)).abs() <= terms * 2**-10 + 1e-7).all()



@pytest.mark.parametrize("qtype", ["Q5_K", "Q6_K"])
def test_the_q5_k_and_q6_k_writers_bytes_are_what_the_gguf_package_and_the_loader_read(qtype):
    """The writers' bytes, read by the gguf package, give back the weights to
    within half a step of their groups (a code, scale or bit in the wrong
    place is off by many steps); the loader's 6-bit codes of the same bytes
    decode to the package's values (the group scales rounded to f16)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((8, 512)) * 0.05 + rng.uniform(-0.02, 0.02, (8, 1))).astype(np.float32)
    w[3, 300] = 0.6  # an outlier: its group's scale, and the super-block's d, much larger than the rest
    raw = {"Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}[qtype](w)
    assert raw.shape == (8, 2 * {"Q5_K": 176, "Q6_K": 210}[qtype])
    file = gguf.quants.dequantize(raw, Q[qtype]).reshape(8, 512)
    if qtype == "Q5_K":  # groups of 32, codes 0..31 from the group's minimum (or 0)
        g = w.reshape(8, 2, 8, 32)
        step = (g.max(-1) - np.minimum(g.min(-1), 0)) / 31
    else:  # groups of 16, codes -32..31 times the group's scale
        g = w.reshape(8, 2, 16, 16)
        step = np.abs(g).max(-1) / 31
    err = np.abs(file - w).reshape(g.shape)
    assert (err <= step[..., None] * 0.5 * 1.2 + 1e-4).all(), (err / step[..., None]).max()  # half a step, plus the scales' rounding
    parts = parts_from_gguf6(raw, qtype)
    assert parts.u.shape == (8, 512) and int(parts.u.max()) == (31 if qtype == "Q5_K" else 63)  # the codes' whole range is used
    terms = (parts.u.float().view(8, 32, 16) * parts.d[..., None].abs()).view(8, 512) + parts.m.abs().repeat_interleave(16, dim=1)
    assert ((parts.dequantize() - torch.from_numpy(file)).abs() <= terms * 2**-10 + 1e-9).all()


def _mixed(name: str) -> Q:
    """A Q4_K_M-like choice: most matrices Q4_K; v in Q5_1 and down in Q5_0
    (where llama-quantize puts Q6_K: 5-6-bit codes, kernels/int6.py); o in
    Q8_0 (signed 8-bit codes, kernels/int8w.py); the embedding and head Q8_0."""
    if name.endswith("v_proj.weight"):
        return Q.Q5_1
    if name.endswith("down_proj.weight"):
        return Q.Q5_0
    if name.endswith(("o_proj.weight", "embed_tokens.weight", "lm_head.weight")):
        return Q.Q8_0
    return Q.Q4_K


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    tokenizer = train_tiny_tokenizer()
    weights = tiny_weights(tokenizer.get_vocab_size(), seed=3, shape=SHAPE)
    path = tmp_path_factory.mktemp("kq") / "tiny-q4_k_m.gguf"
    return write_gguf(path, weights, tokenizer, shape=SHAPE, qtype_of=_mixed)


def test_q4_k_tensors_load_as_codes_and_are_never_held_dense(mixed_gguf):
    ckpt = load_checkpoint(mixed_gguf)
    a = "model.layers.0.self_attn."
    assert set(ckpt.int4) == {
        f"model.layers.{i}.{n}" for i in range(2)
        for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")
    }  # fmt: skip
    assert set(ckpt.int6) == {f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.v_proj.weight", "mlp.down_proj.weight")}
    assert not ckpt.weights.is_held(a + "q_proj.weight") and not ckpt.weights.is_held(a + "v_proj.weight")
    # The head (Q8_0 here) as its codes too, for the model's head on the codes kernel.
    assert set(ckpt.int8) == {f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)} | {"lm_head.weight"}
    assert not ckpt.weights.is_held(a + "o_proj.weight")  # Q8_0: its codes, dense only when asked for
    assert not ckpt.weights.is_held("lm_head.weight")
    o = next(t for t in gguf.GGUFReader(str(mixed_gguf)).tensors if t.name == "blk.0.attn_output.weight")
    want_o = gguf.quants.dequantize(o.data, o.tensor_type).reshape(256, 256)
    assert torch.equal(ckpt.int8[a + "o_proj.weight"].dequantize(), torch.from_numpy(want_o))  # the file's values exactly
    # Asked for, a dense weight is the file's values, as the gguf package dequantizes them (rows unpermuted).
    reader = gguf.GGUFReader(str(mixed_gguf))
    gate = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate.weight")
    want = gguf.quants.dequantize(gate.data, gate.tensor_type).reshape(512, 256)
    assert torch.equal(ckpt.weights["model.layers.0.mlp.gate_proj.weight"], torch.from_numpy(want))
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    want = gguf.quants.dequantize(down.data, down.tensor_type).reshape(256, 512)
    assert torch.equal(ckpt.weights["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(want))
    # The 5-bit codes are the file's: the parts give its values exactly (Q5_0's d and m are f16 already).
    assert torch.equal(ckpt.int6["model.layers.0.mlp.down_proj.weight"].dequantize(), torch.from_numpy(want))


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_a_mixed_type_model_runs_its_codes_and_agrees_with_float32(mixed_gguf, kernels):
    """With int8 activations (the C kernel where it runs, or its torch twin)
    the Q4_K, 5-bit and Q8_0 parts run on their codes, side by side; logits within the 8-bit rounding's reach of the float32 model of
    the dequantized weights, and the same greedy tokens."""
    if kernels == "auto" and not native.int4_q8_supported(16, 32):  # the model would refuse int8 activations
        pytest.skip("no int8-activation C kernel here (no C compiler, or no AVX2 / AVX-512 VNNI / NEON dotprod)")
    ckpt = load_checkpoint(mixed_gguf, dtype=torch.float32)
    fast = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, kernels=kernels, activations="int8")
    exact = DecoderModel.from_checkpoint(ckpt, use_int4=False, batch_invariant=True, kernels="reference", activations="bf16")
    layer = fast.layers[0]
    assert isinstance(layer.qkv, StackedProjection) and [p.every_row_8bit for p in layer.qkv.parts] == [True, True]
    assert isinstance(layer.qkv.parts[1].q8_twin if kernels == "reference" else layer.qkv.parts[1].native, (Int6Parts, Int6Pack))
    assert isinstance(layer.gate_up, Projection) and layer.gate_up.every_row_8bit and layer.down.every_row_8bit
    assert layer.gate_up.weight.is_meta and layer.down.weight.is_meta  # no dense copy kept
    assert layer.o.every_row_8bit and layer.o.weight.is_meta and fast.head_int8 is None and fast.head_codes.kind == "8-bit"  # the file's Q8_0 head
    assert isinstance(layer.o.q8_twin if kernels == "reference" else layer.o.native, (Int8Parts, Int8CodesPack))
    # Teacher-forced on the float32 model's greedy tokens: at every step the
    # logits lie within 5% of the largest (2.5% measured), and the codes pick
    # float32's token at all but its near ties (one step here, where its top
    # two logits lie 5e-5 of the largest apart).
    caches = {m: m.new_kv_cache(8, 4) for m in (fast, exact)}
    step = build_step([SeqChunk([5, 9, 33, 7, 2, 8, 11, 4], 0, [0, 1])], 4, fixed=True)
    same = 0
    for pos in range(8, 16):
        a, b = fast.forward(step, caches[fast])[-1], exact.forward(step, caches[exact])[-1]
        assert (a - b).abs().max() <= 0.05 * b.abs().max(), pos
        same += int(a.argmax()) == int(b.argmax())
        step = build_step([SeqChunk([int(b.argmax())], pos, [0, 1, 2, 3], decode=True)], 4, fixed=True)
    assert same >= 7, f"the codes chose float32's token at {same} of 8 steps"
