"""The attention and SiLU kernels give the same bits at every x86 level
this CPU runs: the AVX2 builds and the native one (AVX-512 here) share
their 256-bit attention path for float32 queries, decode and prompt rows
alike, over float32 or bf16 caches (and for bf16 queries outside the
AVX-512 BF16 tiles), and SiLU is the same unfused operations at every
width, the plain C build's included. So a model served on an AVX2 CPU
computes what the same model computes on a wider one."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_native import PROMPTS, _case, _prompt_case
from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels import native, native_build
from trioserve.kernels.cpu import level_fits
from trioserve.models.step import build_step


def _levels(monkeypatch, candidates) -> list[str]:
    runs = []
    for level in candidates:
        if level_fits(level) is None:
            monkeypatch.setenv(CPU_FEATURES_ENV, level)
            if native_build.library() is not None:
                runs.append(level)
    monkeypatch.delenv(CPU_FEATURES_ENV)
    if len(runs) < 2:
        pytest.skip(f"fewer than two of {candidates} build and run here: nothing to compare")
    return runs


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (8, 1, 128, 32), (12, 1, 64, 16)])
@pytest.mark.parametrize("seqs", [1, 7, 33, 129])
def test_float32_attention_is_the_same_bits_at_every_avx2_level(monkeypatch, seqs, heads, kv_heads, dim, block_size, pool):
    """Float32 queries over a float32 pool, or over a bf16 one (a float32
    model's `--kv-cache-dtype bfloat16`)."""
    levels = _levels(monkeypatch, ("native", "avx2-vnni", "avx2"))
    gen = torch.Generator().manual_seed(heads * dim)
    q, k, v, chunks = _case(gen, seqs=seqs, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, dtype=torch.float32)
    k, v = k.to(pool), v.to(pool)
    g = build_step(chunks, block_size).groups[0]
    outs = {}
    for level in levels:
        monkeypatch.setenv(CPU_FEATURES_ENV, level)
        outs[level] = native.decode_attention(q, k, v, g.block_tables, g.lengths, dim**-0.5)
    first, *others = outs.values()
    assert all(torch.equal(first, o) for o in others), {lvl: float((o - first).abs().max()) for lvl, o in outs.items()}


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (8, 2, 128, 32)])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_float32_prompt_rows_are_the_same_bits_at_every_avx2_level(monkeypatch, prompt, heads, kv_heads, dim, block_size, pool):
    """Prompt chunks (rows sharing a sequence's table, after a cached prefix
    or from position 0) take the same per-row path as decode rows for
    float32 queries, so they too agree across the AVX2 and native builds."""
    levels = _levels(monkeypatch, ("native", "avx2-vnni", "avx2"))
    gen = torch.Generator().manual_seed(heads * dim + 1)
    q, k, v, chunks = _prompt_case(gen, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, dtype=torch.float32, prompt=prompt)
    k, v = k.to(pool), v.to(pool)
    g = build_step(chunks, block_size, buckets=False).groups[0]
    assert not g.decode
    outs = {}
    for level in levels:
        monkeypatch.setenv(CPU_FEATURES_ENV, level)
        outs[level] = native.decode_attention(q, k, v, g.block_tables, g.row_lengths, dim**-0.5, row_seq=g.row_seq)
    first, *others = outs.values()
    assert all(torch.equal(first, o) for o in others), {lvl: float((o - first).abs().max()) for lvl, o in outs.items()}


@pytest.mark.parametrize("f", [1536, 100, 7])
def test_silu_mul_is_the_same_bits_at_every_level(monkeypatch, f):
    levels = _levels(monkeypatch, ("native", "avx2-vnni", "avx2", "generic"))
    gen = torch.Generator().manual_seed(f)
    gate_up = torch.randn(5, 2 * f, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([0.0, -0.0, -100.0, 100.0])[: min(4, 2 * f)]
    outs = {}
    for level in levels:
        monkeypatch.setenv(CPU_FEATURES_ENV, level)
        outs[level] = native.silu_mul(gate_up)
    first, *others = outs.values()
    assert all(torch.equal(first, o) for o in others)
    torch.testing.assert_close(first, torch.nn.functional.silu(gate_up[:, :f]) * gate_up[:, f:], rtol=2e-6, atol=1e-6)
