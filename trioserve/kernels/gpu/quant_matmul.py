"""Weight-only matmul straight from GGUF's quantized layouts: y = x @ W.T
with W's 4-bit (Q4_0, Q4_1) or 8-bit (Q8_0) codes dequantized tile by tile
in registers and the products summed in fp32. The CUDA counterpart of
`projection.Projection`'s 4-bit path (the block projections, Q4_1 in the
default model) and of `projection.Int8Rows` (the output head, tied to the
Q8_0 embedding), reading the file's own blocks instead of a CPU repacking.

Device layouts (every tensor contiguous, on the weight's device):

- `Q4Weight`: ``codes`` uint8 [N, K/2] in GGUF's own nibble order, i.e. a
  Q4 block with its header cut off: within each group of 32 inputs, byte j
  holds input j in its low nibble and input j + 16 in its high nibble.
  ``scale`` and ``offset`` [N, K/32], and ``center`` (0 or 8):
  w = (q - center) * scale + offset. From a file's Q4_1 blocks (`pack_q4_1`)
  scale and offset are the blocks' own float16 d and m with center 0, the
  file's formula w = q * d + m; from `Int4Parts` (`pack_int4_parts`, the
  loader's already un-permuted Q4_0/Q4_1 parts) they are its float32 scale
  and zero with center 8, that record's formula.
- `Q8Weight`: ``codes`` int8 [N, K] and ``scale`` float16 [N, K/32], the
  file's d: w = q * scale.

Read as float32, (q - center) * scale is exact whenever scale is a float16
(a 5-bit integer times an 11-bit mantissa), so from a file's blocks the
dequantized weights are the very float32 values ``gguf.quants.dequantize``
gives, FMA or not. From Int4Parts (float32 scales) they are its
`dequantize()` in the interpreter; a GPU may fuse the multiply-add and
round once where torch rounds twice.

Blocking: one program computes a [BLOCK_M, BLOCK_N] tile of y and walks K
in BLOCK_K steps from 0 upwards. The blocks depend on N and K only, never on
M, so a row of x gets the same arithmetic alone or beside others (the
batch-invariant mode's contract). Two ways to multiply a tile:

- the default, a plain reduction: the activations are widened to float32
  (exactly, from float16 or bfloat16), multiplied by the float32 weights
  and summed over the tile's K by tl.sum, added to the fp32 accumulator.
  Each output's order of additions is the same wherever its row sits:
  tested in the interpreter; on a GPU the reduction tree follows the tile's
  layout, which is the same for every row;
- ``dot=True``, tl.dot tiles: IEEE fp32 dot for float32/bfloat16
  activations, and for float16 activations the weights rounded to float16
  (tensor cores on a GPU, fp32 accumulator; error up to ~2^-11 of
  sum |x w|). Meant for many rows (prefill) on a GPU. Its batch invariance
  is a property of the GPU's dot and cannot be checked in the interpreter,
  whose tl.dot is numpy's matmul (its per-row bits move with the row's
  place in the tile): unverified until a GPU run records it."""

from __future__ import annotations

import attrs
import numpy as np
import torch
import triton
import triton.language as tl

from trioserve.kernels.int4 import GROUP, Int4Parts

X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
Q4_1_BLOCK_BYTES = 20  # f16 d, f16 m, 16 bytes of nibbles
Q8_0_BLOCK_BYTES = 34  # f16 d, 32 int8 codes


@attrs.frozen
class Q4Weight:
    """A 4-bit [N, K] weight in the layout above."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    center: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    def to(self, device: torch.device | str) -> Q4Weight:
        return Q4Weight(self.codes.to(device), self.scale.to(device), self.offset.to(device), self.center)

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight, in torch (the kernel's formula)."""
        n, k = self.shape
        groups = self.codes.view(n, k // GROUP, GROUP // 2)
        q = torch.cat([groups & 0x0F, groups >> 4], dim=-1).float()
        w = (q - self.center) * self.scale.float()[..., None] + self.offset.float()[..., None]
        return w.view(n, k)


@attrs.frozen
class Q8Weight:
    """An 8-bit [N, K] weight in the layout above."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def to(self, device: torch.device | str) -> Q8Weight:
        return Q8Weight(self.codes.to(device), self.scale.to(device))

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        w = self.codes.float().view(n, k // GROUP, GROUP) * self.scale.float()[..., None]
        return w.view(n, k)


def _blocks(raw: np.ndarray, n: int, k: int, block_bytes: int, kind: str) -> np.ndarray:
    if n < 1 or k < GROUP or k % GROUP:
        raise ValueError(f"{kind}: a [{n}, {k}] weight needs n >= 1 and k a positive multiple of {GROUP}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.size != n * (k // GROUP) * block_bytes:
        raise ValueError(f"{kind}: {raw.size} bytes do not hold a [{n}, {k}] weight ({block_bytes} bytes per {GROUP} values)")
    return raw.reshape(n, k // GROUP, block_bytes)


def _half(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The float16 field at byte ``start`` of every block: [N, K/32]."""
    return torch.from_numpy(np.ascontiguousarray(blocks[:, :, start : start + 2]).view(np.float16)[..., 0].copy())


def pack_q4_1(raw: np.ndarray, n: int, k: int) -> Q4Weight:
    """A GGUF Q4_1 tensor's bytes (uint8, as the file holds them: row-major
    [N, K/32] blocks) as a CPU `Q4Weight`; ``.to(device)`` moves it."""
    blocks = _blocks(raw, n, k, Q4_1_BLOCK_BYTES, "Q4_1")
    codes = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 4:]).reshape(n, k // 2))
    return Q4Weight(codes, _half(blocks, 0), _half(blocks, 2), center=0)


def pack_q8_0(raw: np.ndarray, n: int, k: int) -> Q8Weight:
    """A GGUF Q8_0 tensor's bytes as a CPU `Q8Weight`."""
    blocks = _blocks(raw, n, k, Q8_0_BLOCK_BYTES, "Q8_0")
    codes = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, k))
    return Q8Weight(codes, _half(blocks, 0))


