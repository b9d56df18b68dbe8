"""The 4-bit projections' two C kernels side by side, on SmolLM2's four
projection shapes with 30 layers of random 4-bit weights (51 MB, out of
cache, as in a real step): `int4_matmul` (bf16 activations, the default)
against `int4_q8_matmul` (`--activations int8`) at 1, 8, 32 and 64 decode
rows, and for prompt rows, `int4_q8_matmul` against the bf16 weights'
F.linear (what prompt rows run with bf16 activations) at 128 and 512 rows.
Best of several rounds, alternated; the last line is one JSON object.

    .venv/bin/python bench/int8_activations.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from trioserve.kernels import native, native_pack
from trioserve.kernels.int4 import Int4Parts

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down
LAYERS = 30


def parts(n: int, k: int, gen: torch.Generator) -> Int4Parts:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half().float()
    zero = (scale * 8 - torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    return Int4Parts(q, scale, zero)


def best(fn, rounds: int = 5) -> float:
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
    if not (native.int4_supported(32, 32) and native.int4_q8_supported(16, 32)):
        raise SystemExit("both kernels need the C kernels on a CPU with AVX-512 BF16 and VNNI")
    gen = torch.Generator().manual_seed(0)
    layers = [[parts(n, k, gen) for n, k in SHAPES] for _ in range(LAYERS)]
    bf16_packs = [[native_pack.pack_int4(p) for p in layer] for layer in layers]
    q8_packs = [[native_pack.pack_int4_q8(p) for p in layer] for layer in layers]
    result: dict = {"decode": {}, "prompt": {}}
    print(f"# {LAYERS} layers x 4 projections of SmolLM2's shapes, {args.threads} threads, ms per step (best)")
    print("| rows | bf16 activations | int8 activations | speed-up |")
    print("|---|---|---|---|")
    for rows in (1, 8, 32, 64):
        xs = [torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in SHAPES]

        def run(packs, matmul, xs=xs):
            for layer in packs:
                for pack, x in zip(layer, xs):
                    matmul(pack, x, checked=False)

        a = min(best(lambda: run(bf16_packs, native.int4_matmul)) for _ in range(2))
        b = min(best(lambda: run(q8_packs, native.int4_q8_matmul)) for _ in range(2))
        result["decode"][str(rows)] = {"bf16_ms": round(a * 1e3, 2), "int8_ms": round(b * 1e3, 2), "speedup": round(a / b, 2)}
        print(f"| {rows} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f}x |")
    dense = [p.dequantize().to(torch.bfloat16) for p in layers[0]]
    print("# prompt rows, one layer's four projections: the bf16 weights' F.linear against int4_q8_matmul")
    print("| rows | bf16 weights | int8 activations | speed-up |")
    print("|---|---|---|---|")
    for rows in (128, 512):
        xs = [torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in SHAPES]
        a = min(best(lambda: [F.linear(x, w) for w, x in zip(dense, xs)]) for _ in range(2))
        b = min(best(lambda: [native.int4_q8_matmul(p, x, checked=False) for p, x in zip(q8_packs[0], xs)]) for _ in range(2))
        result["prompt"][str(rows)] = {"bf16_ms": round(a * 1e3, 2), "int8_ms": round(b * 1e3, 2), "speedup": round(a / b, 2)}
        print(f"| {rows} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f}x |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
