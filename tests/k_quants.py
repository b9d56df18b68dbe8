"""K-quant writers for tests (the gguf package reads K-quants but cannot
write them): Q4_K, Q5_K and Q6_K by simple rounding, not llama.cpp's search
for the best scales, but in llama.cpp's block layouts, which is what the
loader and the kernels must get right. Checked against the gguf package's
own dequantization (tests/models/test_k_quants.py)."""

from __future__ import annotations

import numpy as np

SUPER = 256  # weights per super-block
GROUPS = 8  # groups of 32 per super-block (Q4_K, Q5_K); Q6_K has 16 groups of 16


def _affine_groups(w: np.ndarray, top: int, *, up: bool = False):
    """Q4_K's and Q5_K's rounding, codes 0..``top``: per super-block f16 d
    and dmin, per group of 32 a 6-bit scale and min, w ~ d sc q - dmin mn.
    ``up``: the 6-bit scales and mins rounded up, never down, so that no
    group's code runs past 0 or ``top`` and is cut (a group much smaller than
    its super-block's largest gets a coarse 6-bit scale); Q4_K's rounds to
    nearest, as the tests that use it were measured with.
    Returns (d, dmin, the 12 packed scale bytes, codes [N, blocks, 8, 32])."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // SUPER, GROUPS, 32)
    low = np.minimum(g.min(-1), 0.0)  # a group's minimum, never above 0 (m >= 0)
    step = (g.max(-1) - low) / top
    d = (step.max(-1) / 63.0).astype(np.float16)
    dmin = ((-low).max(-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    rounding = np.ceil if up else np.round
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[..., None] > 0, rounding(step / d32[..., None]), 0).clip(0, 63).astype(np.int32)
        mn = np.where(dmin32[..., None] > 0, rounding(-low / dmin32[..., None]), 0).clip(0, 63).astype(np.int32)
        scale = d32[..., None] * sc
        offset = dmin32[..., None] * mn
        q = np.where(scale[..., None] > 0, np.round((g + offset[..., None]) / scale[..., None]), 0).clip(0, top).astype(np.uint8)
    # Groups 0-3: 6-bit scale and min in bytes 0-3 and 4-7; groups 4-7: their
    # low 4 bits in bytes 8-11, their top 2 bits in the top bits of bytes 0-7.
    packed = np.zeros((n, k // SUPER, 12), np.uint8)
    packed[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return d, dmin, packed, q


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    n, blocks = x.shape
    return x.astype(np.float16).view(np.uint8).reshape(n, blocks, 2)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """128 bytes a super-block: byte l of chunk c holds group 2c's code l in
    its low nibble and group 2c + 1's in its high one."""
    n, blocks = q.shape[:2]
    low = q & 15
    return (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(n, blocks, 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Rows ``w`` [N, K] (K a multiple of 256) as Q4_K bytes [N, K / 256 * 144]:
    per super-block f16 d and dmin, 6-bit scales and mins per group of 32
    packed into 12 bytes, then 128 bytes of nibbles; w ~ d s q - dmin m."""
    n = w.shape[0]
    d, dmin, packed, q = _affine_groups(w, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, _nibbles(q)], axis=-1).reshape(n, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """Rows ``w`` [N, K] (K a multiple of 256) as Q5_K bytes [N, K / 256 * 176]:
    Q4_K's d, dmin and 12 scale bytes, then 32 bytes qh (bit g of byte l: the
    fifth bit of group g's code l), then Q4_K's 128 bytes of low nibbles;
    codes 0..31, the group scales and mins rounded up (`_affine_groups`)."""
    n = w.shape[0]
    d, dmin, packed, q = _affine_groups(w, 31, up=True)
    high = (q >> 4) & 1  # [N, blocks, 8, 32]
    qh = (high << np.arange(GROUPS, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8)  # [N, blocks, 32]
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qh, _nibbles(q)], axis=-1).reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Rows ``w`` [N, K] (K a multiple of 256) as Q6_K bytes [N, K / 256 * 210]:
    128 bytes ql (low 4 bits), 64 bytes qh (top 2 bits), 16 int8 scales (one
    per group of 16), f16 d; w ~ d sc (q - 32), q in 0..63. Each half of 128
    weights, as quarters Q0..Q3 of 32: ql bytes 0-31 hold Q0 (low nibble)
    and Q2 (high), bytes 32-63 Q1 and Q3; qh byte l holds bits 4-5 of Q0[l],
    Q1[l], Q2[l], Q3[l] at bits 0, 2, 4, 6. The int8 group scales are rounded
    up, so that no code is cut at -32 or 31."""
    n, k = w.shape
    blocks = k // SUPER
    g = w.astype(np.float32).reshape(n, blocks, 16, 16)
    step = np.abs(g).max(-1) / 31.0  # a group's step: its largest magnitude at code +-31
    d = (step.max(-1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[..., None] > 0, np.ceil(step / d32[..., None]), 0).clip(0, 127).astype(np.int8)
        scale = d32[..., None] * sc.astype(np.float32)
        q = np.where(scale[..., None] != 0, np.round(g / scale[..., None]), 0).clip(-32, 31)
    u = (q + 32).astype(np.uint8).reshape(n, blocks, 2, 4, 32)  # half, quarter, l
    q0, q1, q2, q3 = (u[:, :, :, i] for i in range(4))
    ql = np.concatenate([(q0 & 15) | ((q2 & 15) << 4), (q1 & 15) | ((q3 & 15) << 4)], axis=-1).reshape(n, blocks, 128)
    qh = ((q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6)).reshape(n, blocks, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1).reshape(n, -1)
