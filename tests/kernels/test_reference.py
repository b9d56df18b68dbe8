"""The torch references against formulas written out independently here:
rms_norm in float64, rotary embedding as complex multiplication, and paged
attention as a dense causal loop per sequence over its own K/V."""

from __future__ import annotations

import math

import pytest
import torch

from trioserve.kernels.reference import apply_rope, paged_attention, rms_norm, write_kv
from trioserve.models.step import SeqChunk, build_step

# dtype -> (atol, rtol) for outputs computed in fp32 and rounded to dtype.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2**-10),
    torch.bfloat16: (1e-2, 2**-7),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- rms_norm -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(("rows", "hidden"), [(37, 781), (1, 1), (5, 64)])
def test_rms_norm_matches_float64(dtype, rows, hidden):
    g = gen(rows * 1000 + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3 + 0.5).to(dtype)
    weight = (torch.rand(hidden, generator=g) * 2 - 0.5).to(dtype)
    eps = 1e-6
    out = rms_norm(x, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape

    x64, w64 = x.double(), weight.double()
    rms = torch.sqrt((x64 * x64).sum(-1, keepdim=True) / hidden + eps)
    expected = x64 / rms * w64
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_rms_norm_eps_matters_for_small_inputs():
    x = torch.full((2, 8), 1e-3)
    w = torch.ones(8)
    # rms = 1e-3, so with eps = 1e-6 the result is 1e-3 / sqrt(1e-6 + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), torch.full((2, 8), 1 / math.sqrt(2)))
    torch.testing.assert_close(rms_norm(x, w, 0.0), torch.ones(2, 8))


def test_rms_norm_normalises_each_row_alone():
    x = torch.tensor([[3.0, 4.0], [30.0, 40.0], [-1.0, 1.0]])
    out = rms_norm(x, torch.ones(2), 0.0)
    # rms of (3, 4) is sqrt(12.5); scaling a row by 10 does not change its output
    r = math.sqrt(12.5)
    torch.testing.assert_close(out, torch.tensor([[3 / r, 4 / r], [3 / r, 4 / r], [-1.0, 1.0]]))


# -- rotary embedding --------------------------------------------------------


def rope_tables(positions: torch.Tensor, dim: int, base: float = 10000.0):
    """cos/sin [T, dim/2] in fp32, computed in float64."""
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    return angles, torch.cos(angles).float(), torch.sin(angles).float()


def rope_complex(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Pair i = x[i] + 1j * x[i + D/2], multiplied by exp(1j * angle[i])."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = z * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_matches_complex_rotation(dtype):
    g = gen(1)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 31, 512, 3])
    heads, dim = 3, 64
    x = torch.randn(len(positions), heads, dim, generator=g).to(dtype)
    angles, cos, sin = rope_tables(positions, dim)
    out = apply_rope(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), rope_complex(x, angles), atol=atol, rtol=rtol)


def test_apply_rope_at_position_zero_is_identity():
    x = torch.randn(2, 4, 16, generator=gen(2))
    _, cos, sin = rope_tables(torch.zeros(2, dtype=torch.long), 16)
    torch.testing.assert_close(apply_rope(x, cos, sin), x)


