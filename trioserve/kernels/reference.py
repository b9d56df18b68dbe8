"""Torch reference implementations of the hot operations. They run on CPU
and are the oracle the Triton twins are tested against.

Layouts:
  x            [T, hidden]               packed tokens of every sequence in a step
  q            [T, H, D]; k, v [T, KVH, D]
  k_cache      [KVH, num_blocks, block_size, D] (one layer; v_cache alike)
  slot_mapping [T]     flat slot (block * block_size + offset) each token's K/V goes to
  block_tables [S, MB] block ids per sequence, padded with any valid id
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, accumulated in fp32, returned in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding. x [T, heads, D]; cos, sin [T, D/2] (fp32).
    Pair i is (x[i], x[i + D/2])."""
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store each token's K and V [T, KVH, D] at its slot, in place."""
    kv_heads, dim = k_cache.shape[0], k_cache.shape[-1]
    # A float32 model's bf16 pool: rounded to nearest even as stored (the C kernel's rounding).
    k_cache.view(kv_heads, -1, dim).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(kv_heads, -1, dim).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A causal attention mask [S, Q, L] (True = may attend; each query
    row's Trues a prefix, its last at the row's position) cut to a sliding
    window: a query at position p keeps keys p - window + 1 .. p."""
    keys = torch.arange(mask.shape[-1], device=mask.device)
    last = mask.sum(-1, keepdim=True) - 1  # each query row's position
    return mask & (keys > last - window)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    pad_index: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    flash: bool | None = None,
    fixed: bool = False,
    gather_into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens to its cached keys.

    Sequences are processed together: their queries are scattered into a
    padded [S, max_q] layout (``pad_index`` [T] gives each token's place), keys
    and values are gathered through ``block_tables``, and ``mask``
    [S, max_q, MB * block_size] (True = may attend) carries causality and
    context length. Prefill chunks and single decode tokens mix freely.

    flash: use torch's fused kernel (default: when max_q >= SDPA_MIN_QUERIES).
    fixed: batch-invariant arithmetic (`fixed_order_attention`): every row's
    result depends only on its own query, keys and values, never on the
    other rows, their number or the padded key length, which must then be a
    multiple of KV_TILE. Overrides ``flash``.
    gather_into: two buffers of at least KVH * S * MB * block_size * D
    elements of the cache's dtype that the gathered keys and values are
    written to, so a step allocates nothing that large (see `_gather_blocks`).
    Returns [T, H, D] in q's dtype."""
    n_seqs, max_q = mask.shape[0], mask.shape[1]
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    # pad_index is increasing, so a layout with no padded row is the identity.
    dense = q.shape[0] == n_seqs * max_q
    if dense:
        padded = q
    else:
        padded = q.new_zeros(n_seqs * max_q, heads, dim)
        padded.index_copy_(0, pad_index, q)
    # The KV-head-major cache layout makes the gather land contiguous: [KVH, S, L, D].
    k_out, v_out = gather_into if gather_into is not None else (None, None)
    keys = _gather_blocks(k_cache, block_tables, k_out)
    values = _gather_blocks(v_cache, block_tables, v_out)
    if keys.dtype != q.dtype:  # a bf16 pool under float32 queries: widened exactly
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if flash is None:
        flash = max_q >= SDPA_MIN_QUERIES
    if fixed:
        out = fixed_order_attention(padded.view(n_seqs, max_q, heads, dim), keys, values, mask, scale)
    elif flash:
        out = F.scaled_dot_product_attention(
            padded.view(n_seqs, max_q, heads, dim).transpose(1, 2),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=heads != kv_heads,
        ).transpose(1, 2)
    else:
        out = _grouped_attention(padded.view(n_seqs, max_q, heads, dim), keys, values, mask, scale)
    out = out.reshape(n_seqs * max_q, heads, dim)
    return out if dense else out.index_select(0, pad_index)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[KVH, NB, BS, D] gathered through [S, MB] tables -> [KVH, S, MB * BS, D],
    written to the front of ``out`` (flat, large enough) when given.
    Whole blocks are looked up as rows of a [KVH * NB, BS * D] matrix, which
    on CPU is 2.5x faster than advanced indexing (measured on a cache larger
    than the processor's caches); index_select with out= is as fast as an
    embedding lookup and allocates nothing."""
    kv_heads, num_blocks, block_size, dim = cache.shape
    n_seqs, max_blocks = block_tables.shape
    rows = (torch.arange(kv_heads, device=cache.device)[:, None] * num_blocks + block_tables.reshape(1, -1)).reshape(-1)
    table = cache.view(kv_heads * num_blocks, block_size * dim)
    if out is None:
        flat = table.index_select(0, rows)
    else:
        flat = torch.index_select(table, 0, rows, out=out[: rows.numel() * block_size * dim].view(-1, block_size * dim))
    return flat.view(kv_heads, n_seqs, max_blocks * block_size, dim)


# Below this many queries per sequence (decode steps, short chunks) two
# batched matmuls beat torch's CPU flash kernel by ~10x; above it flash wins.
SDPA_MIN_QUERIES = 64


def _grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention as two batched matmuls, batched over (KV head, sequence), with
    the query heads sharing a KV head stacked as rows. q [S, Q, H, D];
    keys, values [KVH, S, L, D]; mask [S, Q, L]. Softmax in fp32.
    Returns [S, Q, H, D]."""
    probs = _attention_probs(q, keys, mask, scale)
    return _heads_back(torch.matmul(probs, values), q.shape)


def _attention_probs(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float, row_tile: int | None = None
) -> torch.Tensor:
    """Softmax(q k^T * scale) under ``mask``, in fp32 then cast to q's dtype:
    [KVH, S, group * Q, L], the query heads sharing a KV head stacked as rows.
    ``row_tile``: the scores matmul takes the rows that many at a time (see
    `_row_tiled_matmul`)."""
    n_seqs, n_q, heads, dim = q.shape
    kv_heads, length = keys.shape[0], keys.shape[2]
    group = heads // kv_heads
    rows = q.view(n_seqs, n_q, kv_heads, group, dim).permute(2, 0, 3, 1, 4).reshape(kv_heads, n_seqs, group * n_q, dim)
    if row_tile is None:
        scores = torch.matmul(rows, keys.transpose(-1, -2))
    else:
        scores = _row_tiled_matmul(rows, keys.transpose(-1, -2), row_tile)
    scores = scores.float().mul_(scale)
    allowed = mask[:, None].expand(n_seqs, group, n_q, length).reshape(n_seqs, group * n_q, length)
    return torch.softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1).to(q.dtype)


