"""Per-token plumbing of the in-process engine, paired step by step: one
greedy request of N tokens; for each token, the gap between its event and
the previous one at the consumer, minus the duration of the worker's
forward-pass call for the step that produced it (timed inside the worker
thread). What is left is everything else a token costs: the scheduler's
bookkeeping, channel and thread hops, sampling, detokenizing. Pairing each
gap with its own step removes the step's run-to-run noise, which on this
machine is larger than what is measured.

Runs against whichever trioserve is first on sys.path (bench/hops.py runs
it on the "before" and "after" trees). Prints one JSON object.

    PYTHONPATH=TREE .venv/bin/python bench/hops_paired.py [--tokens 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import trio

from trioserve.actors import worker
from trioserve.config import EngineConfig
from trioserve.engine import open_engine

if hasattr(worker, "forward_step"):  # after the engine core
    from trioserve.types import GenerateRequest, SamplingParams

    STEP_FUNCTION = "forward_step"
else:  # before it
    from trioserve.actors.messages import GenerateRequest
    from trioserve.models.sampling import SamplingParams

    STEP_FUNCTION = "run_step"


async def measure(tokens: int, repeats: int) -> dict:
    durations: list[float] = []  # forward-pass calls, in order
    real = getattr(worker, STEP_FUNCTION)

    def timed(*args):
        started = time.perf_counter()
        try:
            return real(*args)
        finally:
            durations.append(time.perf_counter() - started)

    setattr(worker, STEP_FUNCTION, timed)
    overheads: list[float] = []
    gaps: list[float] = []
    async with open_engine(EngineConfig(kv_cache_bytes=64 << 20)) as engine:
        prompt = engine.tokenizer.encode("word " * 120)
        for _ in range(repeats + 1):  # the first run warms the kernels up
            durations.clear()
            times: list[float] = []
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            async for _event in engine.generate(GenerateRequest(prompt, params)):
                times.append(time.perf_counter())
            # Step k (k >= 1, after the prefill step 0) produced event k;
            # the last event is the final one, sent with the last token's.
            run_gaps = [b - a for a, b in zip(times[: tokens - 1], times[1:tokens])]
            run_overheads = [g - d for g, d in zip(run_gaps, durations[1:tokens])]
            gaps, overheads = gaps + run_gaps, overheads + run_overheads
        gaps, overheads = gaps[tokens - 1 :], overheads[tokens - 1 :]  # drop the warm-up run
    return {
        "gap_p50_ms": round(statistics.median(gaps) * 1000, 3),
        "step_p50_ms": round(statistics.median(g - o for g, o in zip(gaps, overheads)) * 1000, 3),
        "overhead_p50_ms": round(statistics.median(overheads) * 1000, 3),
        "overhead_p90_ms": round(statistics.quantiles(overheads, n=10)[-1] * 1000, 3),
        "tokens": len(gaps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(trio.run(measure, args.tokens, args.repeats)))


if __name__ == "__main__":
    main()
