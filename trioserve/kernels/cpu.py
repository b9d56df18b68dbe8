"""What this CPU can do, and the arithmetic chosen from it.

bfloat16 matmuls are fast only on CPUs that multiply bf16 natively
(AVX-512 BF16 or AMX). Elsewhere (AVX2-only x86, for one) torch converts
and falls back to slow paths: a 16-row bf16 matmul of the output head took
87 ms there against 43 ms in float32, and a 512-row prompt projection 120 ms
against 20 ms. The rounding differs from the native kernels' too, and
SmolLM2's greedy answer to the test question derails in bf16 there while
float32 names Paris. So the default dtype ("auto") is bfloat16 where the
CPU has native bf16 and float32 elsewhere (bench/README.md, "CPU kinds")."""

from __future__ import annotations

import functools

import torch

# Flags (as /proc/cpuinfo spells them) that mean native bf16 dot products.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's feature flags; empty where /proc/cpuinfo is missing."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or one with ``flags``) multiplies bfloat16 natively."""
    return bool((cpu_flags() if flags is None else flags) & BF16_FLAGS)


def auto_dtype(flags: frozenset[str] | None = None) -> torch.dtype:
    """The weights' dtype "auto" stands for on this CPU (or one with
    ``flags``). A user whose CPU is misjudged passes --dtype."""
    return torch.bfloat16 if native_bf16(flags) else torch.float32
