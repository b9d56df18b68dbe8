"""Weights of up to 6-bit codes in groups of 16 (GGUF's Q6_K, Q5_K, Q5_0 and
Q5_1): their codes, how they are made from a file's blocks, the C
kernel's layout, and the kernel's torch twin.

A group of 16 inputs holds w = d u + m, u in 0..63, d and m f16 values:
- Q6_K: u = q + 32 (q the 6-bit signed code), d = f16(d_super * scale_16), m = -32 d;
- Q5_K: u the 5-bit code, d = f16(d_super * scale_32), m = f16(-dmin * min_32);
- Q5_0: u the code, d the block's, m = -16 d (exact); Q5_1: d and m the block's.
The codes are the file's, read from its blocks' bits; a K-quant's group scale and offset are rounded to f16 (within
2^-11 of each: far inside the codes' own error), as for Q4_K
(kernels/int4.py). The kernel (`native.int6_q8_matmul`) takes inputs in
8-bit blocks of 32, as the 4-bit one with `--activations int8` does."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from trioserve.kernels.layout import BlockRows, grouped
from trioserve.kernels.reference import q8_blocks

INT6_TYPES = ("Q6_K", "Q5_K", "Q5_0", "Q5_1")
GROUP = 16
TILE_GROUPS = 3  # tiles of 16 outputs per group in the kernel's layout (I6_TILES in the C source)
_BYTES = {"Q6_K": 210, "Q5_K": 176, "Q5_0": 22, "Q5_1": 24}
_WEIGHTS = {"Q6_K": 256, "Q5_K": 256, "Q5_0": 32, "Q5_1": 32}
_ROWS_AT_ONCE = 1 << 20  # weights a slice of `parts_from_gguf6` and `pack_int6_q8` works on


@attrs.frozen
class Int6Parts:
    """u [N, K] uint8 in 0..63; d, m [N, K / 16] fp32 holding f16 values."""

    u: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.u.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.u.shape
        return (self.u.float().view(n, k // GROUP, GROUP) * self.d[..., None] + self.m[..., None]).view(n, k)

    def take_rows(self, order: np.ndarray) -> Int6Parts:
        index = torch.from_numpy(np.ascontiguousarray(order))
        return Int6Parts(self.u[index], self.d[index], self.m[index])


class Int6Rows(BlockRows):
    """A weight of up to 6-bit codes still in its GGUF blocks
    (`layout.BlockRows`): laid out for the kernel straight from them
    (`pack_int6_q8`, by `native_pack.pack_int6_q8_rows`), read as `Int6Parts`
    (``u``, ``d``, ``m``, unpacked once when first asked for) everywhere else."""

    TYPES = {name: (_BYTES[name], _WEIGHTS[name]) for name in INT6_TYPES}
    _unpack = staticmethod(lambda raw, qtype: parts_from_gguf6(raw, qtype))
    _cat = staticmethod(lambda parts: _cat_parts6(parts))
    u = property(lambda self: self.parts().u)
    d = property(lambda self: self.parts().d)
    m = property(lambda self: self.parts().m)


def _cat_parts6(parts: list[Int6Parts]) -> Int6Parts:
    return Int6Parts(torch.cat([p.u for p in parts]), torch.cat([p.d for p in parts]), torch.cat([p.m for p in parts]))


def concat_rows6(parts: list[Int6Parts | Int6Rows]) -> Int6Parts | Int6Rows:
    """One weight of ``parts``' rows, one after the other (`BlockRows.concat`)."""
    return Int6Rows.concat(parts)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def _k_scales(header: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins of Q4_K/Q5_K super-blocks' 8 groups of 32 (12 bytes each)."""
    sc = header.astype(np.int32)
    scale = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1)
    return scale, mins


