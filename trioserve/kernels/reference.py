"""Torch reference implementations of the hot operations. They run on CPU
and are the oracle the Triton twins are tested against.

Layouts:
  x            [T, hidden]               packed tokens of every sequence in a step
  q            [T, H, D]; k, v [T, KVH, D]
  k_cache      [num_blocks, block_size, KVH, D] (one layer; v_cache alike)
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
    """Store each token's K and V at its slot, in place."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    pad_index: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens to its cached keys.

    Sequences are processed together: their queries are scattered into a
    padded [S, max_q] layout (``pad_index`` [T] gives each token's place), keys
    and values are gathered through ``block_tables``, and ``mask``
    [S, max_q, MB * block_size] (True = may attend) carries causality and
    context length. Prefill chunks and single decode tokens mix freely.
    Returns [T, H, D] in q's dtype."""
    n_seqs = block_tables.shape[0]
    max_q = mask.shape[1]
    _, heads, dim = q.shape
    padded = q.new_zeros(n_seqs * max_q, heads, dim)
    padded.index_copy_(0, pad_index, q)
    padded = padded.view(n_seqs, max_q, heads, dim).transpose(1, 2)
    keys = k_cache[block_tables].flatten(1, 2).transpose(1, 2)  # [S, KVH, L, D]
    values = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
    if max_q >= SDPA_MIN_QUERIES:
        out = F.scaled_dot_product_attention(
            padded, keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=heads != keys.shape[1]
        )
    else:
        out = _grouped_attention(padded, keys, values, mask, scale)
    return out.transpose(1, 2).reshape(n_seqs * max_q, heads, dim).index_select(0, pad_index)


# Below this many queries per sequence (decode steps, short chunks) two
# batched matmuls beat torch's CPU flash kernel by ~10x; above it flash wins.
SDPA_MIN_QUERIES = 64


def _grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention as two batched matmuls with the query heads of each KV head
    stacked as rows. q [S, H, Q, D]; keys, values [S, KVH, L, D]; mask [S, Q, L].
    Softmax in fp32. Returns [S, H, Q, D]."""
    n_seqs, heads, n_q, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    rows = q.reshape(n_seqs, kv_heads, group * n_q, dim)
    scores = torch.matmul(rows, keys.transpose(-1, -2)).float() * scale
    allowed = mask[:, None, None].expand(n_seqs, 1, group, n_q, length).reshape(n_seqs, 1, group * n_q, length)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(probs, values).view(n_seqs, heads, n_q, dim)
