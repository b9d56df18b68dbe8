"""How near the 4-bit int8-activation kernel runs to what this core can
issue, on AVX2 CPUs without VNNI (where `vpmaddubsw` then `vpmaddwd` do
the integer products).

Measures, on one thread and on all of them:
- the core's rates of `vpmaddubsw` (the products), `vpaddw` (the int16
  sums and the other integer ops) and FMA (two a cycle on every core that
  has it, so it gives the clock), each alone: eight independent chains,
  nothing from memory;
- the kernel itself (`int4_q8_matmul`) with its weight in cache (960
  outputs x 576 inputs, 512 rows) and out of cache (SmolLM2's 30 layers of
  projections, 32 and 512 rows).
Each as int8 operations a second (a multiply-add is two). A C compiler
and the AVX2 build are needed; the script builds its probes with ``cc``.

    .venv/bin/python bench/int8_peak.py [--threads 2]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
import time

import torch

from trioserve.kernels import native
from trioserve.kernels.int4 import Int4Parts

PROBES = r"""
#include <immintrin.h>
#include <stdint.h>

/* Each probe: eight independent chains of one instruction, nothing from
 * memory, kept out of line so that its registers are its own. */

/* c = vpmaddubsw(a, c): 32 multiply-adds each. */
__attribute__((noinline)) static int64_t maddubs_only(int64_t iters, int seed) {
    __m256i c0 = _mm256_set1_epi8((char)(seed + 1)), c1 = _mm256_set1_epi8(2), c2 = _mm256_set1_epi8(3), c3 = _mm256_set1_epi8(4);
    __m256i c4 = _mm256_set1_epi8(5), c5 = _mm256_set1_epi8(6), c6 = _mm256_set1_epi8(7), c7 = _mm256_set1_epi8(8);
    const __m256i a = _mm256_set1_epi8(3);
    for (int64_t t = 0; t < iters; t++) {
        c0 = _mm256_maddubs_epi16(a, c0), c1 = _mm256_maddubs_epi16(a, c1), c2 = _mm256_maddubs_epi16(a, c2), c3 = _mm256_maddubs_epi16(a, c3);
        c4 = _mm256_maddubs_epi16(a, c4), c5 = _mm256_maddubs_epi16(a, c5), c6 = _mm256_maddubs_epi16(a, c6), c7 = _mm256_maddubs_epi16(a, c7);
    }
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(c0, c1), _mm256_add_epi16(c2, c3)),
                                       _mm256_add_epi16(_mm256_add_epi16(c4, c5), _mm256_add_epi16(c6, c7)));
    return _mm256_extract_epi16(s, 0);
}

/* c = vpaddw(c, a): the kernel's int16 sums, and its other integer ops' pipes. */
__attribute__((noinline)) static int64_t paddw_only(int64_t iters, int seed) {
    __m256i c0 = _mm256_set1_epi16((short)seed), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    const __m256i a = _mm256_set1_epi16(3);
    for (int64_t t = 0; t < iters; t++) {
        c0 = _mm256_add_epi16(c0, a), c1 = _mm256_add_epi16(c1, a), c2 = _mm256_add_epi16(c2, a), c3 = _mm256_add_epi16(c3, a);
        c4 = _mm256_add_epi16(c4, a), c5 = _mm256_add_epi16(c5, a), c6 = _mm256_add_epi16(c6, a), c7 = _mm256_add_epi16(c7, a);
    }
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(c0, c1), _mm256_add_epi16(c2, c3)),
                                       _mm256_add_epi16(_mm256_add_epi16(c4, c5), _mm256_add_epi16(c6, c7)));
    return _mm256_extract_epi16(s, 0);
}

/* c = a c + b: two a cycle on every x86 core with FMA, so its rate
 * over two is the clock the probes ran at. */
__attribute__((noinline)) static int64_t fma_only(int64_t iters, int seed) {
    __m256 c0 = _mm256_set1_ps((float)seed), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-9f);
    for (int64_t t = 0; t < iters; t++) {
        c0 = _mm256_fmadd_ps(a, c0, b), c1 = _mm256_fmadd_ps(a, c1, b), c2 = _mm256_fmadd_ps(a, c2, b), c3 = _mm256_fmadd_ps(a, c3, b);
        c4 = _mm256_fmadd_ps(a, c4, b), c5 = _mm256_fmadd_ps(a, c5, b), c6 = _mm256_fmadd_ps(a, c6, b), c7 = _mm256_fmadd_ps(a, c7, b);
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                                   _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
    return (int64_t)_mm256_cvtss_f32(s);
}

/* Probe `which` (0 vpmaddubsw, 1 vpaddw, 2 FMA) on `threads` threads,
 * `iters` iterations of eight instructions each; returns a checksum. */
int64_t probe(int which, int64_t iters, int threads) {
    int64_t sum = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : sum)
    for (int t = 0; t < threads; t++)
        sum += which == 0 ? maddubs_only(iters, t) : (which == 1 ? paddw_only(iters, t) : fma_only(iters, t));
    return sum;
}
"""

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2's qkv, o, gate_up, down
LAYERS = 30


def build_probes() -> ctypes.CDLL:
    folder = tempfile.mkdtemp(prefix="int8_peak-")
    src, lib = os.path.join(folder, "probes.c"), os.path.join(folder, "probes.so")
    with open(src, "w") as f:
        f.write(PROBES)
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O3", "-march=x86-64-v3", "-fopenmp", "-fPIC", "-shared", src, "-o", lib], check=True)
    probes = ctypes.CDLL(lib)
    probes.probe.restype = ctypes.c_int64
    probes.probe.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    return probes


def parts(n: int, k: int, gen: torch.Generator) -> Int4Parts:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half().float()
    zero = (scale * 8 - torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    return Int4Parts(q, scale, zero)


def best(fn, rounds: int = 7) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
    small = native.pack_int4_q8(parts(960, 576, gen))  # 276 KB of codes: in the second-level cache
    xs = torch.randn(512, 576, generator=gen)
    t = best(lambda: native.int4_q8_matmul(small, xs, threads=args.threads))
    rates[f"int4_q8_matmul, 960 x 576 in cache, 512 rows, {args.threads} thread(s)"] = 512 * 960 * 576 * 2 / t / 1e9
    layers = [[native.pack_int4_q8(parts(n, k, gen)) for n, k in SHAPES] for _ in range(LAYERS)]
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
