"""4-bit weights kept as 4-bit: the codes of GGUF Q4_0, Q4_1 and Q4_K
blocks, with a scale and zero per group of 32 inputs (`Int4Parts`, the
form of torch's CPU int4 matmul), taken without requantizing; `Int4Rows`
keeps them in their blocks until a kernel's layout is made from them.

torch's format stores, per group of 32 inputs, a bf16 scale and zero with
    w = (q - 8) * scale + zero,   q in 0..15.
Q4_1 stores w = q * d + m, so scale = d and zero = m + 8d; Q4_0 stores
w = (q - 8) * d, so zero = 0. The only loss is rounding d and m from f16 to
bf16, the same order as rounding the dequantized weights to bf16.

`Projection` (kernels/projection.py) multiplies by them."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from trioserve.kernels import native_pack
from trioserve.kernels.layout import BlockRows

GROUP = 32


@attrs.frozen
class Int4Parts:
    """Unpacked 4-bit weight: q [N, K] uint8 in 0..15; scale, zero [N, K/32] fp32."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def take_rows(self, order: np.ndarray) -> Int4Parts:
        index = torch.from_numpy(np.ascontiguousarray(order))
        return Int4Parts(self.q[index], self.scale[index], self.zero[index])

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = (self.q.float().view(n, k // GROUP, GROUP) - 8) * self.scale[..., None] + self.zero[..., None]
        return w.view(n, k)


# The GGUF types whose codes are 4 bits in groups of 32, and so run on the 4-bit kernels.
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
Q4_K_BLOCK_BYTES = 144  # f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles


def parts_from_gguf(raw: np.ndarray, qtype_name: str) -> Int4Parts:
    """Split raw GGUF rows ([N, blocks * bytes_per_block] uint8) of a Q4_0,
    Q4_1 or Q4_K tensor into 4-bit codes and per-group scale and zero."""
    if qtype_name == "Q4_K":
        return _parts_from_q4_k(np.asarray(raw))
    rows = raw.shape[0]
    header = {"Q4_0": 2, "Q4_1": 4}[qtype_name]
    blocks = np.asarray(raw).reshape(rows, -1, header + GROUP // 2)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype_name == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    # Low nibbles are a block's first 16 values, high nibbles the last 16.
    q = native_pack.unpack_nibbles(raw, header + GROUP // 2, header, GROUP // 2)
    if q is None:
        packed = blocks[:, :, header:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return Int4Parts(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


def _parts_from_q4_k(raw: np.ndarray) -> Int4Parts:
    """Q4_K rows as groups of 32: each super-block of 256 weights holds f16
    d and dmin, and for each of its 8 groups a 6-bit scale s and min m, so
    w = d s q - dmin m. A group's scale d s and offset -dmin m are rounded
    to f16 here (what the 4-bit kernels take: each is off by at most 2^-11
    of itself, far inside the 4-bit codes' own error); the codes are the
    file's. Group j's codes are the low nibbles of the super-block's bytes
    32 (j // 2) .. 32 (j // 2) + 31 for even j, the high ones for odd j."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q4_K_BLOCK_BYTES)
    made = native_pack.q4_k_scales(raw)  # the C library's, in one pass; else numpy's
    if made is not None:
        group_d, zero = made
    else:
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        sc = blocks[..., 4:16].astype(np.int32)  # [rows, supers, 12]
        # Groups 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups
        # 4-7: the low nibble (scale) and high nibble (min) of bytes 8-11, over
        # the top 2 bits of bytes 0-3 (scale) and 4-7 (min).
        scale = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], axis=-1)
        mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1)
        group_d = (d[..., None] * scale).astype(np.float16).astype(np.float32)  # [rows, supers, 8]
        group_m = (-dmin[..., None] * mins).astype(np.float16).astype(np.float32)
        zero = group_m + 8 * group_d
    q = native_pack.unpack_nibbles(raw, Q4_K_BLOCK_BYTES, 16, 32)  # the C library's, in one pass; else numpy's
    if q is None:
        packed = blocks[..., 16:].reshape(rows, -1, 4, 32)  # [rows, supers, chunk, byte]
        q = np.empty((*packed.shape[:3], 2, 32), dtype=np.uint8)  # chunk, (low, high), byte
        np.bitwise_and(packed, 0x0F, out=q[:, :, :, 0])
        np.right_shift(packed, 4, out=q[:, :, :, 1])
        q = q.reshape(rows, -1)
    return Int4Parts(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(group_d.reshape(rows, -1)), torch.from_numpy(zero.reshape(rows, -1)))


class Int4Rows(BlockRows):
    """A 4-bit weight still in its GGUF blocks (`layout.BlockRows`): laid
    out for the int8-activation kernel straight from them
    (`native_pack.pack_int4_q8_rows`; for an 8B model, unpacking the codes
    one a byte, grouping them and joining the fused projections' parts had
    been most of the build); read as `Int4Parts` (``q``, ``scale``, ``zero``,
    unpacked once when first asked for: the same values) everywhere else."""

    TYPES = {"Q4_0": (18, GROUP), "Q4_1": (20, GROUP), "Q4_K": (Q4_K_BLOCK_BYTES, 256)}
    _unpack = staticmethod(lambda raw, qtype: parts_from_gguf(raw, qtype))
    _cat = staticmethod(lambda parts: _cat_parts(parts))
    q = property(lambda self: self.parts().q)
    scale = property(lambda self: self.parts().scale)
    zero = property(lambda self: self.parts().zero)


def _cat_parts(parts: list[Int4Parts]) -> Int4Parts:
    return Int4Parts(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts]))


def concat_rows(parts: list[Int4Parts | Int4Rows]) -> Int4Parts | Int4Rows:
    """One weight of ``parts``' rows, one after the other (`BlockRows.concat`)."""
    return Int4Rows.concat(parts)