def _heads_back(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[KVH, S, group * Q, D] (the layout of `_attention_probs`) -> [S, Q, H, D]."""
    n_seqs, n_q, heads, dim = shape
    kv_heads = out.shape[0]
    return out.view(kv_heads, n_seqs, heads // kv_heads, n_q, dim).permute(1, 3, 0, 2, 4).reshape(n_seqs, n_q, heads, dim)


# Keys per tile of `fixed_order_attention`'s reduction: a multiple of the
# vector width, large enough that few partial sums are left to add.
KV_TILE = 128
# Query rows per matmul call of fp32 `fixed_order_attention` (see there).
FP32_ROW_TILE = 16


def _row_tiled_matmul(a: torch.Tensor, b: torch.Tensor, tile: int) -> torch.Tensor:
    """``a @ b`` ([..., R, K] @ [..., K, N]) with a's rows padded to a
    multiple of ``tile`` and multiplied ``tile`` at a time, in one batched
    call, so every row goes through a matmul of the same shape whatever R."""
    rows = a.shape[-2]
    padded = -(-rows // tile) * tile
    if padded != rows:
        a = torch.cat([a, a.new_zeros(*a.shape[:-2], padded - rows, a.shape[-1])], dim=-2)
    out = torch.matmul(a.reshape(*a.shape[:-2], padded // tile, tile, a.shape[-1]), b.unsqueeze(-3))
    return out.reshape(*out.shape[:-3], padded, out.shape[-1])[..., :rows, :]


def fixed_order_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """`_grouped_attention` with a reduction order fixed per row, whatever
    shares the call (batch-invariant mode; docs/determinism.md).

    Measured here: the scores matmul (a dot product over the head dim) and
    the softmax over a key row padded with masked keys give each row the
    same bits whatever the other rows and the padded length. The
    probabilities-times-values matmul does not: its reduction runs over the
    key length, and the kernel blocks it differently for different lengths,
    zeros included. So that product is taken tile by tile, KV_TILE keys
    each, every tile through a matmul of the same inner size, and the
    per-tile results are summed in fp32 by a pairwise tree whose pairs are
    fixed by tile index. Tiles past a row's last key hold zero
    probabilities and add exact zeros, so padding never changes a sum.
    q [S, Q, H, D]; keys, values [KVH, S, L, D] with L a multiple of
    KV_TILE; mask [S, Q, L]. Returns [S, Q, H, D] in q's dtype."""
    kv_heads, n_seqs, length, dim = keys.shape
    if length % KV_TILE:
        raise ValueError(f"fixed-order attention needs a key length that is a multiple of {KV_TILE}, got {length}")
    tiles = length // KV_TILE
    # fp32 matmuls take another kernel for a call of very few rows (a
    # one-token chunk's 1-4 query heads per KV head) than for more, with
    # other rounding; bf16 ones were measured not to. So in fp32 both
    # products take the rows FP32_ROW_TILE at a time.
    row_tile = FP32_ROW_TILE if q.dtype == torch.float32 else None
    probs = _attention_probs(q, keys, mask, scale, row_tile)
    # [KVH, S, tiles, rows, KV_TILE] @ [KVH, S, tiles, KV_TILE, D]: one partial product per tile.
    by_tile = probs.view(kv_heads, n_seqs, -1, tiles, KV_TILE).transpose(2, 3).contiguous()
    tiled_values = values.view(kv_heads, n_seqs, tiles, KV_TILE, dim)
    if row_tile is None:
        partial = torch.matmul(by_tile, tiled_values).float()
    else:
        partial = _row_tiled_matmul(by_tile, tiled_values, row_tile).float()
    while partial.shape[2] > 1:
        if partial.shape[2] % 2:
            partial = torch.cat([partial, partial.new_zeros(partial[:, :, :1].shape)], dim=2)
        partial = partial[:, :, 0::2] + partial[:, :, 1::2]
    return _heads_back(partial[:, :, 0].to(q.dtype), q.shape)


def q8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows x [R, K] (rounded to bf16 first) as 8-bit blocks of 32, as the C
    kernel `int4_q8_matmul` makes them: xq [R, K/32, 32] (round(x 127 / amax),
    half to even, in -127..127, as fp32), xd = amax / 127 and xs, the
    block's exact sum in the kernel's order (lane i plus lane 16 + i, then
    halves folded), each [R, K/32] fp32."""
    rows, k = x.shape
    xb = x.to(torch.bfloat16).float().view(rows, k // 32, 32)
    amax = xb.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None]).clamp_(-127, 127)
    s = xb[..., :16] + xb[..., 16:]
    for width in (8, 4, 2, 1):
        s = s[..., :width] + s[..., width : 2 * width]
    return xq, amax / 127.0, s[..., 0]


def int4_q8_matmul(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The twin of the C kernel `int4_q8_matmul`: x [R, K] times the 4-bit
    weight w = q d + m (q [N, K] in 0..15; d, m [N, K/32] fp32, f16 values)
    transposed, with x in 8-bit blocks (`q8_blocks`): per block the exact
    integer sum of codes times bytes, then acc += sum (d xd) and
    acc += m xs, blocks in order. [R, N] fp32; it differs from the kernel
    only where the kernel fuses a multiply-add (one rounding, not two)."""
    xq, xd, xs = q8_blocks(x)
    n, k = q.shape
    # Exact: |sum| <= 32 * 15 * 127, far inside float64's integers.
    sums = torch.einsum("rbj,nbj->rnb", xq.double(), q.view(n, k // 32, 32).double()).float()
    acc = torch.zeros(x.shape[0], n)
    for b in range(k // 32):
        acc = acc + sums[:, :, b] * (d[None, :, b] * xd[:, None, b])
        acc = acc + m[None, :, b] * xs[:, None, b]
    return acc
