"""How near the 4-bit int8-activation kernel runs to what this core can
issue, on AVX2 CPUs without VNNI (where `vpmaddubsw` then `vpmaddwd` do
the integer products).

Measures, on one thread and on all of them:
- the core's rates of `vpmaddubsw` (the products), `vpaddw` (the int16
  sums and the other integer ops) and FMA (two a cycle on every core that
  has it, so it gives the clock), each alone: loops of eight copies in
  assembly, nothing from memory;
- the kernel itself (`int4_q8_matmul`) with its weight in cache (960
  outputs x 576 inputs, 512 rows) and out of cache (SmolLM2's 30 layers of
  projections, 32 and 512 rows).
Each as int8 operations a second (a multiply-add is two). An x86-64 CPU
with AVX2 and FMA and a C compiler are needed; the script builds its
probes with ``cc`` (``$CC``) and says so where it cannot.

    .venv/bin/python bench/int8_peak.py [--threads 2]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import tempfile

import torch

from int8_activations import LAYERS, SHAPES, best, parts  # bench/int8_activations.py: SmolLM2's shapes, random 4-bit weights
from trioserve.kernels import native, native_pack

PROBES = r"""
#include <stdint.h>

/* Each probe: a loop of eight copies of one instruction, written in
 * assembly so that the compiler can neither merge, spill nor reorder
 * them. The integer ones write eight registers from two that never
 * change (no chains at all); FMA accumulates into eight (chains four
 * cycles long, eight of them: enough for two a cycle). The values do not
 * matter. */
#define EIGHT(OP, TAIL)                                                                              \
    OP " %%ymm0, %%ymm1, %%ymm2" TAIL OP " %%ymm0, %%ymm1, %%ymm3" TAIL OP " %%ymm0, %%ymm1, %%ymm4" TAIL \
    OP " %%ymm0, %%ymm1, %%ymm5" TAIL OP " %%ymm0, %%ymm1, %%ymm6" TAIL OP " %%ymm0, %%ymm1, %%ymm7" TAIL \
    OP " %%ymm0, %%ymm1, %%ymm8" TAIL OP " %%ymm0, %%ymm1, %%ymm9" TAIL
