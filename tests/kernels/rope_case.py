"""One RoPE-with-K/V-store case and what the torch twin makes of it, shared
by the native kernels' tests (tests/kernels/test_native.py) and the ARM
ones under qemu (tests/kernels/test_neon.py): a step's packed q|k|v rows at
random positions, ``real`` of them stored into random slots of a paged
pool (the rest pad rows that store nothing)."""

from __future__ import annotations

import attrs
import torch

from trioserve.kernels import reference

BLOCK_SIZE = 16
MAX_POS = 200


@attrs.frozen
class RopeCase:
    qkv: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    caches: list[torch.Tensor]  # the K and V pools, for the kernel to write into
    slots: torch.Tensor
    want_q: torch.Tensor
    want_k: torch.Tensor
    want_v: torch.Tensor


def rope_case(rows: int, real: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, pool: torch.dtype, num_blocks: int) -> RopeCase:
    gen = torch.Generator().manual_seed(rows + heads + dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POS, (rows,), generator=gen)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:real]
    angles = torch.outer(torch.arange(MAX_POS, dtype=torch.float64), torch.rand(dim // 2, generator=gen, dtype=torch.float64))
    cos, sin = angles.cos().float(), angles.sin().float()
    caches = [torch.randn(kv_heads, num_blocks, BLOCK_SIZE, dim, generator=gen).to(pool) for _ in range(2)]
    want_k, want_v = (c.clone() for c in caches)
    c, s = cos.index_select(0, positions), sin.index_select(0, positions)
    want_q = reference.apply_rope(qkv[:, : heads * dim].view(rows, heads, dim), c, s)
    k_rows = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v_rows = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    reference.write_kv(want_k, want_v, slots, reference.apply_rope(k_rows, c, s)[:real], v_rows[:real].contiguous())
    return RopeCase(qkv, positions, cos, sin, caches, slots, want_q, want_k, want_v)
