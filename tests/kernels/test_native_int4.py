"""The C 4-bit projection (kernels/native.py `int4_matmul`) against the
dequantized weights in float64, its batch invariance, its refusals, and
`Projection`'s choice between it and torch's int4 op.

The kernel needs a CPU with AVX-512 BF16 (this machine kind has it); where
the CPU lacks it, the tests that run the kernel are skipped and the one that
checks the fallback runs instead."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.k_quants import quantize_q4_k
from trioserve.kernels import native, native_build, native_pack
from trioserve.kernels.int4 import parts_from_gguf
from trioserve.kernels.projection import Projection

Q = gguf.GGMLQuantizationType


def _available() -> bool:
    lib = native_build.library()
    return lib is not None and bool(lib.trioserve_int4_available())


needs_kernel = pytest.mark.skipif(not _available(), reason="the C int4 kernel needs AVX-512 BF16 and a C compiler")


def _raw(n: int, k: int, qtype, seed: int = 0) -> np.ndarray:
    """A random [n, k] weight with a per-row offset as ``qtype`` blocks (Q4_K
    by the tests' own writer: the gguf package cannot write it)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.1 + rng.uniform(-0.05, 0.05, (n, 1))).astype(np.float32)
    return quantize_q4_k(w) if qtype == Q.Q4_K else gguf.quants.quantize(w, qtype)


def _parts(n: int, k: int, qtype, seed: int = 0):
    return parts_from_gguf(_raw(n, k, qtype, seed), qtype.name)


# (qtype, n, k, rows): Q4_0 and Q4_1 at every shape by 1, 3 and 33 rows;
# then each 4-bit type by 1, 7, 33 and 129 rows on a small weight, K not a
# multiple of 256 (288) where the type allows it (Q4_K: super-blocks of 256).
CASES = [
    *((qtype, n, k, rows) for qtype in (Q.Q4_0, Q.Q4_1) for n, k in ((32, 32), (64, 96), (960, 576), (96, 1536)) for rows in (1, 3, 33)),
    *((qtype, 64, 288, rows) for qtype in (Q.Q4_0, Q.Q4_1) for rows in (1, 7, 33, 129)),
    *((Q.Q4_K, 64, 512, rows) for rows in (1, 7, 33, 129)),
]


@needs_kernel
@pytest.mark.parametrize(("qtype", "n", "k", "rows"), CASES, ids=lambda v: v.name.lower() if isinstance(v, Q) else None)
def test_matches_the_dequantized_weights(qtype, n, k, rows):
    """fp32 out: x (bf16 values) times the file's own dequantized weights,
    up to fp32 summation; bf16 out: that, rounded once to bf16; each row
    the same bits alone as in company."""
    raw = _raw(n, k, qtype, seed=n + k + rows)
    parts = parts_from_gguf(raw, qtype.name)
    if qtype == Q.Q4_K:  # a group's scale and offset rounded to f16 at load: within 2^-11 of each term
        file = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k))
        d, m = parts.scale[..., None].abs(), (parts.zero - 8 * parts.scale)[..., None].abs()
        terms = (parts.q.float().view(n, k // 32, 32) * d + m).view(n, k)
        assert ((parts.dequantize() - file).abs() <= terms * 2**-10 + 1e-9).all()
    else:
        expected = gguf.quants.dequantize(gguf.quants.quantize(parts.dequantize().numpy(), qtype), qtype)
        np.testing.assert_allclose(parts.dequantize().numpy(), expected.reshape(n, k), atol=1e-6, rtol=0)
    pack = native_pack.pack_int4(parts)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    exact = x.double() @ parts.dequantize().double().T
    scale = exact.abs().max()
    y32 = native.int4_matmul(pack, x.float())
    assert y32.dtype == torch.float32 and y32.shape == (rows, n)
    assert (y32.double() - exact).abs().max() <= 1e-5 * scale
    y16 = native.int4_matmul(pack, x)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, y32.to(torch.bfloat16))
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(native.int4_matmul(pack, x[r : r + 1]), y16[r : r + 1])


@needs_kernel
def test_a_row_is_the_same_bits_alone_in_company_and_on_any_thread_split():
    parts = _parts(960, 576, Q.Q4_1, seed=5)
    pack = native_pack.pack_int4(parts)
    crowd = torch.randn(37, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    together = native.int4_matmul(pack, crowd, threads=2)
    assert torch.equal(together, native.int4_matmul(pack, crowd, threads=1))
    for start, size in [(0, 1), (5, 1), (3, 4), (9, 7), (30, 7)]:
        assert torch.equal(native.int4_matmul(pack, crowd[start : start + size]), together[start : start + size])


@needs_kernel
def test_refuses_shapes_it_does_not_take():
    with pytest.raises(ValueError, match="multiples of 32, got 48 x 64"):
        native_pack.pack_int4(_parts(48, 64, Q.Q4_0))
    assert not native.int4_supported(48, 64) and not native.int4_supported(64, 48) and native.int4_supported(64, 64)
    pack = native_pack.pack_int4(_parts(64, 64, Q.Q4_0))
    with pytest.raises(RuntimeError, match=r"x \(2, 32\) does not have the weight's 64 inputs"):
        native.int4_matmul(pack, torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        native.int4_matmul(pack, torch.randn(2, 64).half())


def test_projection_takes_the_kernel_where_it_runs_and_torch_int4_elsewhere(monkeypatch):
    """A 64 x 64 weight goes to the C kernel when it runs here; a 48-row one
    (not a multiple of 32) and any weight with the kernels switched off go to
    torch's int4 op, whose results stay within its bf16 rounding."""
    parts = _parts(64, 64, Q.Q4_1, seed=3)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    exact = x.double() @ parts.dequantize().double().T
    weight = parts.dequantize().to(torch.bfloat16)
    chosen = Projection(weight, None, parts)
    assert (chosen.native is not None) == _available()
    if chosen.native is not None:
        assert torch.equal(chosen.fixed(x, 5), native.int4_matmul(chosen.native, x))
    odd = Projection(_parts(48, 64, Q.Q4_1).dequantize().to(torch.bfloat16), None, _parts(48, 64, Q.Q4_1))
    assert odd.native is None and odd.packed is not None
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    native_build.library_at.cache_clear()
    try:
        off = Projection(weight, None, parts)
    finally:
        monkeypatch.delenv(native_build.DISABLE_ENV)
        native_build.library_at.cache_clear()
    assert off.native is None and off.packed is not None
    for proj in (chosen, off):
        assert (proj.fixed(x, 5).double() - exact).abs().max() <= 0.03 * exact.abs().max()


@needs_kernel
def test_the_tiny_model_decodes_the_same_tokens_through_either_int4_path(tiny_checkpoints, monkeypatch):
    """The tiny Q4_1 model, generated tokens through the C kernels and with
    them off (torch's int4 op and the torch twins): close logits, the same
    greedy picks."""
    from trioserve.models.checkpoint import load_checkpoint
    from trioserve.models.decoder import DecoderModel
    from trioserve.models.step import SeqChunk, build_step

    ckpt = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.bfloat16)
    fast = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, activations="bf16")  # the two bf16-activation paths
    assert all(p.native is not None for p in (fast.layers[0].qkv, fast.layers[0].o, fast.layers[0].gate_up, fast.layers[0].down))
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    native_build.library_at.cache_clear()
    try:
        slow = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, activations="bf16")
    finally:
        monkeypatch.delenv(native_build.DISABLE_ENV)
        native_build.library_at.cache_clear()
    assert slow.layers[0].qkv.native is None and slow.layers[0].qkv.packed is not None
    caches = {m: m.new_kv_cache(4, 4) for m in (fast, slow)}
    prompt = build_step([SeqChunk([5, 9, 33, 7, 2, 8], 0, [0, 1])], 4, fixed=True)
    for m in (fast, slow):
        m.forward(prompt, caches[m])
    for position, token in enumerate([3, 11, 40, 6], start=6):
        step = build_step([SeqChunk([token], position, [0, 1, 2], decode=True)], 4, fixed=True)
        a, b = fast.forward(step, caches[fast]), slow.forward(step, caches[slow])
        assert (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(32, 2), (96, 64), (1024, 576)])
