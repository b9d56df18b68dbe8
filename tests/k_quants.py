"""A Q4_K writer for tests (the gguf package reads K-quants but cannot write
them): simple rounding, not llama.cpp's search for the best scales, but the
same block layout, which is what the loader and the kernels must get right.
Checked against the gguf package's own dequantization (tests/models/test_k_quants.py)."""

from __future__ import annotations

import numpy as np

SUPER = 256  # weights per super-block
GROUPS = 8  # groups of 32 per super-block


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Rows ``w`` [N, K] (K a multiple of 256) as Q4_K bytes [N, K / 256 * 144]:
    per super-block f16 d and dmin, 6-bit scales and mins per group of 32
    packed into 12 bytes, then 128 bytes of nibbles; w ~ d s q - dmin m."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // SUPER, GROUPS, 32)
    low = np.minimum(g.min(-1), 0.0)  # a group's minimum, never above 0 (m >= 0)
    step = (g.max(-1) - low) / 15.0
    d = (step.max(-1) / 63.0).astype(np.float16)
    dmin = ((-low).max(-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[..., None] > 0, np.round(step / d32[..., None]), 0).clip(0, 63).astype(np.int32)
        mn = np.where(dmin32[..., None] > 0, np.round(-low / dmin32[..., None]), 0).clip(0, 63).astype(np.int32)
        scale = d32[..., None] * sc
        offset = dmin32[..., None] * mn
        q = np.where(scale[..., None] > 0, np.round((g + offset[..., None]) / scale[..., None]), 0).clip(0, 15).astype(np.uint8)
    packed_scales = np.zeros((n, k // SUPER, 12), np.uint8)
    packed_scales[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    packed_scales[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    packed_scales[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    # Bytes of chunk c: group 2c's codes in the low nibbles, group 2c + 1's in the high ones.
    nibbles = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, k // SUPER, 128)
    out = np.concatenate(
        [d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2), packed_scales, nibbles], axis=-1
    )
    return out.reshape(n, -1)
