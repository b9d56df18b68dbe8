"""In-process engine throughput: aggregate output tokens/s and mean time to
first token with 1, 8 and 32 concurrent requests (128-token prompts, 128
output tokens, EOS ignored) on the default model, through the real actors.

    .venv/bin/python bench/engine.py [--concurrency 1 --concurrency 8 ...] [--threads N] [--no-int4] [--kv-cache-dtype bfloat16]

Prints a table, then as its last line one JSON object:
{"tokens_per_s": {"1": a, "8": b, "32": c}, "ttft_ms": {"1": ..., "8": ..., "32": ...}}
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch
import trio

from trioserve.types import FinalEvent, GenerateRequest
from trioserve.config import KV_CACHE_DTYPES, EngineConfig
from trioserve.engine import open_engine
from trioserve.types import SamplingParams

PROMPT = 128
OUTPUT = 128


async def one_round(engine, concurrency: int, seed: int) -> tuple[float, float]:
    """Run ``concurrency`` requests at once; returns (output tokens/s, mean TTFT s)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.tokenizer.vocab_size
    ttfts: list[float] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        prompt = torch.randint(3, vocab, (PROMPT,), generator=gen).tolist()
        params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
        async for event in engine.generate(GenerateRequest(prompt, params)):
            if isinstance(event, FinalEvent):
                tokens += event.usage.completion_tokens
                ttfts.append(event.timings.ttft_s)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(one, i)
    elapsed = trio.current_time() - start
    return tokens / elapsed, sum(ttfts) / len(ttfts)


async def main_async(args) -> dict:
    config = EngineConfig(
        model=args.model,
        use_int4=not args.no_int4,
        max_num_seqs=max(args.concurrency),
        prefill_budget=max(512, max(args.concurrency) + 1),
        kv_cache_dtype=args.kv_cache_dtype,
    )
    results = {"tokens_per_s": {}, "ttft_ms": {}}
    async with open_engine(config) as engine:
        await one_round(engine, 1, 0)  # warm-up
        for c in args.concurrency:
            rate, ttft = await one_round(engine, c, c)
            results["tokens_per_s"][str(c)] = round(rate, 1)
            results["ttft_ms"][str(c)] = round(ttft * 1000, 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", type=int, action="append")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-int4", action="store_true", help="bf16 matmuls at every batch size")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="the KV pool's dtype (as the server's option)")
    args = parser.parse_args()
    args.concurrency = args.concurrency or [1, 8, 32]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"KV pool {args.kv_cache_dtype}"
    )
    results = trio.run(main_async, args)
    print("| concurrency | output tokens/s | mean TTFT ms |")
    print("|---|---|---|")
    for c in args.concurrency:
        print(f"| {c} | {results['tokens_per_s'][str(c)]:.1f} | {results['ttft_ms'][str(c)]:.1f} |")
    base = results["tokens_per_s"].get("1")
    if base:
        print("# scaling vs 1: " + ", ".join(f"x{c}: {results['tokens_per_s'][str(c)] / base:.2f}" for c in args.concurrency))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
