"""Per-token plumbing of the in-process engine, paired step by step: one
greedy request of N tokens; for each token, the gap between its event and
the previous one at the consumer, minus the duration of the worker's
forward-pass call for the step that produced it (timed inside the worker
thread). What is left is everything else a token costs: the scheduler's
bookkeeping, channel and thread hops, sampling, detokenizing. Pairing each
gap with its own step removes the step's run-to-run noise, which on this
machine is larger than what is measured.

With ``--http`` the same pairing runs over HTTP: the server runs in this
process (serve_app on 127.0.0.1), the client -- a streaming chat request --
in another process, and each SSE chunk's arrival (one per token; the
clocks are the same CLOCK_MONOTONIC) is paired with its step. What is left
then includes the SSE chunk, the socket write and the client's read.

Runs against whichever trioserve is first on sys.path. Prints one JSON
object.

    PYTHONPATH=TREE .venv/bin/python bench/hops_paired.py [--tokens 128] [--threads 1] [--http]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import trio

from trioserve.actors import worker
from trioserve.config import EngineConfig
from trioserve.engine import open_engine

try:  # since the step runner: the forward pass is StepRunner.forward
    from trioserve.models.step_runner import StepRunner
except ImportError:
    StepRunner = None

if StepRunner is not None:
    from trioserve.types import GenerateRequest, SamplingParams

    STEP_OWNER, STEP_FUNCTION = StepRunner, "forward"
elif hasattr(worker, "forward_step"):  # after the engine core
    from trioserve.types import GenerateRequest, SamplingParams

    STEP_OWNER, STEP_FUNCTION = worker, "forward_step"
else:  # before it
    from trioserve.actors.messages import GenerateRequest
    from trioserve.models.sampling import SamplingParams

    STEP_OWNER, STEP_FUNCTION = worker, "run_step"


def time_steps() -> list[float]:
    """Wrap the worker's forward-pass call; the list its durations go to."""
    durations: list[float] = []
    real = getattr(STEP_OWNER, STEP_FUNCTION)

    def timed(*args):
        started = time.perf_counter()
        try:
            return real(*args)
        finally:
            durations.append(time.perf_counter() - started)

    setattr(STEP_OWNER, STEP_FUNCTION, timed)
    return durations


def summary(gaps: list[float], overheads: list[float]) -> dict:
    return {
        "gap_p50_ms": round(statistics.median(gaps) * 1000, 3),
        "step_p50_ms": round(statistics.median(g - o for g, o in zip(gaps, overheads)) * 1000, 3),
        "overhead_p50_ms": round(statistics.median(overheads) * 1000, 3),
        "overhead_p90_ms": round(statistics.quantiles(overheads, n=10)[-1] * 1000, 3),
        "tokens": len(gaps),
    }


# The client: one streaming chat request; prints each SSE data line's arrival time.
CLIENT = """
import json, sys, time, httpx
url, tokens = sys.argv[1], int(sys.argv[2])
body = {"messages": [{"role": "user", "content": "word " * 120}], "stream": True,
        "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
times = []
with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            times.append(time.perf_counter())
print(json.dumps(times))
"""


async def measure_http(tokens: int, repeats: int) -> dict:
    from trioserve.config import ServerSettings  # noqa: PLC0415
    from trioserve.http.serve import serve_app  # noqa: PLC0415

    durations = time_steps()
    settings = ServerSettings(engine=EngineConfig(kv_cache_bytes=64 << 20), port=0, log_level="warning")
    gaps: list[float] = []
    overheads: list[float] = []
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(lambda task_status: serve_app(settings, shutdown_trigger=trio.sleep_forever, task_status=task_status))
        url = next(u for u in urls if u.startswith("http://127.0.0.1:"))
        for attempt in range(repeats + 1):  # the first run warms the kernels up
            durations.clear()
            done = await trio.run_process([sys.executable, "-c", CLIENT, url, str(tokens)], capture_stdout=True)
            times = json.loads(done.stdout)[1:]  # the role chunk first; then one chunk per token, the last with the final
            run_gaps = [b - a for a, b in zip(times[: tokens - 1], times[1:tokens])]
            if attempt:
                gaps += run_gaps
                overheads += [g - d for g, d in zip(run_gaps, durations[1:tokens])]
        nursery.cancel_scope.cancel()
    return summary(gaps, overheads)


async def measure(tokens: int, repeats: int) -> dict:
    durations = time_steps()
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
    return summary(gaps, overheads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--http", action="store_true", help="pair over HTTP (server here, client in another process)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(trio.run(measure_http if args.http else measure, args.tokens, args.repeats)))


if __name__ == "__main__":
    main()