@pytest.mark.parametrize("rows", [1, 9, 33])
def test_the_8_bit_head_matches_its_codes_and_each_row_is_its_own(n, k, rows):
    """`int8_matmul`: x (bf16 values) times the int8 codes, summed in fp32,
    times the scale; the same bits for a row alone, in company and on any
    thread split; and `Int8Rows` takes it."""
    from trioserve.kernels.projection import Int8Rows

    gen = torch.Generator().manual_seed(n + rows)
    head = Int8Rows(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen))
    assert head.native is not None
    crowd = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    x = crowd[:rows]
    exact = (x.double() @ head.q.double().T) * head.scale.double()
    for inputs in (x, x.float()):
        out = native.int8_matmul(head.native, inputs)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        assert ((out.double() - exact).abs() <= 1e-5 * exact.abs().max()).all()
    together = native.int8_matmul(head.native, crowd, threads=2)
    assert torch.equal(together, native.int8_matmul(head.native, crowd, threads=1))
    assert torch.equal(head(x), together[:rows])
    assert torch.equal(native.int8_matmul(head.native, crowd[rows : rows + 1])[0], together[rows])


@needs_kernel
def test_the_8_bit_head_refuses_shapes_it_does_not_take():
    q, scale = torch.zeros(48, 8, dtype=torch.int8), torch.ones(48)
    with pytest.raises(ValueError, match="multiple of 32 outputs and an even number of inputs, got 48 x 8"):
        native_pack.pack_int8(q, scale)
    assert not native.int8_supported(48, 8) and not native.int8_supported(64, 7) and native.int8_supported(64, 8)
    pack = native_pack.pack_int8(torch.zeros(64, 8, dtype=torch.int8), torch.ones(64))
    with pytest.raises(RuntimeError, match=r"x \(1, 6\) does not have the weight's 8 inputs"):
        native.int8_matmul(pack, torch.randn(1, 6))
