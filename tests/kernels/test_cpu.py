"""The default dtype follows what the CPU multiplies natively."""

from __future__ import annotations

import torch

from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels.cpu import auto_dtype, cpu_flags, native_bf16, resolve_dtype


def test_auto_is_bfloat16_only_with_native_bf16():
    zen4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
    sapphire = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
    zen2 = frozenset({"avx2", "fma", "sse4_2"})
    assert native_bf16(zen4) and native_bf16(sapphire)
    assert not native_bf16(zen2) and not native_bf16(frozenset())
    assert auto_dtype(zen4) == torch.bfloat16 and auto_dtype(sapphire) == torch.bfloat16
    assert auto_dtype(zen2) == torch.float32 and auto_dtype(frozenset()) == torch.float32


def test_this_machine_resolves_auto_by_its_own_flags(monkeypatch):
    monkeypatch.delenv(CPU_FEATURES_ENV, raising=False)
    flags = cpu_flags()
    assert flags, "no CPU flags read on Linux"
    assert resolve_dtype("auto") == auto_dtype(flags)
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16


def test_a_narrower_level_resolves_auto_as_a_cpu_of_that_level(monkeypatch):
    """$TRIOSERVE_CPU_FEATURES=avx2 runs what an AVX2 CPU runs, dtype too."""
    for level in ("avx2", "avx2-vnni", "generic"):
        monkeypatch.setenv(CPU_FEATURES_ENV, level)
        assert not native_bf16() and resolve_dtype("auto") == torch.float32
