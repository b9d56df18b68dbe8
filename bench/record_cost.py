"""What recording a trace costs, measured from the inside: N concurrent
greedy requests through the in-process engine with `record_dir` set, timing
every call the scheduler makes into the recording core twice -- the whole
call, and the core's own part of it -- so that what recording adds
(encoding the inputs and outputs as JSON and writing the line) is summed
exactly, not read off two noisy throughput runs. The event loop runs the
recording on its own thread, so that sum over the wall time is the share of
the loop's time it takes; a step's forward pass runs beside it in the
worker thread.

    .venv/bin/python bench/record_cost.py [--concurrency 32] [--tokens 128] [--threads 1]

Prints one JSON object: seconds of recording, wall seconds, their ratio,
tokens, trace lines and bytes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import trio

from trioserve.config import EngineConfig
from trioserve.core import trace
from trioserve.engine import open_engine
from trioserve.types import GenerateRequest, SamplingParams

METHODS = ("submit", "cancel", "settle", "plan", "result", "die")


def instrument() -> dict[str, float]:
    """Time Recording's calls and the core's, in seconds, by name."""
    spent = {"recording": 0.0, "core": 0.0}
    for name in METHODS:
        outer = getattr(trace.Recording, name)

        def timed(self, *args, _outer=outer, _name=name):
            inner = getattr(self.core, _name)

            def core_call(*a):
                started = time.perf_counter()
                try:
                    return inner(*a)
                finally:
                    spent["core"] += time.perf_counter() - started

            setattr(self.core, _name, core_call)  # an instance attribute, for this call only
            started = time.perf_counter()
            try:
                return _outer(self, *args)
            finally:
                spent["recording"] += time.perf_counter() - started
                delattr(self.core, _name)

        setattr(trace.Recording, name, timed)
    return spent


async def run(concurrency: int, tokens: int, directory: Path) -> dict:
    spent = instrument()
    async with open_engine(EngineConfig(kv_cache_bytes=256 << 20, record_dir=str(directory))) as engine:
        async def one(i: int) -> None:
            prompt = engine.tokenizer.encode(f"request {i}: " + "word " * 100)
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(GenerateRequest(prompt, params)):
                pass

        spent["recording"] = spent["core"] = 0.0
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - started
        path = engine.trace_path
    added = spent["recording"] - spent["core"]
    return {
        "recording_s": round(added, 4),
        "wall_s": round(wall, 3),
        "share": round(added / wall, 5),
        "tokens": concurrency * tokens,
        "trace_lines": sum(1 for _ in path.open()),
        "trace_bytes": path.stat().st_size,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        print(json.dumps(trio.run(run, args.concurrency, args.tokens, Path(directory))))


if __name__ == "__main__":
    main()
