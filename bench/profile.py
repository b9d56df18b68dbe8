"""Where a forward step's time goes, on the served configuration.

Runs decode steps of 1, 8 and 32 rows (256 tokens of context each) and one
512-token prefill of the default model through the forward the server uses
(the served dtype: bfloat16 where the CPU multiplies it natively, else
float32, as ``--dtype auto``; 4-bit projections for generated tokens, batch-invariant
arithmetic unless ``--no-batch-invariant``), under ``torch.profiler``. Each
part of the forward is labelled with ``record_function`` by wrapping it
from here (the model itself carries no profiling hooks), and the table
gives each part's share of the step:

- build: turning the chunks into a StepBatch (models/step.py);
- projections: the four per-layer matmuls (QKV, O, gate+up, down);
- head: the output head (49,152 x 576);
- attention: paged attention, gather of cached K/V included (every row
  through the C kernel, kernels/native.py, where it is built);
- gather: the K/V gather alone (part of attention; the C kernel has none);
- norms, rope, kv write: the small per-layer operations (norms with the
  residual add fused in, where the C kernels run);
- silu: SiLU * up (the C kernel's; torch's counts in rest);
- rest: whatever else runs between them (embedding, residual adds on the
  torch path, slicing, Python), i.e. the step's wall time minus the parts.

The parts are those of the layer-by-layer forward. Where the model runs its
layers in one C call (kernels/layer_runner.py: the C kernels with int8
activations), that step is timed first ("one call ms"), then the model is
profiled layer by layer; the difference is the per-call Python and ctypes.

Also prints the number of torch operator calls per step and the sum of
their own (self) CPU time, so that "Python and dispatch" is the step time
minus that sum. Last line: one JSON object {"rows": {"1": {...}, ...}}.

    .venv/bin/python bench/profile.py [--steps 8] [--threads N] [--no-batch-invariant]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from trioserve.kernels import native, reference
from trioserve.kernels.cpu import auto_dtype
from trioserve.kernels.projection import Projection
from trioserve.models import step as step_mod
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk
from trioserve.state.kv_pool import BlockPool

BLOCK = 16
CONTEXT = 256
PROMPT = 512
ROWS = (1, 8, 32)
PARTS = ("build", "projections", "head", "attention", "gather", "norms", "rope", "kv write", "silu")


def _labelled(label: str, fn):
    def wrapper(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return wrapper


@contextmanager
def labels():
    """Wrap the forward's parts in record_function labels for the duration."""
    saved = []

    def patch(owner, name: str, label: str) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, _labelled(label, getattr(owner, name)))

    patch(Projection, "__call__", "projections")
    patch(Projection, "fixed", "projections")
    patch(DecoderModel, "_head", "head")
    patch(reference, "paged_attention", "attention")
    patch(native, "decode_attention", "attention")  # decode rows, where the C kernels are built
    patch(native, "rms_norm", "norms")
    patch(native, "add_rms_norm", "norms")
    patch(native, "silu_mul", "silu")
    patch(native, "rope_write_kv", "rope")  # the K/V store included
    patch(reference, "_gather_blocks", "gather")
    patch(reference, "rms_norm", "norms")
    patch(reference, "apply_rope", "rope")
    patch(reference, "write_kv", "kv write")
    patch(step_mod, "build_step", "build")
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _best(model: DecoderModel, cache, make_chunks, steps: int) -> float:
    """The fastest of ``steps`` steps, in wall seconds, after two to warm up."""
    fixed = model.batch_invariant
    for k in range(2):
        model.forward(step_mod.build_step(make_chunks(k), BLOCK, fixed=fixed), cache)
    best = float("inf")
    for k in range(steps):
        t = time.perf_counter()
        model.forward(step_mod.build_step(make_chunks(k), BLOCK, fixed=fixed), cache)
        best = min(best, time.perf_counter() - t)
    return best