def pack_int4_parts(parts: Int4Parts) -> Q4Weight:
    """`Int4Parts` (codes 0..15 with float32 scale and zero per 32 inputs)
    as a `Q4Weight` on the parts' device, nibbles in GGUF order."""
    n, k = parts.q.shape
    if k % GROUP:
        raise ValueError(f"Int4Parts of width {k}: not a multiple of {GROUP}")
    q = parts.q.to(torch.uint8).view(n, k // GROUP, 2, GROUP // 2)
    codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return Q4Weight(codes, parts.scale.float().contiguous(), parts.zero.float().contiguous(), center=8)


def launch_blocks(n: int, k: int, dot: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for an [n, k] weight; never a function of
    M. The reduction multiplies a [16, 32, 32] product tile (one group of 32
    inputs per step); tl.dot takes [16, K-step] x [K-step, 64] with the
    K-step the largest of 128, 64, 32 that divides k (no K tail to mask).
    N is masked, so any n works."""
    if not dot:
        return 16, 32, 32
    return 16, 64, next(b for b in (128, 64, 32) if k % b == 0)


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    offset_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    BITS: tl.constexpr,
    CENTER: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[M, N] (contiguous fp32) = x[M, K] (any strides) @ W.T for the tile
    (program 0 over M, program 1 over N). K % BLOCK_K == 0 and K % 32 == 0."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm[:, None] < M
    col_ok = rn[None, :] < N
    rn64 = rn.to(tl.int64)[None, :]
    groups = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :] * stride_xk, mask=row_ok, other=0.0)
        g = (k // 32)[:, None]
        # The weight tile is read as [BLOCK_K, BLOCK_N] (W transposed).
        if BITS == 4:
            byte = g * 16 + (k % 16)[:, None]
            shift = ((k // 16) % 2 * 4)[:, None]
            packed = tl.load(codes_ptr + rn64 * (K // 2) + byte, mask=col_ok, other=0).to(tl.int32)
            q = ((packed >> shift) & 0xF).to(tl.float32)
        else:
            q = tl.load(codes_ptr + rn64 * K + k[:, None], mask=col_ok, other=0).to(tl.float32)
        w = (q - CENTER) * tl.load(scale_ptr + rn64 * groups + g, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            w = w + tl.load(offset_ptr + rn64 * groups + g, mask=col_ok, other=0.0).to(tl.float32)
        if not DOT:
            # fma(x, w, 0) rounds as x * w does; written as a plain product,
            # Triton's compiler rewrites sum(a[:, :, None] * b[None], 1) into
            # a tl.dot, which runs float32 as TF32 on a GPU (seen on an H200:
            # errors of 1e-4 of sum |x w|).
            acc += tl.sum(tl.fma(x.to(tl.float32)[:, :, None], w[None, :, :], 0.0), axis=1)
        elif x_ptr.dtype.element_ty == tl.float16:
            acc = tl.dot(x, w.to(tl.float16), acc)
        else:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn64, acc, mask=row_ok & col_ok)


def matmul(weight: Q4Weight | Q8Weight, x: torch.Tensor, *, dot: bool = False) -> torch.Tensor:
    """x [M, K] (float32, float16 or bfloat16, any strides, on the weight's
    device) times the dequantized weight transposed: a new float32 [M, N].
    With the default reduction a row's result does not depend on M or on
    the other rows; ``dot=True`` uses tl.dot tiles (see the module's
    docstring)."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in X_DTYPES:
        raise RuntimeError(f"matmul of a [{n}, {k}] weight takes x [M, {k}] in float32/float16/bfloat16, got {x.dtype} {tuple(x.shape)}")
    if x.device != weight.codes.device:
        raise RuntimeError(f"matmul: x on {x.device}, weight on {weight.codes.device}")
    rows = x.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y
    block_m, block_n, block_k = launch_blocks(n, k, dot)
    four = isinstance(weight, Q4Weight)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        x,
        weight.codes,
        weight.scale,
        weight.offset if four else weight.scale,
        y,
        rows,
        n,
        k,
        x.stride(0),
        x.stride(1),
        BITS=4 if four else 8,
        CENTER=weight.center if four else 0,
        HAS_OFFSET=four,
        DOT=dot,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4 if dot else 8,
    )
    return y
