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
import os
import platform

import torch

from trioserve.config import CPU_FEATURES_ENV, DTYPE_NAMES
from trioserve.errors import RequestError

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
    """Whether this CPU (or one with ``flags``) multiplies bfloat16 natively.
    For this CPU, not where $TRIOSERVE_CPU_FEATURES names a narrower level
    than native: that runs what a CPU of that level would, dtype included."""
    if flags is None:
        if os.environ.get(CPU_FEATURES_ENV, "native") not in ("", "native"):
            return False
        flags = cpu_flags()
    return bool(flags & BF16_FLAGS)


def auto_dtype(flags: frozenset[str] | None = None) -> torch.dtype:
    """The weights' dtype "auto" stands for on this CPU (or one with
    ``flags``). A user whose CPU is misjudged passes --dtype."""
    return torch.bfloat16 if native_bf16(flags) else torch.float32


# --dtype's names as torch dtypes (auto: by the device, `resolve_dtype`).
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
assert tuple(DTYPES) == DTYPE_NAMES


def resolve_kv_dtype(name: str) -> torch.dtype | None:
    """The KV pool's dtype ``name`` means (config.kv_cache_dtype): None for auto (the weights')."""
    return None if name == "auto" else DTYPES[name]


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The weights' dtype ``name`` means on ``device``: auto is bfloat16 on
    a GPU, and on a CPU bfloat16 only where it has native bf16 (kernels/cpu.py)."""
    try:
        dtype = DTYPES[name]
    except KeyError:
        raise RequestError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})", field="dtype") from None
    if dtype is not None:
        return dtype
    return torch.bfloat16 if torch.device(device).type == "cuda" else auto_dtype()


# What each x86-64 instruction-set level of the C kernels needs of the CPU
# (flags as /proc/cpuinfo spells them).
LEVEL_FLAGS = {
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx2-vnni": frozenset({"avx2", "fma", "f16c", "avx_vnni"}),
    "generic": frozenset(),
}


def level_fits(level: str, flags: frozenset[str] | None = None, machine: str | None = None) -> str | None:
    """None when this CPU (or one with ``flags``, of ``machine``) can run the
    C kernels built for ``level``; else why not, in words."""
    if level == "native":
        return None
    machine = machine or platform.machine()
    if level != "generic" and machine not in ("x86_64", "AMD64"):
        return f"{level} is an x86-64 level and this CPU is {machine}"
    missing = sorted(LEVEL_FLAGS[level] - (cpu_flags() if flags is None else flags))
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def default_threads() -> int:
    """The CPU threads a process should use: the cores it may run on
    (its affinity mask, which taskset, cgroups' cpusets and container
    limits set), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class ThreadGovernor:
    """Chooses how many CPU threads each step runs on, from how fast steps
    of its size ran on each count: all the cores when the machine is quiet,
    fewer when another process holds one of them.

    Why: a step is a few hundred parallel regions, each ending when its
    slowest thread does. Beside a busy loop on one of two cores, the thread
    there gets the core a share of the time, and the default model's decode
    step (2-core Xeon, AVX-512 VNNI) went from 8.6 to 22.7 ms (1 sequence) and from 44 to 278 ms (32),
    where one thread took 13.5 and 72 ms, busy loop or not (bench/README.md,
    "Every CPU"). So each count's seconds per step are kept per step size
    (a power-of-two bucket of its tokens), each count is tried once, the
    fastest runs, and every ``explore_every``-th step of a size tries
    another count, so a change in load is seen. A size of ``cheap_tokens``
    or more (a prompt's chunk) tries a count once only where that count won
    in some other size: trying one thread on a quiet machine doubled such a
    step, and with it the time to first token of whichever prompt drew it.
    Only for arithmetic whose
    bits do not depend on the thread count (the C kernels with int8
    activations: `Kernels.thread_invariant`); a plain class with no clock
    of its own (the caller times the steps)."""

    def __init__(self, most: int, explore_every: int = 64, weight: float = 0.5, cheap_tokens: int = 64):
        self.choices = sorted({most, most - 1, 1} - {0}, reverse=True) if most > 1 else [1]
        self.explore_every = explore_every
        self.weight = weight  # of a new measurement in a count's running average
        self.cheap = self.bucket(cheap_tokens - 1)  # sizes up to this bucket try every count early
        self._cost: dict[tuple[int, int], float] = {}
        self._steps: dict[int, int] = {}
        self._explored: dict[int, int] = {}

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(tokens, 1).bit_length()

    def choose(self, tokens: int) -> int:
        """The thread count for a step of ``tokens`` tokens."""
        b = self.bucket(tokens)
        n = self._steps.get(b, 0)
        self._steps[b] = n + 1
        tried = [t for t in self.choices if (b, t) in self._cost]
        for t in self.choices:
            if (b, t) not in self._cost and (not tried or b <= self.cheap or self._won_elsewhere(t, b)):
                return t
        best = min(tried, key=lambda t: self._cost[b, t])
        if n % self.explore_every == self.explore_every - 1:
            others = [t for t in self.choices if t != best]
            k = self._explored.get(b, 0)
            self._explored[b] = k + 1
            return others[k % len(others)]
        return best

    def _won_elsewhere(self, threads: int, bucket: int) -> bool:
        """Whether ``threads`` was the fastest count of some other size that has tried more than one."""
        for other in {c for c, _ in self._cost} - {bucket}:
            costs = {t: self._cost[other, t] for t in self.choices if (other, t) in self._cost}
            if len(costs) > 1 and min(costs, key=costs.__getitem__) == threads:
                return True
        return False

    def record(self, tokens: int, threads: int, seconds: float) -> None:
        """A step of ``tokens`` tokens took ``seconds`` on ``threads`` threads."""
        key = (self.bucket(tokens), threads)
        old = self._cost.get(key)
        self._cost[key] = seconds if old is None else old + self.weight * (seconds - old)

    def cost(self, tokens: int, threads: int) -> float | None:
        """The running average of such steps' seconds, or None (never run)."""
        return self._cost.get((self.bucket(tokens), threads))
