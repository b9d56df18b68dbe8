"""What the fixed-order sampler costs (#47): the default model through the
in-process engine, N concurrent sampled requests (temperature 1, top-p
0.95, logprobs with the 5 best), the sampler's arithmetic switched between
the fixed order (kernels/sampler_math.py, today's) and torch's (before
#47) in alternating rounds of one run, one engine. Each round's wall time
gives tokens/s; the sampler's own calls are timed too, so its share of a
step is read exactly, not off two noisy throughputs.

    .venv/bin/python bench/sampler_cost.py [--concurrency 1 --concurrency 32] [--tokens 64] [--rounds 3]

Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import trio

from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.kernels import native
from trioserve.kernels.cpu import cpu_flags
from trioserve.kernels.sampler_math import FIXED, TORCH
from trioserve.models import sampling, step_runner
from trioserve.types import GenerateRequest, SamplingParams

ARMS = {"fixed": FIXED, "torch": TORCH}


def instrument(state: dict) -> None:
    """step_runner's sample_rows through the arm in ``state``, timed."""

    def timed(logits, rows, masks=None, numerics=None):
        started = time.perf_counter()
        try:
            return sampling.sample_rows(logits, rows, masks, ARMS[state["arm"]])
        finally:
            state["sampler_s"] += time.perf_counter() - started
            state["calls"] += 1

    step_runner.sample_rows = timed


async def run(levels: list[int], tokens: int, rounds: int) -> dict:
    state = {"arm": "fixed", "sampler_s": 0.0, "calls": 0}
    instrument(state)
    results: dict[str, dict] = {}
    async with open_engine(EngineConfig(kv_cache_bytes=512 << 20)) as engine:

        async def one(i: int, seed: int) -> None:
            prompt = engine.tokenizer.encode(f"Story {i}: " + "once upon a time " * 20)
            params = SamplingParams(max_tokens=tokens, temperature=1.0, top_p=0.95, seed=seed, logprobs=True, top_logprobs=5, ignore_eos=True)
            async for _ in engine.generate(GenerateRequest(prompt, params)):
                pass

        async def level(c: int, arm: str, seed: int) -> tuple[float, float, int]:
            state.update(arm=arm, sampler_s=0.0, calls=0)
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(c):
                    nursery.start_soon(one, i, seed + i)
            return time.perf_counter() - started, state["sampler_s"], state["calls"]

        await level(2, "fixed", 0)  # warm-up: kernels built, caches touched
        for c in levels:
            totals = {arm: [0.0, 0.0, 0] for arm in ARMS}
            for r in range(rounds):
                for arm in (("fixed", "torch") if r % 2 == 0 else ("torch", "fixed")):
                    wall, spent, calls = await level(c, arm, 1000 * r)
                    totals[arm][0] += wall
                    totals[arm][1] += spent
                    totals[arm][2] += calls
            results[str(c)] = {
                arm: {
                    "tokens_per_s": round(c * tokens * rounds / wall, 1),
                    "sampler_ms_per_step": round(1000 * spent / calls, 3),
                    "sampler_share": round(spent / wall, 4),
                }
                for arm, (wall, spent, calls) in totals.items()
            }
            fixed, old = results[str(c)]["fixed"], results[str(c)]["torch"]
            results[str(c)]["ratio"] = round(fixed["tokens_per_s"] / old["tokens_per_s"], 3)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, action="append", help="requests in flight (default 1 and 32)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each arm, alternating (default 3)")
    args = p.parse_args()
    levels = args.concurrency or [1, 32]
    results = trio.run(run, levels, args.tokens, args.rounds)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c")))
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.backends.cpu.get_cpu_capability()}, "
          f"C kernels {native.isa()}, {torch.get_num_threads()} threads, flags {' '.join(flags)}")
    print("| streams | fixed tok/s | torch tok/s | ratio | sampler ms/step fixed | torch |")
    print("|---|---|---|---|---|---|")
    for c, row in results.items():
        f, t = row["fixed"], row["torch"]
        print(f"| {c} | {f['tokens_per_s']} | {t['tokens_per_s']} | {row['ratio']} | {f['sampler_ms_per_step']} | {t['sampler_ms_per_step']} |")
    print(json.dumps({"levels": results, "threads": torch.get_num_threads(), "flags": flags, "cpu_kernels": native.isa()}))


if __name__ == "__main__":
    main()
