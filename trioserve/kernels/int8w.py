"""Weights of signed 8-bit codes with one scale per block of 32 (GGUF's
Q8_0): their codes, how they come from a file's blocks, the C kernel's
layout, and the kernel's torch twin.

A block of 32 inputs of one output holds w = d c, c in -128..127 (the
file's bytes) and d the block's f16 scale: exactly the file's values, so
nothing is rounded at load. The kernel (`native.int8_q8_matmul`) takes
inputs in 8-bit blocks of 32, as the 4- and 6-bit ones do with int8
activations, and sums each block's 32 products exactly in int32."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from trioserve.kernels.int6 import TILE_GROUPS
from trioserve.kernels.layout import BlockRows, grouped
from trioserve.kernels.reference import q8_blocks

BLOCK = 32
_BYTES = 34  # a Q8_0 block: f16 d, then 32 int8 codes


@attrs.frozen
class Int8Parts:
    """c [N, K] int8; d [N, K / 32] fp32 holding f16 values."""

    c: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.c.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.c.shape
        return (self.c.float().view(n, k // BLOCK, BLOCK) * self.d[..., None]).view(n, k)

    def take_rows(self, order: np.ndarray) -> Int8Parts:
        index = torch.from_numpy(np.ascontiguousarray(order))
        return Int8Parts(self.c[index], self.d[index])


class Q8Rows(BlockRows):
    """A Q8_0 weight still in its GGUF blocks (`layout.BlockRows`): laid
    out for the kernel straight from them (`pack_int8_q8`, by
    `native_pack.pack_int8_q8_rows`), read as `Int8Parts` (``c``, ``d``,
    unpacked once when first asked for) everywhere else."""

    TYPES = {"Q8_0": (_BYTES, BLOCK)}
    _unpack = staticmethod(lambda raw, qtype: parts_from_q8_0(raw))
    _cat = staticmethod(lambda parts: _cat_parts8(parts))
    c = property(lambda self: self.parts().c)
    d = property(lambda self: self.parts().d)


def _cat_parts8(parts: list[Int8Parts]) -> Int8Parts:
    return Int8Parts(torch.cat([p.c for p in parts]), torch.cat([p.d for p in parts]))


def concat_rows8(parts: list[Int8Parts | Q8Rows]) -> Int8Parts | Q8Rows:
    """One weight of ``parts``' rows, one after the other (`BlockRows.concat`)."""
    return Q8Rows.concat(parts)


def parts_from_q8_0(raw: np.ndarray) -> Int8Parts:
    """Rows of a Q8_0 tensor ([N, blocks * 34] uint8) as codes and block scales."""
    raw = np.asarray(raw)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    c = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return Int8Parts(torch.from_numpy(np.ascontiguousarray(c)), torch.from_numpy(np.ascontiguousarray(d)))


@attrs.frozen
class Int8CodesPack:
    """A weight in `int8_q8_matmul`'s layout (drawn in the C source)."""

    packed: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int


def pack_int8_q8(parts: Int8Parts | Q8Rows) -> Int8CodesPack:
    """``parts`` in the kernel's layout; a weight still in its file's
    blocks is laid out from them by the C library where it is loaded (the
    same bytes), else unpacked first."""
    if isinstance(parts, Q8Rows):
        from trioserve.kernels.native_pack import pack_int8_q8_rows  # native_pack imports this module's neighbours; lazily

        packed = pack_int8_q8_rows(parts)
        if packed is not None:
            return packed
        parts = parts.parts()
    c = parts.c.numpy()
    n, k = c.shape
    if n % 16 or k % BLOCK:
        raise ValueError(f"int8_q8_matmul takes weights of a multiple of 16 outputs and 32 inputs, got {n} x {k}")
    nb = k // BLOCK
    codes = c.reshape(n // 16, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4)  # tile, block, quad, column, e
    d = parts.d.numpy().astype(np.float16).reshape(n // 16, 16, nb).transpose(0, 2, 1)  # tile, block, column
    packed, scales = grouped(codes, np.int8, TILE_GROUPS), grouped(d, np.float16, TILE_GROUPS)
    return Int8CodesPack(torch.from_numpy(packed), torch.from_numpy(scales.view(np.uint16)), n, k)


def int8_q8_matmul(parts: Int8Parts, x: torch.Tensor) -> torch.Tensor:
    """The twin of the C kernel: x [R, K] in 8-bit blocks of 32
    (`reference.q8_blocks`) times w = d c transposed, per block, in order,
    acc += isum (d xd). [R, N] fp32; it differs from the kernel only where
    the kernel fuses a multiply-add."""
    xq, xd, _ = q8_blocks(x)
    n, k = parts.c.shape
    nb = k // BLOCK
    sums = torch.einsum("rbj,nbj->rnb", xq.reshape(x.shape[0], nb, BLOCK).double(), parts.c.view(n, nb, BLOCK).double()).float()
    acc = torch.zeros(x.shape[0], n)
    for b in range(nb):
        acc = acc + sums[:, :, b] * (parts.d[None, :, b] * xd[:, None, b])
    return acc
