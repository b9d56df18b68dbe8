"""16-bit float weights (GGUF's F16 and BF16) kept as the file stores them:
their bits, the C kernel's layout, and the kernel's torch twin.

A model whose dtype is float32 (the default on CPUs without native bf16)
would otherwise hold an F16 file's matrices as float32, twice the file; one
in bf16 would round F16's 11-bit significands to 8. The kernel
(`native.w16_matmul`) widens each weight to float32 as it reads it and sums
each output over the inputs in order, one fused multiply-add at a time, so
it computes with the file's exact values and a row's result depends on that
row alone."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from trioserve.kernels.layout import BlockRows

W16_TYPES = ("F16", "BF16")
TILE = 16  # outputs per tile in the kernel's layout


@attrs.frozen
class W16Parts:
    """bits [N, K] int16 (the file's 16-bit patterns); bf16: BF16 rather than F16."""

    bits: torch.Tensor
    bf16: bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.bits.shape)

    def dequantize(self) -> torch.Tensor:
        if self.bf16:
            return self.bits.view(torch.bfloat16).float()
        return self.bits.view(torch.float16).float()

    def take_rows(self, order: np.ndarray) -> W16Parts:
        return W16Parts(self.bits[torch.from_numpy(np.ascontiguousarray(order))], self.bf16)


class W16Rows(BlockRows):
    """An F16 or BF16 weight still in its GGUF file (`layout.BlockRows`,
    blocks of one value): laid out for the kernel straight from the
    file's rows (`pack_w16`, by `native_pack.pack_w16_rows`), read as
    `W16Parts` (``bits``, unpacked once when first asked for) everywhere
    else. Its values are checked finite at load (`check_finite16`)."""

    TYPES = {"F16": (2, 1), "BF16": (2, 1)}
    _unpack = staticmethod(lambda raw, qtype: parts_from_w16(raw, qtype))
    _cat = staticmethod(lambda parts: _cat_parts16(parts))
    bits = property(lambda self: self.parts().bits)

    @property
    def bf16(self) -> bool:
        return self.qtype == "BF16"


def _cat_parts16(parts: list[W16Parts]) -> W16Parts:
    if len({p.bf16 for p in parts}) != 1:
        raise ValueError("cannot stack F16 and BF16 rows into one weight")
    return W16Parts(torch.cat([p.bits for p in parts]), parts[0].bf16)


def concat_rows16(parts: list[W16Parts | W16Rows]) -> W16Parts | W16Rows:
    """One weight of ``parts``' rows, one after the other (`BlockRows.concat`)."""
    return W16Rows.concat(parts)


ROWS_AT_ONCE = 1 << 20  # values `check_finite16` looks at a time


def check_finite16(array: np.ndarray, qtype_name: str) -> None:
    """ValueError if a 2-D F16 or BF16 tensor's data (any 2-byte dtype,
    [N, K]) holds an infinity or NaN; read a slice of rows at a time, so
    no copy of the whole is made."""
    bits = np.asarray(array).view(np.int16)
    exponent = np.int16(0x7F80) if qtype_name == "BF16" else np.int16(0x7C00)
    step = max(1, ROWS_AT_ONCE // max(bits.shape[-1], 1))
    for r0 in range(0, bits.shape[0], step):
        if ((bits[r0 : r0 + step] & exponent) == exponent).any():
            raise ValueError("contains NaN or infinity")


def parts_from_w16(array: np.ndarray, qtype_name: str) -> W16Parts:
    """A 2-D F16 or BF16 tensor's data (any 2-byte dtype, [N, K]) as bits.
    ValueError if a value is infinite or NaN."""
    bits = np.ascontiguousarray(np.asarray(array)).view(np.int16)
    exponent = np.int16(0x7F80) if qtype_name == "BF16" else np.int16(0x7C00)
    if ((bits & exponent) == exponent).any():
        raise ValueError("contains NaN or infinity")
    return W16Parts(torch.from_numpy(bits.copy()), qtype_name == "BF16")


@attrs.frozen
class W16Pack:
    """A weight in `w16_matmul`'s layout: tiles of 16 outputs, each [K][16];
    the last tile's rows past ``n`` are zero."""

    packed: torch.Tensor
    n: int
    k: int
    bf16: bool


def pack_w16(parts: W16Parts | W16Rows) -> W16Pack:
    """``parts`` in the kernel's layout; a weight still in its file is laid
    out from the file's rows by the C library where it is loaded (the same
    bytes), else unpacked first."""
    if isinstance(parts, W16Rows):
        from trioserve.kernels.native_pack import pack_w16_rows  # native_pack imports this module's neighbours; lazily

        packed = pack_w16_rows(parts)
        if packed is not None:
            return packed
        parts = parts.parts()
    n, k = parts.bits.shape
    width = -(-n // TILE) * TILE
    bits = parts.bits if width == n else torch.cat([parts.bits, torch.zeros(width - n, k, dtype=torch.int16)])
    packed = bits.view(width // TILE, TILE, k).transpose(1, 2).contiguous().view(-1)
    return W16Pack(packed, n, k, parts.bf16)


def w16_matmul(parts: W16Parts, x: torch.Tensor) -> torch.Tensor:
    """The twin of the C kernel: x [R, K] (as float32) times the weight
    transposed, each output summed over the inputs in order. [R, N] fp32;
    it differs from the kernel only where the kernel fuses a multiply-add.
    Slow (a torch call per input): for tests."""
    w = parts.dequantize()
    xf = x.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for i in range(w.shape[1]):
        acc = acc + xf[:, i : i + 1] * w[None, :, i]
    return acc
