"""Device functions of the sampler kernel (kernels/gpu/sampler.py) that
reproduce the CPU sampler's arithmetic bit for bit: `uniform`, the
Philox4x64-10 draw of `sampling.uniform`, on uint64 lanes with the
64x64 -> 128-bit products built from 32-bit halves; and `torch_order_sum`,
a float32 sum taken in the very order torch's CPU `sum` takes it, which
the reference uses for the top-p mass and the draw's block sums.

`torch_order_sum` follows aten's cascade_sum on CPU, checked bit for bit
against torch 2.13 on x86 with its AVX512, AVX2 and default kernels, which
all sum in 8-float vectors (and by the tests, on the machine they run on).
A row of n >= 8 floats is read as groups of 4 vectors of 8; the groups are
summed lane by lane into 4 accumulators, which every 16 groups cascade into
higher levels; the levels are added back, leftover whole vectors go into
the first accumulator, the 4 accumulators are added, and the result is 0
plus the scalar tail plus the 8 lanes in order. Under 8 floats: 4
interleaved scalar partials. A row of 32,768 floats or more is split across
threads by torch when it runs with several, which this does not follow
(the sampler sums a whole row only for the top-p mass without top-k)."""

from __future__ import annotations

import triton
import triton.language as tl

MAX_VOCAB = 1 << 24  # below this torch's cascade keeps its level width (16 groups)


@triton.jit
def _column(tile, lanes, index):
    """Column ``index`` of ``tile`` [R, L] as [R], exactly (one value plus zeros)."""
    return tl.sum(tl.where(lanes[None, :] == index, tile, 0.0), axis=1)


@triton.jit
def torch_order_sum(start, n, live, BLOCK_R: tl.constexpr):
    """The float32 sum of the n floats at ``start`` ([BLOCK_R] pointers) in
    torch's CPU order (the module's docstring); [BLOCK_R] float32."""
    c4 = tl.arange(0, 4)
    c8 = tl.arange(0, 8)
    c32 = tl.arange(0, 32)
    # Compiled, a name bound in both branches of a run-time `if` must have
    # one type in both: the partials are p4 [R, 4] in one and p8 [R, 8] in
    # the other (the interpreter let one name hold either).
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    if n < 8:
        quads = n // 4
        p4 = tl.load(start[:, None] + c4[None, :], mask=live[:, None] & (c4[None, :] < quads * 4), other=0.0)
        s = _column(p4, c4, 0)
        for t in range(quads * 4, n):
            s += tl.load(start + t, mask=live, other=0.0)
        s += _column(p4, c4, 1)
        s += _column(p4, c4, 2)
        s += _column(p4, c4, 3)
        total = s
    else:
        vectors = n // 8
        groups = vectors // 4
        whole = live[:, None] & (c32[None, :] >= 0)
        a0 = tl.zeros([BLOCK_R, 32], dtype=tl.float32)
        a1 = tl.zeros([BLOCK_R, 32], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_R, 32], dtype=tl.float32)
        a3 = tl.zeros([BLOCK_R, 32], dtype=tl.float32)
        for i in range(groups):
            a0 += tl.load(start[:, None] + i * 32 + c32[None, :], mask=whole, other=0.0)
            done = i + 1
            if (done & 15) == 0:
                a1 += a0
                a0 = tl.zeros([BLOCK_R, 32], dtype=tl.float32)
                if (done & 0xF0) == 0:
                    a2 += a1
                    a1 = tl.zeros([BLOCK_R, 32], dtype=tl.float32)
                    if (done & 0xF00) == 0:
                        a3 += a2
                        a2 = tl.zeros([BLOCK_R, 32], dtype=tl.float32)
        a0 = a0 + a1
        a0 = a0 + a2
        a0 = a0 + a3
        first = whole & (c32[None, :] < 8)
        for v in range(groups * 4, vectors):
            a0 += tl.load(start[:, None] + v * 8 + c32[None, :] % 8, mask=first, other=0.0)
        slots = tl.reshape(a0, [BLOCK_R, 4, 8])
        slot = tl.arange(0, 4)[None, :, None]
        p8 = tl.sum(tl.where(slot == 0, slots, 0.0), axis=1)
        p8 += tl.sum(tl.where(slot == 1, slots, 0.0), axis=1)
        p8 += tl.sum(tl.where(slot == 2, slots, 0.0), axis=1)
        p8 += tl.sum(tl.where(slot == 3, slots, 0.0), axis=1)
        s = tl.zeros([BLOCK_R], dtype=tl.float32)
        for t in range(vectors * 8, n):
            s += tl.load(start + t, mask=live, other=0.0)
        for lane in range(8):
            s += _column(p8, c8, lane)
        total = s
    return total


@triton.jit
def _mul_wide(a, b):
    """The 128-bit product of uint64 a and b as (high, low) uint64 halves."""
    a0 = a & 0xFFFFFFFF
    a1 = a >> 32
    b0 = b & 0xFFFFFFFF
    b1 = b >> 32
    p00 = a0 * b0
    p01 = a0 * b1
    p10 = a1 * b0
    mid = (p00 >> 32) + (p01 & 0xFFFFFFFF) + (p10 & 0xFFFFFFFF)
    high = a1 * b1 + (p01 >> 32) + (p10 >> 32) + (mid >> 32)
    low = (mid << 32) | (p00 & 0xFFFFFFFF)
    return high, low


@triton.jit
def uniform(seed, index, BLOCK_R: tl.constexpr):
    """sampling.uniform: Philox4x64-10, key (seed, 0), counter (index, 0, 0, 0);
    the top 53 bits of the first word as a float64 in [0, 1)."""
    m0 = tl.full([BLOCK_R], 0xD2E7470EE14C6C93, tl.uint64)
    m1 = tl.full([BLOCK_R], 0xCA5A826395121157, tl.uint64)
    w0 = tl.full([BLOCK_R], 0x9E3779B97F4A7C15, tl.uint64)
    w1 = tl.full([BLOCK_R], 0xBB67AE8584CAA73B, tl.uint64)
    k0 = seed
    k1 = tl.zeros([BLOCK_R], dtype=tl.uint64)
    c0 = index
    c1 = tl.zeros([BLOCK_R], dtype=tl.uint64)
    c2 = tl.zeros([BLOCK_R], dtype=tl.uint64)
    c3 = tl.zeros([BLOCK_R], dtype=tl.uint64)
    for round_ in tl.static_range(10):
        if round_ > 0:
            k0 = k0 + w0
            k1 = k1 + w1
        h0, l0 = _mul_wide(m0, c0)
        h1, l1 = _mul_wide(m1, c2)
        c0, c1, c2, c3 = h1 ^ c1 ^ k0, l1, h0 ^ c3 ^ k1, l0
    return (c0 >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2**-53