def test_apply_rope_pairs_are_i_and_i_plus_half():
    # One pair lit: (x[1], x[1 + 4]) = (1, 0) rotated by angle a -> (cos a, sin a)
    dim = 8
    x = torch.zeros(1, 1, dim)
    x[0, 0, 1] = 1.0
    a = 0.3
    cos = torch.ones(1, dim // 2)
    sin = torch.zeros(1, dim // 2)
    cos[0, 1], sin[0, 1] = math.cos(a), math.sin(a)
    out = apply_rope(x, cos, sin)[0, 0]
    expected = torch.zeros(dim)
    expected[1], expected[5] = math.cos(a), math.sin(a)
    torch.testing.assert_close(out, expected)


def test_apply_rope_preserves_norms():
    x = torch.randn(11, 2, 32, generator=gen(3))
    _, cos, sin = rope_tables(torch.arange(11) * 37, 32)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    # each (i, i + D/2) pair keeps its own length
    pairs_in = x[..., :16].square() + x[..., 16:].square()
    pairs_out = out[..., :16].square() + out[..., 16:].square()
    torch.testing.assert_close(pairs_out, pairs_in, atol=1e-5, rtol=1e-5)


def test_rope_dot_product_depends_only_on_position_difference():
    dim = 64
    g = gen(4)
    q = torch.randn(1, 1, dim, generator=g)
    k = torch.randn(1, 1, dim, generator=g)

    def score(pq: int, pk: int) -> float:
        _, cq, sq = rope_tables(torch.tensor([pq]), dim)
        _, ck, sk = rope_tables(torch.tensor([pk]), dim)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    for delta in (0, 1, 5, 40):
        scores = [score(shift + delta, shift) for shift in (0, 3, 17, 250)]
        for s in scores[1:]:
            assert s == pytest.approx(scores[0], rel=1e-4, abs=1e-4)
    # and it does depend on the difference
    assert score(5, 0) != pytest.approx(score(0, 0), rel=1e-2)


# -- paged attention ---------------------------------------------------------


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start + n, KVH, D] -> [n, H, D].
    Query head h reads KV head h // (H // KVH)."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for i in range(n):
        ctx = start + i + 1
        for h in range(heads):
            kh = h // group
            scores = [scale * float(q[i, h].double() @ k[j, kh].double()) for j in range(ctx)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            acc = torch.zeros(dim, dtype=torch.float64)
            for j in range(ctx):
                acc += weights[j] / total * v[j, kh].double()
            out[i, h] = acc
    return out


def test_paged_attention_matches_dense_per_sequence():
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    num_blocks = 24
    scale = 1 / math.sqrt(dim)
    g = gen(5)
    # (tokens already cached, new tokens this step, spare blocks past what is needed)
    plan = [(0, 7, 0), (9, 1, 1), (5, 6, 0), (14, 1, 0), (3, 2, 2), (8, 1, 0)]
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for start, n, spare in plan:
        need = -(-(start + n) // block_size) + spare
        tables.append(ids[:need])
        ids = ids[need:]
    # the shuffle leaves tables that are not runs of consecutive ids
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables if len(t) > 1)

    # Cache starts as large garbage, so anything read that should not be shows.
    k_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g) * 50
    v_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g) * 50
    full_k = [torch.randn(s + n, kv_heads, dim, generator=g) for s, n, _ in plan]
    full_v = [torch.randn(s + n, kv_heads, dim, generator=g) for s, n, _ in plan]

    # An earlier step wrote the cached prefixes.
    prior = [(i, s) for i, (s, _, _) in enumerate(plan) if s > 0]
    before = build_step([SeqChunk([0] * s, 0, tables[i]) for i, s in prior], block_size)
    write_kv(
        k_cache,
        v_cache,
        before.slot_mapping,
        torch.cat([full_k[i][:s] for i, s in prior]),
        torch.cat([full_v[i][:s] for i, s in prior]),
    )

    # This step: every sequence's new tokens, packed.
    step = build_step([SeqChunk([1] * n, s, tables[i]) for i, (s, n, _) in enumerate(plan)], block_size)
    total = sum(n for _, n, _ in plan)
    q = torch.randn(total, heads, dim, generator=g)
    write_kv(
        k_cache,
        v_cache,
        step.slot_mapping,
        torch.cat([full_k[i][s:] for i, (s, _, _) in enumerate(plan)]),
        torch.cat([full_v[i][s:] for i, (s, _, _) in enumerate(plan)]),
    )
    out = paged_attention(q, k_cache, v_cache, step.block_tables, step.pad_index, step.mask, scale)
    assert out.shape == (total, heads, dim) and out.dtype == torch.float32

    row = 0
    for i, (s, n, _) in enumerate(plan):
        expected = dense_causal(q[row : row + n], full_k[i], full_v[i], s, scale)
        torch.testing.assert_close(out[row : row + n].double(), expected, atol=1e-5, rtol=1e-5, msg=f"sequence {i}")
        row += n


def test_paged_attention_single_decode_token_sees_whole_context():
    # One sequence, one new token at position 5: its output is the softmax-weighted
    # mean over all six cached values, so equal keys give the plain mean.
    block_size, dim = 4, 2
    k_cache = torch.zeros(1, 3, block_size, dim)
    v_cache = torch.zeros(1, 3, block_size, dim)
    step = build_step([SeqChunk([9], 5, [2, 0])], block_size)
    values = torch.arange(12, dtype=torch.float32).view(6, 1, dim)
    slots = torch.tensor([8, 9, 10, 11, 0, 1])  # block 2 then block 0
    write_kv(k_cache, v_cache, slots, torch.ones(6, 1, dim), values)
    assert step.slot_mapping.tolist() == [1]
    q = torch.ones(1, 1, dim)
    out = paged_attention(q, k_cache, v_cache, step.block_tables, step.pad_index, step.mask, 1.0)
    torch.testing.assert_close(out[0, 0], values[:, 0].mean(0))