#define PROBE(NAME, OP)                                                                              \
    __attribute__((noinline)) static int64_t NAME(int64_t iters) {                                   \
        if (iters < 1) return 0;                                                                     \
        __asm__ volatile("vpxor %%ymm0, %%ymm0, %%ymm0\n\tvpxor %%ymm1, %%ymm1, %%ymm1\n"            \
                         "1:\n\t" EIGHT(OP, "\n\t") "dec %0\n\tjnz 1b\n\tvzeroupper"             \
                         : "+r"(iters)                                                               \
                         :                                                                           \
                         : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",    \
                           "xmm9", "cc");                                                            \
        return iters;                                                                                \
    }

PROBE(maddubs_only, "vpmaddubsw") /* 32 multiply-adds each */
PROBE(paddw_only, "vpaddw")       /* the kernel's int16 sums, and its other integer ops' pipes */
PROBE(fma_only, "vfmadd231ps")    /* two a cycle on every x86 core with FMA: its rate over two is the clock */

/* Probe `which` (0 vpmaddubsw, 1 vpaddw, 2 FMA) on `threads` threads,
 * `iters` iterations of eight instructions each; returns a checksum. */
int64_t probe(int which, int64_t iters, int threads) {
    int64_t sum = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : sum)
    for (int t = 0; t < threads; t++)
        sum += which == 0 ? maddubs_only(iters) : (which == 1 ? paddw_only(iters) : fma_only(iters));
    return sum;
}
"""



def build_probes() -> ctypes.CDLL:
    """The probes, compiled and loaded (the files are gone once loaded)."""
    with tempfile.TemporaryDirectory(prefix="int8_peak-") as folder:
        src, lib = os.path.join(folder, "probes.c"), os.path.join(folder, "probes.so")
        with open(src, "w") as f:
            f.write(PROBES)
        cc = os.environ.get("CC", "cc")
        try:
            subprocess.run([cc, "-O3", "-march=x86-64-v3", "-fopenmp", "-fPIC", "-shared", src, "-o", lib], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"the probes did not build with {cc}: {getattr(e, 'stderr', '') or e}") from None
        probes = ctypes.CDLL(lib)
    probes.probe.restype = ctypes.c_int64
    probes.probe.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    return probes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    if platform.machine() != "x86_64" or "avx2" not in flags or "fma" not in flags:
        raise SystemExit(f"the probes are AVX2 and FMA assembly; this is {platform.machine()} without them")
    if native.isa() not in ("avx2", "avx2-vnni") and not os.environ.get("TRIOSERVE_CPU_FEATURES"):
        print(f"# note: this build's level is {native.isa()!r}; the kernel rows below are its kernels, not the AVX2 ones")
    probes = build_probes()
    gen = torch.Generator().manual_seed(0)
    iters = 50_000_000
    result: dict = {"threads": args.threads, "isa": native.isa()}
    per_ns: dict[str, float] = {}
    for threads in sorted({1, args.threads}):
        for which, name in enumerate(("vpmaddubsw", "vpaddw", "FMA")):
            t = best(lambda which=which, threads=threads: probes.probe(which, iters, threads), 3)
            per_ns[f"{name}, {threads} thread(s)"] = threads * iters * 8 / t / 1e9
    ghz = per_ns["FMA, 1 thread(s)"] / 2
    print(f"# instructions a nanosecond, eight independent chains each (the clock from FMA's two a cycle: ~{ghz:.2f} GHz)")
    print("| instruction | per ns | per cycle a core |")
    print("|---|---|---|")
    for name, rate in per_ns.items():
        threads = int(name.split(", ")[1].split(" ")[0])
        print(f"| {name} | {rate:.2f} | {rate / threads / ghz:.2f} |")
    result["per_ns"] = {k: round(v, 3) for k, v in per_ns.items()}
    result["ghz_from_fma"] = round(ghz, 3)
    rates: dict[str, float] = {f"vpmaddubsw's products alone, {args.threads} thread(s)": per_ns[f"vpmaddubsw, {args.threads} thread(s)"] * 64}
    if not native.int4_q8_supported(960, 576):
        raise SystemExit("the int8-activation 4-bit kernel is not built here")
    small = native_pack.pack_int4_q8(parts(960, 576, gen))  # 276 KB of codes: in the second-level cache
    xs = torch.randn(512, 576, generator=gen)
    t = best(lambda: native.int4_q8_matmul(small, xs, threads=args.threads), 7)
    rates[f"int4_q8_matmul, 960 x 576 in cache, 512 rows, {args.threads} thread(s)"] = 512 * 960 * 576 * 2 / t / 1e9
    layers = [[native_pack.pack_int4_q8(parts(n, k, gen)) for n, k in SHAPES] for _ in range(LAYERS)]
    per_row = sum(n * k for n, k in SHAPES) * LAYERS * 2
    for rows in (32, 512):
        xs = {k: torch.randn(rows, k, generator=gen) for _, k in SHAPES}

        def step(xs=xs) -> None:
            for layer in layers:
                for pack, (_, k) in zip(layer, SHAPES):
                    native.int4_q8_matmul(pack, xs[k], threads=args.threads)

        t = best(step, 5)
        rates[f"int4_q8_matmul, SmolLM2's 30 layers, {rows} rows, {args.threads} thread(s)"] = rows * per_row / t / 1e9
    print(f"# {native.isa()} build, {args.threads} threads; G int8 ops/s (a multiply-add is two; 64 a vpmaddubsw)")
    print("| what | G int8 ops/s |")
    print("|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} |")
    result["g_int8_ops_per_s"] = {k: round(v, 1) for k, v in rates.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
