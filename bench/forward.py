"""Forward-pass throughput of the default model on this machine.

Measures prefill tokens/s for one 512-token prompt and for a 2,048-token
prompt in four 512-token chunks (as the server's step budget cuts it), and
decode tokens/s at 1, 8 and 32 sequences with 256 tokens of context each,
through the same paged forward the server uses. A variant ending in
"+invariant" runs the batch-invariant arithmetic (the server's default). Runs each variant given in one process, so the choice of
serving dtype and of 4-bit weights is a measurement, not a guess. Prints a table, then as its last
line one JSON object for the first dtype:
{"prefill_tokens_per_s": x, "long_prefill_tokens_per_s": y, "decode_tokens_per_s": {"1": a, "8": b, "32": c}}

    .venv/bin/python bench/forward.py [--variant bfloat16+int4+invariant --variant bfloat16+int4 ...] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from trioserve.kernels.cpu import resolve_dtype
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step
from trioserve.state.kv_pool import BlockPool

BLOCK = 16
PROMPT = 512
CONTEXT = 256
BATCHES = (1, 8, 32)
LONG_PROMPT = 2048
# bfloat16+int4+invariant+int8act: what the server runs by default on a CPU
# with AVX-512 VNNI (--activations auto), bfloat16+int4+invariant elsewhere (4-bit weights for
# generated tokens, batch-invariant arithmetic); without "+invariant":
# --no-batch-invariant; "+int8act": --activations int8. float32+int4+invariant+int8act:
# what a CPU without native bf16 runs by default (AVX2: TRIOSERVE_CPU_FEATURES=avx2
# runs that path on a wider CPU, with ATEN_CPU_CAPABILITY=avx2 for torch's own).
VARIANTS = (
    "bfloat16+int4+invariant", "bfloat16+int4+invariant+int8act", "bfloat16+int4", "bfloat16+invariant", "bfloat16",
    "float32+invariant", "float32", "float32+int4+invariant", "float32+int4+invariant+int8act",
)


def measure(model: DecoderModel, *, decode_steps: int, repeats: int) -> dict:
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    fixed = model.batch_invariant
    pool = BlockPool(max(BATCHES) * (CONTEXT + decode_steps + BLOCK) // BLOCK + LONG_PROMPT // BLOCK + 8, BLOCK)
    cache = model.new_kv_cache(pool.num_blocks, BLOCK)

    prompt = torch.randint(3, vocab, (PROMPT,), generator=gen).tolist()
    table = pool.grow("prefill", PROMPT)
    step = build_step([SeqChunk(prompt, 0, table)], BLOCK, fixed=fixed)
    model.forward(step, cache)  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.forward(step, cache)
        times.append(time.perf_counter() - t)
    prefill = PROMPT / min(times)
    pool.free_sequence("prefill")

    long_prompt = torch.randint(3, vocab, (LONG_PROMPT,), generator=gen).tolist()
    table = pool.grow("long", LONG_PROMPT)
    chunks = [build_step([SeqChunk(long_prompt[s : s + PROMPT], s, table)], BLOCK, fixed=fixed) for s in range(0, LONG_PROMPT, PROMPT)]
    best_long = float("inf")
    for _ in range(max(1, repeats - 1)):
        t = time.perf_counter()
        for chunk in chunks:
            model.forward(chunk, cache)
        best_long = min(best_long, time.perf_counter() - t)
    pool.free_sequence("long")

    decode = {}
    for batch in BATCHES:
        tables = [pool.grow(("d", batch, i), CONTEXT + decode_steps) for i in range(batch)]
        ctx = [torch.randint(3, vocab, (CONTEXT,), generator=gen).tolist() for _ in range(batch)]
        model.forward(build_step([SeqChunk(c, 0, t) for c, t in zip(ctx, tables)], BLOCK, fixed=fixed), cache)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for k in range(decode_steps):
                chunks = [SeqChunk([5 + i], CONTEXT + k, t, decode=True) for i, t in enumerate(tables)]
                model.forward(build_step(chunks, BLOCK, fixed=fixed), cache)
            best = min(best, time.perf_counter() - t0)
        decode[str(batch)] = batch * decode_steps / best
        for i in range(batch):
            pool.free_sequence(("d", batch, i))
    return {
        "prefill_tokens_per_s": round(prefill, 1),
        "long_prefill_tokens_per_s": round(LONG_PROMPT / best_long, 1),
        "decode_tokens_per_s": {k: round(v, 1) for k, v in decode.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--variant",
        action="append",
        choices=VARIANTS,
        help="what to run (repeatable; the first one's figures are the JSON line). Default: bfloat16+int4+invariant",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = args.variant or ["bfloat16+int4+invariant"]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = {}
    for name in dtypes:
        dtype, *extras = name.split("+")
        checkpoint = load_checkpoint(args.model, dtype=resolve_dtype(dtype))
        model = DecoderModel.from_checkpoint(
            checkpoint, use_int4="int4" in extras, batch_invariant="invariant" in extras, activations="int8" if "int8act" in extras else "bf16"
        )
        results[name] = measure(model, decode_steps=args.decode_steps, repeats=args.repeats)
        del model, checkpoint
    print(f"| variant | prefill {PROMPT} tok/s | prefill {LONG_PROMPT} tok/s | " + " | ".join(f"decode x{b} tok/s" for b in BATCHES) + " |")
    print("|---|---|---|" + "---|" * len(BATCHES))
    for name, r in results.items():
        cells = " | ".join(f"{r['decode_tokens_per_s'][str(b)]:.1f}" for b in BATCHES)
        print(f"| {name} | {r['prefill_tokens_per_s']:.1f} | {r['long_prefill_tokens_per_s']:.1f} | {cells} |")
    if len(results) > 1:
        first, *rest = dtypes
        for other in rest:
            ratio = {b: results[first]["decode_tokens_per_s"][str(b)] / results[other]["decode_tokens_per_s"][str(b)] for b in BATCHES}
            print(f"# decode speed {first}/{other}: " + ", ".join(f"x{b}: {r:.2f}" for b, r in ratio.items()))
    print(json.dumps(results[dtypes[0]]))


if __name__ == "__main__":
    main()
