"""Decode attention (the C kernel, kernels/native.py) over 30 layers' KV
pools whose blocks lie scattered (or, `--layout runs`, in one run per
sequence, as a fresh pool hands them out): the
pools on ordinary pages against the pools on transparent huge pages
(kernels/memory.py), alternated, best of several rounds each; with the
rate of a plain in-order read of as many bytes for comparison. The
default model's shapes: 9 query heads, 3 KV heads, head dim 64, blocks of
16, bf16 (`--queries float32 --pool float32`: a float32 model's). The last line is one JSON object.

    .venv/bin/python bench/attention.py [--rows 32] [--context 171] [--threads 2] [--queries float32] [--pool float32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from trioserve.kernels import memory, native
from trioserve.models.step import SeqChunk, build_step

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def pools(num_blocks: int, huge: bool, gen: torch.Generator, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (LAYERS, KV_HEADS, num_blocks, BLOCK, DIM)
    k, v = (memory.zeros(shape, dtype=dtype, huge_pages=True) if huge else torch.zeros(shape, dtype=dtype) for _ in range(2))
    for t in (k, v):
        for layer in t:
            layer.copy_(torch.randn(layer.shape, generator=gen))
    return [(k[i], v[i]) for i in range(LAYERS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="decode rows (sequences)")
    parser.add_argument("--context", type=int, default=171, help="keys per row (107 prompt + half of 128 generated)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--layout",
        choices=("scattered", "runs"),
        default="scattered",
        help="where a sequence's blocks lie: anywhere in the pool, or in one run each (as a fresh pool hands them out)",
    )
    parser.add_argument("--queries", choices=("bfloat16", "float32"), default="bfloat16", help="the queries' dtype (a float32 model's)")
    parser.add_argument("--pool", choices=("bfloat16", "float32"), default="bfloat16", help="the KV pool's dtype")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.supports(HEADS, KV_HEADS, DIM):
        raise SystemExit("the C attention kernel is not built here")
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // BLOCK)
    num_blocks = args.rows * per_seq * 4  # the pool 4x what the rows use, their blocks anywhere in it
    order = (torch.randperm(num_blocks, generator=gen) if args.layout == "scattered" else torch.arange(num_blocks)).tolist()
    chunks = [SeqChunk([1], args.context - 1, order[s * per_seq : (s + 1) * per_seq], decode=True) for s in range(args.rows)]
    group = build_step(chunks, BLOCK, fixed=True).groups[0]
    queries = [torch.randn(args.rows, HEADS, DIM, generator=gen).to(getattr(torch, args.queries)) for _ in range(LAYERS)]
    pool = getattr(torch, args.pool)
    layouts = {"ordinary pages": pools(num_blocks, False, gen, pool), "huge pages": pools(num_blocks, True, gen, pool)}

    def step(layers) -> float:
        t = time.perf_counter()
        for (k, v), q in zip(layers, queries):
            native.decode_attention(q, k, v, group.block_tables, group.lengths, DIM**-0.5)
        return time.perf_counter() - t

    best = dict.fromkeys(layouts, float("inf"))
    for name, layers in layouts.items():
        step(layers)
    for _ in range(args.rounds):
        for name, layers in layouts.items():
            best[name] = min(best[name], step(layers))
    read = LAYERS * args.rows * KV_HEADS * args.context * DIM * 2 * pool.itemsize  # K and V
    plain = torch.randn(read // 4)
    plain_best = min(_timed(plain.sum) for _ in range(args.rounds))
    print(
        f"# {args.rows} rows x {args.context} keys, blocks {args.layout}, {LAYERS} layers, {args.queries} queries, "
        f"{args.pool} pool: {read / 1e6:.0f} MB of K/V a step, {args.threads} threads"
    )
    print("| pool | ms per step | GB/s |")
    print("|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e3:.2f} | {read / t / 1e9:.1f} |")
    print(f"| (a plain in-order read of as many bytes) | {plain_best * 1e3:.2f} | {read / plain_best / 1e9:.1f} |")
    ratio = best["ordinary pages"] / best["huge pages"]
    print(f"huge pages: {ratio:.2f}x")
    print(json.dumps({"rows": args.rows, "context": args.context, "layout": args.layout, "ms": {k: round(v * 1e3, 3) for k, v in best.items()}, "plain_read_ms": round(plain_best * 1e3, 3), "huge_speedup": round(ratio, 3)}))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
