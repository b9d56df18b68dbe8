"""16-bit float weights kept as the file stores them (kernels/w16.py): the C
kernel on F16 and BF16 bits against its torch twin, at every
instruction-set level this CPU runs and in the plain C build, each row the
same bits alone and in company, K of any size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels import native, native_build
from trioserve.kernels.cpu import level_fits
from trioserve.kernels.w16 import concat_rows16, pack_w16, parts_from_w16, w16_matmul

LEVELS = ("native", "avx2-vnni", "avx2", "generic")


def _parts(kind: str, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, : min(k, 4)] = [6e-8, -6e-6, 1e-5, 0.0][: min(k, 4)]  # F16 subnormals and a zero
    if kind == "F16":
        return parts_from_w16(w.astype(np.float16), kind)
    return parts_from_w16(torch.from_numpy(w).bfloat16().view(torch.int16).numpy(), kind)


def _levels(monkeypatch) -> list[str]:
    runs = []
    for level in LEVELS:
        if level_fits(level) is None:
            monkeypatch.setenv(CPU_FEATURES_ENV, level)
            if native.w16_supported(16, 1):
                runs.append(level)
    monkeypatch.delenv(CPU_FEATURES_ENV)
    return runs


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_the_bits_are_the_files_and_non_finite_values_are_refused(kind):
    parts = _parts(kind, 32, 100, seed=1)
    assert parts.bits.dtype == torch.int16 and parts.bits.shape == (32, 100)
    assert parts.dequantize()[0, 0].item() == pytest.approx(6e-8 if kind == "F16" else 6e-8, rel=0.1)
    bad = np.full((2, 3), np.inf, dtype=np.float32)
    with pytest.raises(ValueError, match="NaN or infinity"):
        parts_from_w16(bad.astype(np.float16) if kind == "F16" else torch.from_numpy(bad).bfloat16().view(torch.int16).numpy(), kind)


@pytest.mark.parametrize("kind", ["F16", "BF16"])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 16, 576), (7, 80, 100), (33, 96, 257), (129, 48, 33), (5, 360, 64), (2, 9, 16)])
def test_the_kernel_matches_its_twin_with_the_same_bits_at_every_level(kind, rows, n, k, monkeypatch):
    levels = _levels(monkeypatch)
    if not levels:
        pytest.skip("the C kernels do not build here (no C compiler)")
    parts = _parts(kind, n, k, seed=rows)
    pack = pack_w16(parts)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    twin = w16_matmul(parts, x)
    torch.testing.assert_close(twin, x.double().matmul(parts.dequantize().double().t()).float(), rtol=1e-4, atol=1e-4)
    outs = {}
    for level in levels:
        monkeypatch.setenv(CPU_FEATURES_ENV, level)
        outs[level] = [native.w16_matmul(pack, x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
        got = outs[level][0]
        assert (got - twin).abs().max() <= 1e-5 * float(twin.abs().max())  # the kernel fuses the twin's two roundings
        assert torch.equal(outs[level][1], native.w16_matmul(pack, x.bfloat16().float()).bfloat16())  # bf16 out: rounded once
        for r in {0, rows // 2, rows - 1}:  # each row alone is the same bits as in company
            assert torch.equal(native.w16_matmul(pack, x[r : r + 1]), got[r : r + 1])
    first, *others = outs.values()
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_the_pack_and_the_kernel_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="cannot stack F16 and BF16"):
        concat_rows16([_parts("F16", 16, 8, seed=1), _parts("BF16", 16, 8, seed=1)])
    if native_build.library() is None:
        return
    pack = pack_w16(_parts("F16", 32, 64, seed=2))
    with pytest.raises(RuntimeError, match=r"w16_matmul: x \(2, 32\) does not have the weight's 64 inputs"):
        native.w16_matmul(pack, torch.randn(2, 32))
