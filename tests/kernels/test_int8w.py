"""Signed 8-bit codes with a scale per block of 32 (kernels/int8w.py): what
Q8_0 tensors become at load, and the C kernel on them with int8
activations, against its torch twin, at every instruction-set level this
CPU runs, each row the same bits alone and in company."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels import native
from trioserve.kernels.cpu import level_fits
from trioserve.kernels.int8w import int8_q8_matmul, pack_int8_q8, parts_from_q8_0

Q = gguf.GGMLQuantizationType
LEVELS = ("native", "avx2-vnni", "avx2")


def _raw(rows: int, k: int, seed: int, *, extreme: bool = False) -> np.ndarray:
    """Rows quantized to Q8_0 by the gguf package; ``extreme``: then every
    code set to -128 or 127 in some blocks, the most a pair of products can
    sum to (the AVX2 build's `vpmaddubsw` must not saturate)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, k)) * 0.05 + rng.uniform(-0.02, 0.02, (rows, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q8_0)
    if extreme:
        blocks = raw.reshape(rows, -1, 34)
        blocks[:, ::3, 2:] = np.where(rng.random((rows, blocks[:, ::3].shape[1], 32)) < 0.5, -128, 127).astype(np.int8).view(np.uint8)
    return raw


def test_the_codes_and_scales_are_the_files_exactly():
    raw = _raw(32, 512, seed=1)
    parts = parts_from_q8_0(raw)
    file = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0).reshape(32, 512))
    assert parts.c.dtype == torch.int8 and parts.c.shape == (32, 512) and parts.d.shape == (32, 16)
    assert torch.equal(parts.dequantize(), file)
    # the pack is the file's size: a byte a code and two a block
    pack = pack_int8_q8(parts)
    assert pack.packed.numel() + 2 * pack.scales.numel() == raw.size


def _levels(monkeypatch) -> list[str]:
    runs = []
    for level in LEVELS:
        if level_fits(level) is None:
            monkeypatch.setenv(CPU_FEATURES_ENV, level)
            if native.int8_q8_supported(16, 32):
                runs.append(level)
    monkeypatch.delenv(CPU_FEATURES_ENV)
    return runs


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 16, 512), (7, 80, 96), (33, 96, 512), (129, 48, 160)])
def test_the_kernel_matches_its_twin_with_the_same_bits_at_every_level(rows, n, k, extreme, monkeypatch):
    levels = _levels(monkeypatch)
    if not levels:
        pytest.skip("no 8-bit code kernel here (no AVX2 or AVX-512 VNNI, or no C compiler)")
    parts = parts_from_q8_0(_raw(n, k, seed=rows, extreme=extreme))
    pack = pack_int8_q8(parts)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen) * 3
    x[:, 5] *= 40  # an outlier channel
    twin = int8_q8_matmul(parts, x)
    # the twin itself: near the file's weights times x
    torch.testing.assert_close(twin, x @ parts.dequantize().t(), rtol=0.02, atol=0.02 * float(twin.abs().max()))
    outs = {}
    for level in levels:
        monkeypatch.setenv(CPU_FEATURES_ENV, level)
        outs[level] = [native.int8_q8_matmul(pack, x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
        got = outs[level][0]
        assert (got - twin).abs().max() <= 1e-6 * twin.abs().max()  # the kernel fuses the twin's two roundings
        for r in {0, rows // 2, rows - 1}:  # each row alone is the same bits as in company
            assert torch.equal(native.int8_q8_matmul(pack, x[r : r + 1]), got[r : r + 1])
    first, *others = outs.values()
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_the_pack_and_the_kernel_refuse_what_they_cannot_take():
    parts = parts_from_q8_0(_raw(24, 64, seed=2))
    with pytest.raises(ValueError, match="multiple of 16 outputs and 32 inputs, got 24 x 64"):
        pack_int8_q8(parts)
    if not native.int8_q8_supported(16, 32):
        return
    pack = pack_int8_q8(parts_from_q8_0(_raw(32, 64, seed=2)))
    with pytest.raises(RuntimeError, match=r"int8_q8_matmul: x \(2, 32\) does not have the weight's 64 inputs"):
        native.int8_q8_matmul(pack, torch.randn(2, 32))
