"""How a decode step slows when another process holds one core (issue #25,
"graceful under contention"): the default model's decode step at 1 and 32
sequences, quiet and beside a busy loop pinned to the last core this
process may use, with every thread count from all the cores down to 1, and
with the count chosen per step as the worker chooses it (ThreadGovernor).

    .venv/bin/python bench/contention.py [--model smollm2] [--steps 20]

Prints a table, then as its last line one JSON object:
{"cores": n, "cpu": ..., "ms_per_step": {"quiet": {"2": {"1": a, "32": b}, ..., "governed": {...}}, "busy": {...}}}
Milliseconds are the mean step (a busy core makes them uneven)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trioserve.kernels.cpu import resolve_dtype  # noqa: E402
from trioserve.kernels.cpu import ThreadGovernor, cpu_flags, default_threads  # noqa: E402
from trioserve.models.checkpoint import load_checkpoint  # noqa: E402
from trioserve.models.decoder import DecoderModel  # noqa: E402
from trioserve.models.step import SeqChunk, build_step  # noqa: E402
from trioserve.state.kv_pool import BlockPool  # noqa: E402

BLOCK = 16
CONTEXT = 128
BATCHES = (1, 32)
BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def step_ms(model: DecoderModel, batch: int, steps: int, governor: ThreadGovernor | None = None) -> float:
    """The mean decode step's milliseconds for ``batch`` sequences, on
    torch's thread count, or on the count ``governor`` chooses per step (as
    the worker does), over the steps after each count was tried once."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    pool = BlockPool(batch * (CONTEXT + steps + BLOCK) // BLOCK + 4, BLOCK)
    cache = model.new_kv_cache(pool.num_blocks, BLOCK)
    tables = [pool.grow(i, CONTEXT + steps + 1) for i in range(batch)]
    ctx = [torch.randint(3, vocab, (CONTEXT,), generator=gen).tolist() for _ in range(batch)]
    model.forward(build_step([SeqChunk(c, 0, t) for c, t in zip(ctx, tables)], BLOCK, fixed=model.batch_invariant), cache)
    times = []
    for s in range(steps):
        step = build_step([SeqChunk([5], CONTEXT + s, t, decode=True) for t in tables], BLOCK, fixed=model.batch_invariant)
        threads = governor.choose(batch) if governor else None
        if threads:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        model.forward(step, cache)
        times.append(time.perf_counter() - t0)
        if governor:
            governor.record(batch, threads, times[-1])
    if governor:
        times = times[len(governor.choices) :]
    return sum(times) / len(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    ckpt = load_checkpoint(args.model, dtype=resolve_dtype("auto"))
    model = DecoderModel.from_checkpoint(ckpt, batch_invariant=True)
    out: dict[str, dict[str, dict[str, float]]] = {"quiet": {}, "busy": {}}
    for mode in ("quiet", "busy"):
        busy = subprocess.Popen([sys.executable, "-c", BUSY, str(cores[-1])]) if mode == "busy" else None
        try:
            time.sleep(0.5 if busy else 0)
            for threads in range(default_threads(), 0, -1):
                torch.set_num_threads(threads)
                out[mode][str(threads)] = {str(b): round(step_ms(model, b, args.steps), 2) for b in BATCHES}
                print(f"{mode:5} threads={threads}: " + ", ".join(f"{b} seqs {ms} ms" for b, ms in out[mode][str(threads)].items()), file=sys.stderr)
            # As the worker runs it: a governor per size, looking at the other counts every 16th step.
            out[mode]["governed"] = {str(b): round(step_ms(model, b, args.steps, ThreadGovernor(default_threads(), explore_every=16)), 2) for b in BATCHES}
            print(f"{mode:5} governed: " + ", ".join(f"{b} seqs {ms} ms" for b, ms in out[mode]["governed"].items()), file=sys.stderr)
            torch.set_num_threads(default_threads())
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    print(json.dumps({"cores": len(cores), "cpu": platform.processor() or platform.machine(), "flags": flags,
                      "kernels": model.kernels.name, "activations": model.kernels.activations, "ms_per_step": out}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
