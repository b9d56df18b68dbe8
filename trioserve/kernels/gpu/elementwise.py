"""Triton twins of the row-wise operations of kernels/native.py: the
RMSNorm (alone, and fused with the residual add), the MLP's silu(gate) * up,
and RoPE on q and k fused with the K/V store into the paged pool.

Each wrapper has the signature and semantics of its namesake in
kernels/native.py (less the ``checked`` and ``threads`` keywords) and runs
on whatever device its tensors are on: CUDA compiled, or CPU tensors under
TRITON_INTERPRET=1. The wrappers check shapes, dtypes and (for
`rope_write_kv`) index ranges before launching and raise RuntimeError, as
native.py does; the kernels themselves trust what they are given.

Every kernel computes in fp32 and rounds once, on the store, to the output
tensor's dtype. One program handles one row (or one head of one row) with a
block of the row width rounded up to a power of two; the tail is masked, so
any width works (hidden 576, test widths like 48)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Output dtypes the norms may cast to.
NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _launch(width: int) -> tuple[int, int]:
    """The block (width rounded up to a power of two) and warps for a program
    that covers ``width`` elements: one warp per 256, 1 to 8."""
    block = triton.next_power_of_2(max(width, 1))
    return block, max(1, min(8, block // 256))


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, n, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """One row of x [T, n] (contiguous fp32): with ADD, first x += delta
    (delta [T, n] contiguous, any float dtype, widened) stored back; then
    out[row] = x / sqrt(mean(x^2) + eps) * w in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
    if ADD:
        x = x + tl.load(delta_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + row * n + cols, x, mask=mask)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / n + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm(name: str, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> None:
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2 or weight.shape != (x.shape[1],):
        raise RuntimeError(
            f"{name} takes fp32 rows [T, n] and an fp32 weight [n], "
            f"got {x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}"
        )
    if dtype not in NORM_DTYPES:
        raise RuntimeError(f"{name} casts to float32, float16 or bfloat16, not {dtype}")
    if weight.device != x.device:
        raise RuntimeError(f"{name}: rows on {x.device}, weight on {weight.device}")


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=dtype, device=x.device)
    if rows and n:
        block, warps = _launch(n)
        add = delta is not None
        _rms_norm_kernel[(rows,)](x, delta if add else x, weight, out, n, eps, ADD=add, BLOCK=block, num_warps=warps)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`reference.rms_norm` of fp32 rows x [T, n] with an fp32 weight [n],
    cast to ``dtype`` (float32, float16 or bfloat16): a new [T, n] tensor.
    The sum of squares is a tree of the kernel's own, so bits may differ
    from torch's by rounding."""
    _check_norm("rms_norm", x, weight, dtype)
    return _norm(x.contiguous(), None, weight.contiguous(), eps, dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``h += delta`` in place (h contiguous fp32 rows [T, n]; delta [T, n]
    float32, float16 or bfloat16, widened as torch adds them), then `rms_norm`
    of the new h, in one pass: returns [T, n] in ``dtype``."""
    _check_norm("add_rms_norm", h, weight, dtype)
    if not h.is_contiguous() or delta.shape != h.shape:
        raise RuntimeError(
            f"add_rms_norm takes contiguous fp32 rows [T, n] and a delta of their shape, "
            f"got {tuple(h.shape)} and {tuple(delta.shape)}"
        )
    if delta.dtype not in NORM_DTYPES or delta.device != h.device:
        raise RuntimeError(f"add_rms_norm takes a float delta on {h.device}, got {delta.dtype} on {delta.device}")
    return _norm(h, delta.contiguous(), weight.contiguous(), eps, dtype)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, f, BLOCK: tl.constexpr):
    """One row of gu [T, 2f] (contiguous): out[row] = silu(gate) * up, in
    fp32, rounded once to out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < f
    gate = tl.load(gu_ptr + row * 2 * f + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * 2 * f + f + cols, mask=mask, other=0.0).to(tl.float32)
    # x / (1 + e^-x), with exp taken of -|x| only, so it never overflows.
    e = tl.exp(-tl.abs(gate))
    silu = tl.where(gate >= 0, gate, gate * e) / (1.0 + e)
    tl.store(out_ptr + row * f + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of packed rows [T, 2F] (gate then up), in fp32,
    rounded once to gate_up's dtype: [T, F]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype not in NORM_DTYPES:
        raise RuntimeError(f"silu_mul takes float rows [T, 2F], got {gate_up.dtype} {tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    rows, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, f, dtype=gate_up.dtype, device=gate_up.device)
    if rows and f:
        block, warps = _launch(f)
        _silu_mul_kernel[(rows,)](gate_up, out, f, BLOCK=block, num_warps=warps)
    return out


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr,
    real, heads, kv_heads, num_slots,
    DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row, j): j < heads rotates query head j of the row into
    q [T, heads, DIM]; j = heads + h rotates key head h and, for a row below
    ``real``, stores it and value head h at the row's slot of the caches
    [kv_heads, num_slots, DIM]. qkv [T, (heads + 2 kv_heads) * DIM] and the
    caches contiguous, of one dtype; cos, sin [*, DIM / 2] fp32."""
    half: tl.constexpr = DIM // 2
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < half
    width = (heads + 2 * kv_heads) * DIM
    pos = tl.load(pos_ptr + row).to(tl.int64)
    c = tl.load(cos_ptr + pos * half + cols, mask=mask, other=0.0)
    s = tl.load(sin_ptr + pos * half + cols, mask=mask, other=0.0)
    src = qkv_ptr + row * width + j * DIM
    x1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + cols, mask=mask, other=0.0).to(tl.float32)
    # Each product rounded, then the sum: as the torch twin (fusion is
    # switched off at launch, so no multiply-add rounds once instead).
    lo = x1 * c - x2 * s
    hi = x2 * c + x1 * s
    if j < heads:
        dst = q_ptr + (row * heads + j) * DIM
        tl.store(dst + cols, lo.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half + cols, hi.to(q_ptr.dtype.element_ty), mask=mask)
    elif row < real:
        h = (j - heads).to(tl.int64)
        at = (h * num_slots + tl.load(slot_ptr + row).to(tl.int64)) * DIM
        tl.store(k_ptr + at + cols, lo.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(k_ptr + at + half + cols, hi.to(k_ptr.dtype.element_ty), mask=mask)
        v_src = qkv_ptr + row * width + (heads + kv_heads + h) * DIM
        tl.store(v_ptr + at + cols, tl.load(v_src + cols, mask=mask), mask=mask)
        tl.store(v_ptr + at + half + cols, tl.load(v_src + half + cols, mask=mask), mask=mask)


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """RoPE and the K/V write of one layer in one launch, the twin of
    `reference.apply_rope` on q and k then `reference.write_kv`.
    qkv [T, (H + 2 KVH) * D] packed rows; positions [T]; cos, sin
    [max_position, D/2] fp32; k_cache, v_cache [KVH, NB, BS, D] contiguous,
    qkv's dtype, written in place; slots [R] flat slots (block * BS + offset)
    for the first R rows (the rest are padding: rotated, never stored).
    Returns the rotated queries [T, H, D] in qkv's dtype. A position or slot
    out of range raises RuntimeError before anything is written (the check
    reads them back to the host: a sync on CUDA)."""
    rows = qkv.shape[0]
    dim = k_cache.shape[-1]
    if (
        qkv.dim() != 2 or k_cache.dim() != 4 or k_cache.shape[0] != kv_heads or dim % 2
        or qkv.shape[1] != (heads + 2 * kv_heads) * dim or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] * 2 != dim
    ):  # fmt: skip
        raise RuntimeError(f"rope_write_kv: qkv {tuple(qkv.shape)} does not hold {heads} + 2 x {kv_heads} heads of {dim}")
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise RuntimeError(f"rope_write_kv takes contiguous caches of one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise RuntimeError(f"rope_write_kv takes caches of qkv's dtype {qkv.dtype}, got {k_cache.dtype} and {v_cache.dtype}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise RuntimeError("rope_write_kv takes fp32 cos and sin tables")
    if positions.shape != (rows,) or slots.dim() != 1 or slots.shape[0] > rows:
        raise RuntimeError(f"rope_write_kv: {rows} rows need {rows} positions and at most {rows} slots, got {tuple(positions.shape)} and {tuple(slots.shape)}")
    num_slots = k_cache.shape[1] * k_cache.shape[2]
    max_position = cos.shape[0]
    if rows and (int(positions.min()) < 0 or int(positions.max()) >= max_position):
        raise RuntimeError(f"rope_write_kv: a position is out of range (the tables hold {max_position})")
    real = slots.shape[0]
    if real and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise RuntimeError(f"rope_write_kv: a slot is out of range (the pool holds {num_slots})")
    q = torch.empty(rows, heads, dim, dtype=qkv.dtype, device=qkv.device)
    if rows:
        block, warps = _launch(dim // 2)
        _rope_write_kv_kernel[(rows, heads + kv_heads)](
            qkv.contiguous(), positions.contiguous(), cos.contiguous(), sin.contiguous(), q, k_cache, v_cache,
            slots.contiguous() if real else positions, real, heads, kv_heads, num_slots,
            DIM=dim, BLOCK=block, num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    return q
