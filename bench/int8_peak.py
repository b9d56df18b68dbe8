"""How near the 4-bit int8-activation kernel runs to what this core can
issue, on AVX2 CPUs without VNNI (where `vpmaddubsw` then `vpmaddwd` do
the integer products).

Measures, on one thread and on all of them:
- the core's rate of `vpmaddubsw` alone (eight independent chains, no
  memory): the ceiling of any int8 kernel built on it;
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

/* Eight independent vpmaddubsw + vpaddw chains, each with its own code
 * register, the input changed (for the compiler) every iteration: 8 x 32
 * multiply-adds an iteration, nothing from memory. */
static int64_t maddubs_only(int64_t iters, int seed) {
    __m256i b = _mm256_set1_epi8(3);
    __m256i a0 = _mm256_set1_epi8((char)(seed + 1)), a1 = _mm256_set1_epi8(2), a2 = _mm256_set1_epi8(3), a3 = _mm256_set1_epi8(4);
    __m256i a4 = _mm256_set1_epi8(5), a5 = _mm256_set1_epi8(6), a6 = _mm256_set1_epi8(7), a7 = _mm256_set1_epi8(8);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (int64_t t = 0; t < iters; t++) {
        __asm__ volatile("" : "+x"(b));
        c0 = _mm256_add_epi16(c0, _mm256_maddubs_epi16(a0, b));
        c1 = _mm256_add_epi16(c1, _mm256_maddubs_epi16(a1, b));
        c2 = _mm256_add_epi16(c2, _mm256_maddubs_epi16(a2, b));
        c3 = _mm256_add_epi16(c3, _mm256_maddubs_epi16(a3, b));
        c4 = _mm256_add_epi16(c4, _mm256_maddubs_epi16(a4, b));
        c5 = _mm256_add_epi16(c5, _mm256_maddubs_epi16(a5, b));
        c6 = _mm256_add_epi16(c6, _mm256_maddubs_epi16(a6, b));
        c7 = _mm256_add_epi16(c7, _mm256_maddubs_epi16(a7, b));
    }
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(c0, c1), _mm256_add_epi16(c2, c3)),
                                       _mm256_add_epi16(_mm256_add_epi16(c4, c5), _mm256_add_epi16(c6, c7)));
    return _mm256_extract_epi16(s, 0);
}

/* The probe on `threads` threads, `iters` iterations each; returns a checksum. */
int64_t probe(int64_t iters, int threads) {
    int64_t sum = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : sum)
    for (int t = 0; t < threads; t++) sum += maddubs_only(iters, t);
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
    probes.probe.argtypes = [ctypes.c_int64, ctypes.c_int]
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
    iters = 20_000_000
    result: dict = {"threads": args.threads, "isa": native.isa(), "g_int8_ops_per_s": {}}
    rates = result["g_int8_ops_per_s"]
    for threads in sorted({1, args.threads}):
        t = best(lambda threads=threads: probes.probe(iters, threads), 3)
        rates[f"vpmaddubsw alone, {threads} thread(s)"] = threads * iters * 8 * 32 * 2 / t / 1e9
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
    print(f"# {native.isa()} build, {args.threads} threads; G int8 ops/s (a multiply-add is two)")
    print("| what | G int8 ops/s |")
    print("|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} |")
    result["g_int8_ops_per_s"] = {k: round(v, 1) for k, v in rates.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