def parts_from_gguf6(raw: np.ndarray, qtype_name: str) -> Int6Parts:
    """Rows of a Q6_K, Q5_K, Q5_0 or Q5_1 tensor ([N, blocks * bytes] uint8)
    as codes and per-16 scales and offsets (the module's docstring). Made
    a slice of rows at a time (`_ROWS_AT_ONCE` weights), so that the
    temporaries stay small."""
    raw = np.asarray(raw)
    rows = raw.shape[0]
    k = raw.shape[1] // _BYTES[qtype_name] * _WEIGHTS[qtype_name]
    u = np.empty((rows, k), dtype=np.uint8)
    d = np.empty((rows, k // GROUP), dtype=np.float32)
    m = np.empty((rows, k // GROUP), dtype=np.float32)
    step = max(1, _ROWS_AT_ONCE // max(k, 1))
    for r0 in range(0, rows, step):
        at = slice(r0, min(rows, r0 + step))
        u[at], d[at], m[at] = _codes6(raw[at], qtype_name)
    return Int6Parts(torch.from_numpy(u), torch.from_numpy(d), torch.from_numpy(m))


def _codes6(raw: np.ndarray, qtype_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`parts_from_gguf6` for one slice of rows: u [rows, K] uint8, d and m
    [rows, K / 16]. The codes are read from the blocks' bits (a group whose
    scale is 0 gets codes 0, as a code there means nothing)."""
    from trioserve.kernels.native_pack import unpack_codes6  # lazily: native_pack's neighbours import this module

    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _BYTES[qtype_name])
    k = blocks.shape[1] * _WEIGHTS[qtype_name]
    codes = unpack_codes6(raw, qtype_name)  # the C library's, in one pass; else numpy's, below
    half = lambda a, at: a[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if qtype_name == "Q6_K":
        scale = half(blocks, 208)[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)  # [rows, supers, 16]
        exact_d, exact_m = scale, -32.0 * scale
        u = _q6_k_codes(blocks) if codes is None else codes
    elif qtype_name == "Q5_K":
        sc, mins = _k_scales(blocks[..., 4:16])
        d32 = half(blocks, 0)[..., None] * sc
        m32 = -half(blocks, 2)[..., None] * mins
        exact_d, exact_m = np.repeat(d32, 2, axis=-1), np.repeat(m32, 2, axis=-1)
        u = _q5_k_codes(blocks) if codes is None else codes
    else:
        d32 = half(blocks, 0)
        m32 = half(blocks, 2) if qtype_name == "Q5_1" else -16.0 * d32
        exact_d, exact_m = np.repeat(d32[..., None], 2, axis=-1), np.repeat(m32[..., None], 2, axis=-1)
        u = _q5_codes(blocks, 4 if qtype_name == "Q5_1" else 2) if codes is None else codes
    exact_d = exact_d.reshape(rows, k // GROUP)
    exact_m = exact_m.reshape(rows, k // GROUP)
    u = u.reshape(rows, k // GROUP, GROUP)
    if not exact_d.all():
        u = np.where(exact_d[..., None] != 0, u, 0).astype(np.uint8)
    return u.reshape(rows, k), _f16(exact_d), _f16(exact_m)


def _q6_k_codes(blocks: np.ndarray) -> np.ndarray:
    """Q6_K's 6-bit codes (q + 32), [rows, supers, 256], from 128 bytes of low
    nibbles and 64 of 2-bit high parts. Each half of 128 weights reads 64
    nibble bytes (a: bytes 0-31, b: 32-63) and 32 high bytes h: its four
    runs of 32 are a's low nibbles over h's bits 0-1, b's low over bits
    2-3, a's high over 4-5, b's high over 6-7."""
    rows, supers = blocks.shape[:2]
    low = blocks[..., 0:128].reshape(rows, supers, 2, 2, 32)  # half, (a, b), byte
    high = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    nibbles = np.stack([low & 15, low >> 4], axis=3)  # half, (low, high nibble), (a, b), byte
    shifts = np.array([[0, 2], [4, 6]], dtype=np.uint8).reshape(1, 1, 1, 2, 2, 1)
    tops = (high[:, :, :, None] >> shifts) & 3
    return (nibbles | (tops << 4)).reshape(rows, supers, 256)


def _q5_k_codes(blocks: np.ndarray) -> np.ndarray:
    """Q5_K's 5-bit codes, [rows, supers, 256]: chunk j of 64 weights is the
    low nibbles of nibble bytes 32 j .. 32 j + 31 over bit 2 j of the 32
    high-bit bytes, then their high nibbles over bit 2 j + 1."""
    rows, supers = blocks.shape[:2]
    high = blocks[..., 16:48].reshape(rows, supers, 1, 1, 32)
    nibbles = blocks[..., 48:176].reshape(rows, supers, 4, 1, 32)
    nibbles = np.concatenate([nibbles & 15, nibbles >> 4], axis=3)  # chunk, (low, high), byte
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 1, 4, 2, 1)
    return (nibbles | (((high >> shifts) & 1) << 4)).reshape(rows, supers, 256)


def _q5_codes(blocks: np.ndarray, header: int) -> np.ndarray:
    """Q5_0's or Q5_1's 5-bit codes, [rows, blocks, 32]: ``header`` bytes of
    f16 fields, a 32-bit word whose bit j is code j's fifth bit, then 16
    bytes whose low nibbles are codes 0-15 and high nibbles 16-31."""
    word = np.ascontiguousarray(blocks[..., header : header + 4]).view("<u4")  # [rows, blocks, 1]
    nibbles = blocks[..., header + 4 :]
    fifth = ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.concatenate([nibbles & 15, nibbles >> 4], axis=-1) | (fifth << 4)


@attrs.frozen
class Int6Pack:
    """A weight in `int6_q8_matmul`'s layout (drawn in the C source): codes
    6 bits each; ``symmetric`` (Q6_K: m = -32 d in every group) keeps d
    alone among the scales."""

    packed: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    symmetric: bool = False


def pack_int6_q8(parts: Int6Parts | Int6Rows, *, symmetric: bool | None = None) -> Int6Pack:
    """``parts`` in the kernel's layout; ``symmetric``: whether to keep d
    alone (default: where m = -32 d in every group; False keeps m as well).
    A weight still in its file's blocks is laid out from them by the C
    library where it is loaded (the same bytes), else unpacked first."""
    if isinstance(parts, Int6Rows):
        from trioserve.kernels.native_pack import pack_int6_q8_rows  # native_pack imports this module's neighbours; lazily

        packed = pack_int6_q8_rows(parts, symmetric)
        if packed is not None:
            return packed
        parts = parts.parts()
    u = parts.u.numpy()
    n, k = u.shape
    if n % 16 or k % 32:
        raise ValueError(f"int6_q8_matmul takes weights of a multiple of 16 outputs and 32 inputs, got {n} x {k}")
    d, m = parts.d.numpy(), parts.m.numpy()
    exact = bool(np.array_equal(m, np.float32(-32.0) * d))
    if symmetric and not exact:
        raise ValueError("a symmetric 6-bit pack needs m = -32 d in every group")
    symmetric = exact if symmetric is None else symmetric
    # Whole groups of tiles a slice, so that the passing copies stay small.
    step = 16 * TILE_GROUPS * max(1, _ROWS_AT_ONCE // (16 * TILE_GROUPS * k))
    # Each slice's bytes and scales follow the last one's, written in place.
    from trioserve.kernels.native_pack import grouped_codes  # native_pack imports this module's neighbours; lazily

    packed = grouped_codes(u, 6, TILE_GROUPS)  # the C packer, in one pass; else numpy, by slices
    by_slices = packed is None
    if by_slices:
        packed = np.empty(n * k * 3 // 4, dtype=np.uint8)
    scales = np.empty(n * k // GROUP * (1 if symmetric else 2), dtype=np.float16)
    at_bytes = at_scales = 0
    for r0 in range(0, n, step):
        if by_slices:
            piece = _planes6(u[r0 : r0 + step])
            packed[at_bytes : at_bytes + piece.size] = piece
            at_bytes += piece.size
        piece_scales = _scales6(d[r0 : r0 + step], m[r0 : r0 + step], symmetric)
        scales[at_scales : at_scales + piece_scales.size] = piece_scales
        at_scales += piece_scales.size
    assert at_bytes == (packed.size if by_slices else 0) and at_scales == scales.size
    return Int6Pack(torch.from_numpy(packed), torch.from_numpy(scales.view(np.uint16)), n, k, symmetric)


def _planes6(u: np.ndarray) -> np.ndarray:
    """`pack_int6_q8`'s bytes for rows that are whole groups of tiles (or
    the last rows), in the order the kernel reads them (numpy's way; the
    C library's packer writes the same bytes)."""
    n, k = u.shape
    nb = k // 32
    q = u.reshape(n // 16, 16, nb, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5)  # tile, block, half, quad, column, e
    planes = np.stack(
        [
            (q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4),
            (q[:, :, :, 2] & 15) | ((q[:, :, :, 3] & 15) << 4),
            (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6),
        ],
        axis=3,
    ).astype(np.uint8)  # tile, block, half, plane, column, e: 384 bytes a tile and block
    return grouped(planes, np.uint8, TILE_GROUPS)


def _scales6(d: np.ndarray, m: np.ndarray, symmetric: bool) -> np.ndarray:
    """`pack_int6_q8`'s scales for the same rows, in the kernel's order."""
    n, groups = d.shape
    nb = groups // 2
    which = [d] if symmetric else [d, m]
    both = np.stack(which).astype(np.float16)  # which, n, k/16
    both = both.reshape(len(which), n // 16, 16, nb, 2).transpose(1, 3, 4, 0, 2)  # tile, block, half, which, column
    return grouped(both, np.float16, TILE_GROUPS)


def sums16(x: torch.Tensor) -> torch.Tensor:
    """Each group of 16 of the rows x [R, K] (rounded to bf16 first) summed
    in fp32 as the kernel sums it: lanes i + (8 + i), then halves folded.
    [R, K / 16]."""
    rows, k = x.shape
    s = x.to(torch.bfloat16).float().view(rows, k // GROUP, GROUP)
    s = s[..., :8] + s[..., 8:]
    for width in (4, 2, 1):
        s = s[..., :width] + s[..., width : 2 * width]
    return s[..., 0]


def int6_q8_matmul(parts: Int6Parts, x: torch.Tensor) -> torch.Tensor:
    """The twin of the C kernel: x [R, K] in 8-bit blocks of 32
    (`reference.q8_blocks`) times w = d u + m transposed, per group of 16
    acc += isum (d xd), acc += m xs16, groups in order. [R, N] fp32; it
    differs from the kernel only where the kernel fuses a multiply-add."""
    xq, xd, _ = q8_blocks(x)
    n, k = parts.u.shape
    xs = sums16(x)
    sums = torch.einsum("rgj,ngj->rng", xq.reshape(x.shape[0], k // GROUP, GROUP).double(), parts.u.view(n, k // GROUP, GROUP).double()).float()
    acc = torch.zeros(x.shape[0], n)
    for g in range(k // GROUP):
        acc = acc + sums[:, :, g] * (parts.d[None, :, g] * xd[:, None, g // 2])
        acc = acc + parts.m[None, :, g] * xs[:, None, g]
    return acc