def _run(model: DecoderModel, cache, make_chunks, steps: int) -> tuple[float, dict]:
    """(best step wall seconds without the profiler, {label: seconds per step} with it).
    The parts are those of the layer-by-layer forward: a model whose layers run
    in one C call (kernels/layer_runner.py) is timed that way too
    ("one_call_ms"), then profiled without it."""
    fixed = model.batch_invariant
    runner = model.runner
    one_call = _best(model, cache, make_chunks, steps) if runner is not None else None
    model.runner = None
    best = _best(model, cache, make_chunks, steps)
    with labels(), profile(activities=[ProfilerActivity.CPU]) as prof:
        walls = []
        for k in range(steps):
            t = time.perf_counter()
            batch = step_mod.build_step(make_chunks(k), BLOCK, fixed=fixed)
            model.forward(batch, cache)
            walls.append(time.perf_counter() - t)
    model.runner = runner
    events = prof.key_averages()
    per_step: dict[str, float] = {}
    ops = 0
    self_total = 0.0
    for e in events:
        if e.key in PARTS:
            per_step[e.key] = e.cpu_time_total / 1e6 / steps
        elif e.key.startswith("aten::"):
            ops += e.count
            self_total += e.self_cpu_time_total / 1e6
    wall = sum(walls) / steps
    parts = {p: per_step.get(p, 0.0) for p in PARTS}
    counted = sum(v for p, v in parts.items() if p != "gather")
    parts["rest"] = max(0.0, wall - counted)
    return best, {
        "wall_ms": wall * 1e3,
        "best_unprofiled_ms": best * 1e3,
        "one_call_ms": None if one_call is None else one_call * 1e3,
        "parts_ms": {p: v * 1e3 for p, v in parts.items()},
        "torch_ops": ops / steps,
        "op_self_ms": self_total / steps * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--no-batch-invariant", dest="invariant", action="store_false")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = auto_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    checkpoint = load_checkpoint(args.model, dtype=dtype)
    model = DecoderModel.from_checkpoint(checkpoint, use_int4=True, batch_invariant=args.invariant)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    pool = BlockPool(max(ROWS) * (CONTEXT + 4 * args.steps) // BLOCK + 2 * PROMPT // BLOCK + 64, BLOCK)
    cache = model.new_kv_cache(pool.num_blocks, BLOCK)
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {dtype}, batch_invariant={args.invariant}"
    )
    results = {}
    for rows in ROWS:
        tables = [pool.grow(("d", rows, i), CONTEXT + 4 * args.steps) for i in range(rows)]
        ctx = [torch.randint(3, vocab, (CONTEXT,), generator=gen).tolist() for _ in range(rows)]
        model.forward(step_mod.build_step([SeqChunk(c, 0, t) for c, t in zip(ctx, tables)], BLOCK, fixed=args.invariant), cache)
        offset = [0]

        def decode_chunks(k: int, tables=tables) -> list[SeqChunk]:
            offset[0] += 1
            return [SeqChunk([5 + i], CONTEXT + offset[0] - 1, t, decode=True) for i, t in enumerate(tables)]

        _, results[str(rows)] = _run(model, cache, decode_chunks, args.steps)
        for i in range(rows):
            pool.free_sequence(("d", rows, i))
    prompt = torch.randint(3, vocab, (PROMPT,), generator=gen).tolist()
    table = pool.grow("prefill", PROMPT)
    _, results[f"prefill {PROMPT}"] = _run(model, cache, lambda k: [SeqChunk(prompt, 0, table)], max(2, args.steps // 2))

    head = ["rows", "step ms", "unprofiled ms", "one call ms"] + list(PARTS) + ["rest", "torch ops/step", "op self ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in results.items():
        parts = r["parts_ms"]
        one = r["one_call_ms"]
        cells = [name, f"{r['wall_ms']:.1f}", f"{r['best_unprofiled_ms']:.1f}", "-" if one is None else f"{one:.1f}"]
        cells += [f"{parts[p]:.2f} ({100 * parts[p] / r['wall_ms']:.0f}%)" for p in (*PARTS, "rest")]
        cells += [f"{r['torch_ops']:.0f}", f"{r['op_self_ms']:.1f}"]
        print("| " + " | ".join(cells) + " |")
    print(json.dumps({"batch_invariant": args.invariant, "rows": results}))


if __name__ == "__main__":
    main()
