"""The sampler's steps 4-9 (models/sampling.py) as one Triton kernel: the
guided mask, greedy argmax, temperature and softmax weights, top-k, top-p,
min-p and the counter-based draw, one token per row, chosen exactly as
`sampling.sample_rows` chooses it from the same logits.

What stays on the host: logit bias and the penalties (steps 1-3), which
touch a handful of ids per row and are applied with the reference's own code
before the launch (`sample_rows` below), and logprobs, which describe the
raw logits and are computed with torch.

The draw is computed in the kernel: Philox4x64-10 on uint64 lanes, the
64x64 -> 128-bit products built from 32-bit halves, bit for bit the
`sampling.uniform(seed, index)` of the CPU sampler
(kernels/gpu/sampler_math.py; tested against it directly and through every
drawn case).

How each choice is made to agree with the reference:

- weights: x / temperature with IEEE division, minus the row's largest,
  exp taken in float64 and rounded to float32. torch's float32 exp is
  within one unit of that (measured here: 1% of inputs differ, by one
  unit; it is MKL's or SLEEF's, neither of which a kernel can copy), the
  only place where the kernel's weights may differ from the reference's;
  a choice can move only if the draw lands within a unit's width of a
  boundary.
- top-k and every cut keep the n largest weights with the lowest ids among
  ties at the cut. The n-th largest weight is found by bisecting its
  float32 bit pattern (non-negative floats sort as their bits), counting in
  integers, so the kept set is exact.
- top-p: the reference sums the kept mass (float32 `row.sum()` without
  top-k, float64 over the top-k values with it), sets target = top_p *
  mass, and keeps the shortest prefix of the weights, largest first, whose
  float64 running sum reaches it. The float32 mass is summed here in torch's
  own order (kernels/gpu/sampler_math.py); the float64 sums are taken in
  the kernel's order, so they may differ from the reference's in the last
  bits of a double (2^-52 relative), far below any float32 weight, and a
  cut moves only if the target falls within that of a running sum.
- min-p: keeps w >= min_p * max(w) compared in float64, the same set as the
  reference's float32 threshold.
- the draw follows `sampling._choose_rows` step by step: float32 sums of
  each block of 256 ids in torch's order, their float64 running sum in id
  order, u times the total, the block found by counting running sums at or
  below the target, then the float64 running sum inside the block (plus the
  base) in id order, and the same fallback to the last non-zero weight when
  the target lands on the block's end.

Shapes: logits [R, V] float32 (any row stride); an allow mask, either bool
[R, V] or the int32 bitmask [R, words] of models.guided (bit v % 32 of word
v // 32); every row must allow at least one token with a finite logit.
V < 2^24. One program handles BLOCK_R rows, reading V in BLOCK_V tiles,
with a float32 scratch copy of the weights [R, V]. A row's token never
depends on the other rows; the blocking changes only the order of the
float64 sums above."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from trioserve.kernels.gpu.sampler_math import MAX_VOCAB, torch_order_sum, uniform
from trioserve.kernels.logits import best_logprobs, processed_logits
from trioserve.types import Sampled, SampleRow


@triton.jit
def _sample_kernel(
    logits_ptr,
    allow_ptr,
    work_ptr,
    out_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    draw_ptr,
    greedy_ptr,
    R,
    V,
    stride_logits,
    stride_allow,
    MASK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """out[r] (int64) = the token of row r. MASK: 0 none, 1 bool [R, V],
    2 int32 bitmask [R, words]. work: float32 [R, V] contiguous scratch."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    greedy = tl.load(greedy_ptr + rows, mask=live, other=1) != 0
    temperature = tl.load(temperature_ptr + rows, mask=live, other=1.0)
    top_k = tl.load(top_k_ptr + rows, mask=live, other=0)
    top_p = tl.load(top_p_ptr + rows, mask=live, other=1.0)
    min_p = tl.load(min_p_ptr + rows, mask=live, other=0.0)
    work_row = work_ptr + rows64 * V

    # Pass 1: masked logits; greedy argmax (first id among equal largest);
    # x / temperature into the scratch, and its row maximum.
    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK_R], dtype=tl.int32)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        ids = v0 + cols
        m = live[:, None] & (ids[None, :] < V)
        x = tl.load(logits_ptr + rows64[:, None] * stride_logits + ids[None, :], mask=m, other=float("-inf"))
        if MASK == 1:
            allowed = tl.load(allow_ptr + rows64[:, None] * stride_allow + ids[None, :], mask=m, other=0)
            x = tl.where(allowed != 0, x, float("-inf"))
        if MASK == 2:
            word = tl.load(allow_ptr + rows64[:, None] * stride_allow + (ids // 32)[None, :], mask=m, other=0)
            x = tl.where(((word >> (ids % 32)[None, :]) & 1) != 0, x, float("-inf"))
        tile_best = tl.max(x, axis=1)
        tile_id = tl.min(tl.where(x == tile_best[:, None], ids[None, :], 2147483647), axis=1)
        better = tile_best > best
        best_id = tl.where(better, tile_id, best_id)
        best = tl.where(better, tile_best, best)
        scaled = tl.div_rn(x, temperature[:, None])
        top = tl.maximum(top, tl.max(scaled, axis=1))
        tl.store(work_row[:, None] + ids[None, :], scaled, mask=m)
    top = tl.where(top > float("-inf"), top, 0.0)  # rows past R (and rows allowing nothing)
    tl.debug_barrier()

    # Pass 2: the weights exp(x / t - max), in float64 rounded to float32.
    for v0 in range(0, V, BLOCK_V):
        ids = v0 + cols
        m = live[:, None] & (ids[None, :] < V)
        scaled = tl.load(work_row[:, None] + ids[None, :], mask=m, other=float("-inf"))
        w = tl.exp((scaled - top[:, None]).to(tl.float64)).to(tl.float32)
        tl.store(work_row[:, None] + ids[None, :], w, mask=m)
    tl.debug_barrier()

    # Top-k: the k-th largest weight by bisecting its bits, then keep those
    # above it and the lowest-id ties; `mass` is the float64 sum of what stays.
    use_k = (~greedy) & (top_k > 0) & (top_k < V)
    kth = tl.zeros([BLOCK_R], dtype=tl.int32)
    for step in range(31):
        trial = kth | (1 << (30 - step))
        count = tl.zeros([BLOCK_R], dtype=tl.int32)
        for v0 in range(0, V, BLOCK_V):
            ids = v0 + cols
            m = live[:, None] & (ids[None, :] < V)
            bits = tl.load(work_row[:, None] + ids[None, :], mask=m, other=0.0).to(tl.int32, bitcast=True)
            count += tl.sum(((bits >= trial[:, None]) & m).to(tl.int32), axis=1)
        kth = tl.where(count >= top_k, trial, kth)
    above = tl.zeros([BLOCK_R], dtype=tl.int32)
    for v0 in range(0, V, BLOCK_V):
        ids = v0 + cols
        m = live[:, None] & (ids[None, :] < V)
        bits = tl.load(work_row[:, None] + ids[None, :], mask=m, other=0.0).to(tl.int32, bitcast=True)
        above += tl.sum(((bits > kth[:, None]) & m).to(tl.int32), axis=1)
    ties = top_k - above
    seen = tl.zeros([BLOCK_R], dtype=tl.int32)
    mass = tl.zeros([BLOCK_R], dtype=tl.float64)
    for v0 in range(0, V, BLOCK_V):
        ids = v0 + cols
        m = live[:, None] & (ids[None, :] < V)
        w = tl.load(work_row[:, None] + ids[None, :], mask=m, other=0.0)
        bits = w.to(tl.int32, bitcast=True)
        tie = ((bits == kth[:, None]) & m).to(tl.int32)
        rank = tl.cumsum(tie, axis=1) + seen[:, None]
        keep = (bits > kth[:, None]) | ((tie != 0) & (rank <= ties[:, None])) | (~use_k[:, None])
        seen += tl.sum(tie, axis=1)
        w = tl.where(keep, w, 0.0)
        tl.store(work_row[:, None] + ids[None, :], w, mask=m)
        mass += tl.sum(w.to(tl.float64), axis=1)
    tl.debug_barrier()

    # Top-p: target = top_p * the kept mass; the cut is at the largest weight
    # v whose running sum (everything >= v) reaches it, then inside v's ties.
    use_p = (~greedy) & (top_p < 1.0)
    row_sum = torch_order_sum(work_row, V, live, BLOCK_R).to(tl.float64)
    target = top_p * tl.where(use_k, mass, row_sum)
    cut = tl.zeros([BLOCK_R], dtype=tl.int32)
    for step in range(31):
        trial = cut | (1 << (30 - step))
        reached = tl.zeros([BLOCK_R], dtype=tl.float64)
        for v0 in range(0, V, BLOCK_V):
            ids = v0 + cols
            m = live[:, None] & (ids[None, :] < V)
            w = tl.load(work_row[:, None] + ids[None, :], mask=m, other=0.0)
            bits = w.to(tl.int32, bitcast=True)
            reached += tl.sum(tl.where(bits >= trial[:, None], w.to(tl.float64), 0.0), axis=1)
        cut = tl.where(reached >= target, trial, cut)
    larger = tl.zeros([BLOCK_R], dtype=tl.float64)
    n_larger = tl.zeros([BLOCK_R], dtype=tl.int32)
    n_equal = tl.zeros([BLOCK_R], dtype=tl.int32)
    for v0 in range(0, V, BLOCK_V):
        ids = v0 + cols
        m = live[:, None] & (ids[None, :] < V)
        w = tl.load(work_row[:, None] + ids[None, :], mask=m, other=0.0)
        bits = w.to(tl.int32, bitcast=True)
        larger += tl.sum(tl.where(bits > cut[:, None], w.to(tl.float64), 0.0), axis=1)
        n_larger += tl.sum(((bits > cut[:, None]) & m).to(tl.int32), axis=1)
        n_equal += tl.sum(((bits == cut[:, None]) & m).to(tl.int32), axis=1)
    value = cut.to(tl.float32, bitcast=True).to(tl.float64)
    value = tl.where(value > 0.0, value, 1.0)
    # Ties add `value` one at a time: the first count of them that reaches the target.
    most = tl.maximum(n_equal, 1)
    need = tl.minimum(tl.maximum(tl.math.ceil((target - larger) / value), 1.0), most.to(tl.float64)).to(tl.int32)
    fewer = (need > 1) & (larger + (need - 1).to(tl.float64) * value >= target)
    need = tl.where(fewer, need - 1, need)
    more = (need < most) & (larger + need.to(tl.float64) * value < target)
    need = tl.where(more, need + 1, need)
    kept = tl.where(use_k, top_k, V)
    use_p = use_p & (cut > 0) & (n_larger + need < kept)
    seen = tl.zeros([BLOCK_R], dtype=tl.int32)
    top_w = tl.zeros([BLOCK_R], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        ids = v0 + cols
        m = live[:, None] & (ids[None, :] < V)
        w = tl.load(work_row[:, None] + ids[None, :], mask=m, other=0.0)
        bits = w.to(tl.int32, bitcast=True)
        tie = ((bits == cut[:, None]) & m).to(tl.int32)
        rank = tl.cumsum(tie, axis=1) + seen[:, None]
        keep = (bits > cut[:, None]) | ((tie != 0) & (rank <= need[:, None])) | (~use_p[:, None])
        seen += tl.sum(tie, axis=1)
        w = tl.where(keep, w, 0.0)
        tl.store(work_row[:, None] + ids[None, :], w, mask=m)
        top_w = tl.maximum(top_w, tl.max(w, axis=1))
    tl.debug_barrier()

    # Min-p: keep w >= min_p * max(w), compared in float64.
    use_min = (~greedy) & (min_p > 0.0)
    limit = min_p * top_w.to(tl.float64)
    for v0 in range(0, V, BLOCK_V):
        ids = v0 + cols
        m = live[:, None] & (ids[None, :] < V)
        w = tl.load(work_row[:, None] + ids[None, :], mask=m, other=0.0)
        keep = (w.to(tl.float64) >= limit[:, None]) | (~use_min[:, None])
        tl.store(work_row[:, None] + ids[None, :], tl.where(keep, w, 0.0), mask=m)
    tl.debug_barrier()

    # The draw (sampling._choose_rows): the block of 256 ids, then the id.
    seed = tl.load(seed_ptr + rows, mask=live, other=0).to(tl.uint64, bitcast=True)
    index = tl.load(draw_ptr + rows, mask=live, other=0).to(tl.uint64, bitcast=True)
    u = uniform(seed, index, BLOCK_R)
    blocks = tl.cdiv(V, 256)
    total = tl.zeros([BLOCK_R], dtype=tl.float64)
    for b in range(blocks):
        total += torch_order_sum(work_row + b * 256, tl.minimum(256, V - b * 256), live, BLOCK_R).to(tl.float64)
    target = u * total
    running = tl.zeros([BLOCK_R], dtype=tl.float64)
    base = tl.zeros([BLOCK_R], dtype=tl.float64)
    block = tl.zeros([BLOCK_R], dtype=tl.int32)
    for b in range(blocks):
        running += torch_order_sum(work_row + b * 256, tl.minimum(256, V - b * 256), live, BLOCK_R).to(tl.float64)
        below = running <= target
        block += below.to(tl.int32)
        base = tl.where(below & (b < blocks - 1), running, base)
    block = tl.minimum(block, blocks - 1)
    first = block * 256
    inside = tl.zeros([BLOCK_R], dtype=tl.float64)
    offset = tl.zeros([BLOCK_R], dtype=tl.int32)
    for j in range(256):
        ids = first + j
        inside += tl.load(work_row + ids, mask=live & (ids < V), other=0.0).to(tl.float64)
        offset += (inside + base <= target).to(tl.int32)
    # The target on the block's very end: the last id with a weight before it.
    last = tl.full([BLOCK_R], -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        ids = v0 + cols
        m = live[:, None] & (ids[None, :] < V)
        w = tl.load(work_row[:, None] + ids[None, :], mask=m, other=0.0)
        hit = (w > 0.0) & (ids[None, :] < first[:, None] + 256)
        last = tl.maximum(last, tl.max(tl.where(hit, ids[None, :], -1), axis=1))
    token = tl.where(offset < 256, first + offset, last)
    token = tl.where(greedy, best_id, token)
    tl.store(out_ptr + rows, token.to(tl.int64), mask=live)


def launch_blocks(rows: int, vocab: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_V, num_warps): on a GPU one row per program over
    1024-wide tiles; in the interpreter (CPU tensors) up to 128 rows per
    program over one tile as wide as the row, since there the cost is per
    operation, not per element."""
    if device.type == "cuda":
        return 1, 1024, 4
    return min(128, triton.next_power_of_2(max(rows, 1))), min(4096, triton.next_power_of_2(max(vocab, 1))), 1


def _as_int64(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """uint64 values as the int64 tensor with the same bits."""
    return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64, device=device)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    seed: Sequence[int],
    draw_index: Sequence[int],
    allow: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 4-9 for each row of ``logits`` [R, V] (float32, on the device
    the kernel runs on): an int64 [R] tensor of tokens. A row with
    temperature 0 is greedy (its draw is unused). ``allow``: bool [R, V] or
    the int32 bitmask [R, words] of models.guided, on the same device.
    Blocking on a GPU only when the caller reads the result."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise RuntimeError(f"sample_tokens takes float32 logits [R, V], got {logits.dtype} {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if not 0 < vocab < MAX_VOCAB:
        raise RuntimeError(f"sample_tokens: a vocabulary of {vocab} is outside 1 to {MAX_VOCAB - 1}")
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed, "draw_index": draw_index}
    for name, values in given.items():
        if len(values) != rows:
            raise RuntimeError(f"sample_tokens: {len(values)} values of {name} for {rows} rows")
    device = logits.device
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    mask_kind, allow_t, stride_allow = 0, logits, 0
    if allow is not None:
        if allow.dtype == torch.bool and allow.shape == logits.shape:
            mask_kind, allow_t = 1, allow.contiguous().view(torch.int8)
        elif allow.dtype == torch.int32 and allow.dim() == 2 and allow.shape[0] == rows and allow.shape[1] * 32 >= vocab:
            mask_kind, allow_t = 2, allow.contiguous()
        else:
            raise RuntimeError(f"sample_tokens: an allow mask is bool [R, V] or int32 [R, >= V/32], got {allow.dtype} {tuple(allow.shape)}")
        if allow_t.device != device:
            raise RuntimeError(f"sample_tokens: logits on {device}, allow mask on {allow_t.device}")
        stride_allow = allow_t.stride(0)
    greedy = [t == 0 for t in temperature]
    params = dict(
        temperature_ptr=torch.tensor([1.0 if g else t for g, t in zip(greedy, temperature, strict=True)], dtype=torch.float32, device=device),
        top_k_ptr=torch.tensor([min(k, vocab) for k in top_k], dtype=torch.int32, device=device),
        top_p_ptr=torch.tensor(list(top_p), dtype=torch.float64, device=device),
        min_p_ptr=torch.tensor(list(min_p), dtype=torch.float64, device=device),
        seed_ptr=_as_int64(seed, device),
        draw_ptr=_as_int64(draw_index, device),
        greedy_ptr=torch.tensor(greedy, dtype=torch.int8, device=device),
    )
    work = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    block_r, block_v, warps = launch_blocks(rows, vocab, device)
    _sample_kernel[(triton.cdiv(rows, block_r),)](
        logits,
        allow_t,
        work,
        out,
        R=rows,
        V=vocab,
        stride_logits=logits.stride(0),
        stride_allow=stride_allow,
        MASK=mask_kind,
        BLOCK_R=block_r,
        BLOCK_V=block_v,
        num_warps=warps,
        **params,
    )
    return out


def sample_rows(logits: torch.Tensor, rows: Sequence[SampleRow], masks: torch.Tensor | None = None) -> list[Sampled]:
    """`sampling.sample_rows` with steps 4-9 on the logits' device: the
    same arguments (``masks``: the int32 bitmask of models.guided) and the
    same result. Bias and penalties, where a row has any, are applied on the
    host by the reference's code first. Blocking: reads the tokens back."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
    raw = logits.detach().float()
    x = raw
    if any(row.params.logit_bias or row.params.penalized for row in rows):
        x = processed_logits(raw.cpu(), rows).to(raw.device)
    p = [row.params for row in rows]
    tokens = sample_tokens(
        x,
        temperature=[q.temperature for q in p],
        top_k=[q.top_k for q in p],
        top_p=[q.top_p for q in p],
        min_p=[q.min_p for q in p],
        seed=[row.seed for row in rows],
        draw_index=[row.draw_index for row in rows],
        allow=None if masks is None else masks.to(raw.device),
    ).tolist()
    logprobs: list[float | None] = [None] * len(rows)
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs]
    if wanted:
        lp = torch.log_softmax(raw[wanted], dim=1).cpu()
        for j, i in enumerate(wanted):
            logprobs[i] = float(lp[j, tokens[i]])
            n = rows[i].params.top_logprobs
            if n:
                values, ids = torch.topk(lp[j], min(n + 1, lp.shape[1]))
                tops[i] = best_logprobs(lp[j], n, values.tolist(), ids.tolist())
    return [
        Sampled(token=tokens[i], draws=0 if row.params.greedy else 1, logprob=logprobs[i], top_logprobs=tops[i])
        for i, row in enumerate(rows)
    ]
