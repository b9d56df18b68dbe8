"""Codes of up to 6 bits in groups of 16 (kernels/int6.py): what Q6_K,
Q5_K, Q5_0 and Q5_1 tensors become at load, and the C kernel on them with
int8 activations, against its torch twin, at every instruction-set level
this CPU runs, each row the same bits alone and in company."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels import native
from trioserve.kernels.cpu import level_fits
from trioserve.kernels.int6 import int6_q8_matmul, pack_int6_q8, parts_from_gguf6

Q = gguf.GGMLQuantizationType
LEVELS = ("native", "avx2-vnni", "avx2")


def _raw(qtype: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Rows of ``qtype``: Q5_0/Q5_1 quantized by the gguf package from
    random weights; the K-quants (which it cannot write) as random blocks
    with small, sane f16 scales, which it reads."""
    rng = np.random.default_rng(seed)
    if qtype in ("Q5_0", "Q5_1"):
        w = (rng.standard_normal((rows, k)) * 0.05 + rng.uniform(-0.02, 0.02, (rows, 1))).astype(np.float32)
        return gguf.quants.quantize(w, Q[qtype])
    size, at = {"Q6_K": (210, (208,)), "Q5_K": (176, (0, 2))}[qtype]
    raw = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    for offset in at:
        raw[..., offset : offset + 2] = (rng.random((rows, k // 256)) * 1e-3).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q5_0", "Q5_1"])
def test_the_codes_are_the_files_and_the_scales_its_within_f16(qtype):
    raw = _raw(qtype, 32, 512, seed=1)
    parts = parts_from_gguf6(raw, qtype)
    file = torch.from_numpy(gguf.quants.dequantize(raw, Q[qtype]).reshape(32, 512))
    assert parts.u.shape == (32, 512) and int(parts.u.max()) <= 63 and parts.d.shape == (32, 32)
    if qtype in ("Q5_0", "Q5_1"):  # their d and m are f16 in the file: exact
        assert torch.equal(parts.dequantize(), file)
    else:  # a group's d and m rounded to f16: within 2^-11 of each term
        terms = (parts.u.float().view(32, 32, 16) * parts.d[..., None].abs()).view(32, 512) + parts.m.abs().repeat_interleave(16, dim=1)
        assert ((parts.dequantize() - file).abs() <= terms * 2**-10 + 1e-9).all()


def _levels(monkeypatch) -> list[str]:
    runs = []
    for level in LEVELS:
        if level_fits(level) is None:
            monkeypatch.setenv(CPU_FEATURES_ENV, level)
            if native.int6_q8_supported(16, 32):
                runs.append(level)
    monkeypatch.delenv(CPU_FEATURES_ENV)
    return runs


# (qtype, k): every type at K = 512; Q5_0 and Q5_1 (blocks of 32, no
# super-blocks) also at a K that is not a multiple of 256: 288 (nine
# blocks), and 96 (three, less than one super-block).
TYPE_WIDTHS = [("Q6_K", 512), ("Q5_K", 512), ("Q5_0", 512), ("Q5_1", 512), ("Q5_0", 288), ("Q5_1", 96)]


@pytest.mark.parametrize(("qtype", "k"), TYPE_WIDTHS)
@pytest.mark.parametrize(("rows", "n"), [(1, 16), (7, 80), (33, 96), (129, 48)])
def test_the_kernel_matches_its_twin_with_the_same_bits_at_every_level(qtype, k, rows, n, monkeypatch):
    levels = _levels(monkeypatch)
    if not levels:
        pytest.skip("no 6-bit kernel here (no AVX2 or AVX-512 VNNI, or no C compiler)")
    parts = parts_from_gguf6(_raw(qtype, n, k, seed=rows), qtype)
    pack = pack_int6_q8(parts)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen) * 3
    x[:, 5] *= 40  # an outlier channel
    twin = int6_q8_matmul(parts, x)
    outs = {}
    for level in levels:
        monkeypatch.setenv(CPU_FEATURES_ENV, level)
        outs[level] = [native.int6_q8_matmul(pack, x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
        got = outs[level][0]
        assert (got - twin).abs().max() <= 1e-6 * twin.abs().max()  # the kernel fuses the twin's two roundings
        for r in {0, rows // 2, rows - 1}:  # each row alone is the same bits as in company
            assert torch.equal(native.int6_q8_matmul(pack, x[r : r + 1]), got[r : r + 1])
    first, *others = outs.values()
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q5_1"])
def test_the_pack_holds_6_bits_a_code_and_d_alone_for_a_symmetric_weight(qtype, monkeypatch):
    """The codes take 6 bits each (384 bytes a tile of 16 outputs and block of
    32 inputs) and unpack to the parts' codes; Q6_K (m = -32 d) keeps d alone,
    and the kernel gives the same bits from that pack as from one that keeps
    m too (m = -32 d made in a register is exact)."""
    parts = parts_from_gguf6(_raw(qtype, 48, 512, seed=9), qtype)
    pack = pack_int6_q8(parts)
    n, k = parts.u.shape
    assert pack.packed.numel() == n * k * 3 // 4
    assert pack.symmetric == (qtype == "Q6_K")
    assert pack.scales.numel() == (1 if pack.symmetric else 2) * n * k // 16
    planes = pack.packed.numpy().reshape(-1, 2, 3, 16, 4)  # (group, block, tile), half, plane, column, e
    u = np.empty((planes.shape[0], 2, 4, 16, 4), np.uint8)
    u[:, :, 0] = (planes[:, :, 0] & 15) | ((planes[:, :, 2] & 3) << 4)
    u[:, :, 1] = (planes[:, :, 0] >> 4) | (((planes[:, :, 2] >> 2) & 3) << 4)
    u[:, :, 2] = (planes[:, :, 1] & 15) | (((planes[:, :, 2] >> 4) & 3) << 4)
    u[:, :, 3] = (planes[:, :, 1] >> 4) | ((planes[:, :, 2] >> 6) << 4)
    # Tile groups of three (48 outputs: one group), block by block, tile by tile.
    codes = u.reshape(k // 32, 3, 2, 4, 16, 4).transpose(1, 4, 0, 2, 3, 5).reshape(n, k)
    assert np.array_equal(codes, parts.u.numpy())
    if qtype != "Q6_K":
        with pytest.raises(ValueError, match="needs m = -32 d"):
            pack_int6_q8(parts, symmetric=True)
        return
    levels = _levels(monkeypatch)
    if not levels:
        pytest.skip("no 6-bit kernel here (no AVX2 or AVX-512 VNNI, or no C compiler)")
    wide = pack_int6_q8(parts, symmetric=False)
    assert not wide.symmetric and wide.scales.numel() == 2 * n * k // 16
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3)) * 3
    for level in levels:
        monkeypatch.setenv(CPU_FEATURES_ENV, level)
        assert torch.equal(native.int6_q8_matmul(pack, x), native.int6_q8_matmul(wide, x)), level


def test_the_pack_and_the_kernel_refuse_what_they_cannot_take():
    parts = parts_from_gguf6(_raw("Q5_0", 24, 64, seed=2), "Q5_0")
    with pytest.raises(ValueError, match="multiple of 16 outputs and 32 inputs, got 24 x 64"):
        pack_int6_q8(parts)
    if not native.int6_q8_supported(16, 32):
        return
    pack = pack_int6_q8(parts_from_gguf6(_raw("Q5_0", 32, 64, seed=2), "Q5_0"))
    with pytest.raises(RuntimeError, match=r"int6_q8_matmul: x \(2, 32\) does not have the weight's 64 inputs"):
        native.int6_q8_matmul(pack, torch.randn(2, 32))


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q5_1"])
def test_codes_made_a_slice_at_a_time_are_the_codes_made_whole(monkeypatch, qtype):
    from trioserve.kernels import int6

    raw = _raw(qtype, 96, 512, seed=3)
    whole = parts_from_gguf6(raw, qtype)
    monkeypatch.setattr(int6, "_ROWS_AT_ONCE", 7 * 512)  # slices of 7 rows: the last one short
    sliced = parts_from_gguf6(raw, qtype)
    for a, b in ((whole.u, sliced.u), (whole.d, sliced.d), (whole.m, sliced.m)):
        assert torch.equal(a, b)
    pack_whole = pack_int6_q8(whole)
    monkeypatch.setattr(int6, "_ROWS_AT_ONCE", 48 * 512)  # one group of tiles a slice
    pack_sliced = pack_int6_q8(whole)
    assert torch.equal(pack_whole.packed, pack_sliced.packed) and torch.equal(pack_whole.scales, pack_sliced.scales)


def test_reading_a_large_6_bit_head_passes_through_little_memory():
    """A 6-bit head (Q6_K, as Q4_K_M files keep theirs) was read whole in
    float: ~20 bytes a weight passed through, ~2 GB at 49,152 x 2,048, the
    load's peak. Now a slice at a time: the codes, their scales and a few MB."""
    import tracemalloc

    rows, k = 8192, 2048
    raw = _raw("Q6_K", rows, k, seed=4)
    tracemalloc.start()
    try:
        parts = parts_from_gguf6(raw, "Q6_K")
        pack = pack_int6_q8(parts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kept = rows * k * (1 + 2 * 4 / 16)  # u, d and m
    assert pack.packed.numel() == rows * k * 3 // 4
    # Whole, this was ~20 bytes a weight (320 MB here); sliced it is what is kept, the pack, and ~25 MB passing.
    assert peak <= kept + rows * k * 0.9 + (32 << 20), (peak / 2**20, kept / 2**20)
