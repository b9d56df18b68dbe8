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


def concat_rows16(parts: list[W16Parts]) -> W16Parts:
    if len({p.bf16 for p in parts}) != 1:
        raise ValueError("cannot stack F16 and BF16 rows into one weight")
    return W16Parts(torch.cat([p.bits for p in parts]), parts[0].bf16)


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


def pack_w16(parts: W16Parts) -> W16Pack:
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
