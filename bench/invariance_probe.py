"""Where a row's logits change with what shares its step (issue #11's
first measurement): the served configuration (bf16 weights, 4-bit
projections for generated tokens, the default model), one target sequence
with a 100-token prompt, compared bit for bit against itself

- decoding alone vs beside 1, 7 and 31 other decode rows of random lengths;
- its prompt prefilled in one chunk vs in chunks of 64, 37, 16 and 1 tokens
  (a prefix-cache hit or a step's leftover prefill budget splits a prompt
  the same way);
- its prompt prefilled beside 8 decode rows;
- the same chunkings with the fused attention kernel (taken by chunks of 64
  or more queries) switched off, so every chunk takes the matmul path.

    .venv/bin/python bench/invariance_probe.py [--threads 2] [--batch-invariant]

With --batch-invariant the model runs its fixed-order arithmetic (the
server's default since #11) and the last comparisons are replaced by
chunkings at random boundaries and by decode-written vs prefill-written KV.

Prints one line per comparison: the largest absolute logit difference and
whether the logits are bit-identical. Findings: docs/determinism.md.
"""

from __future__ import annotations

import argparse
import random

import torch

import trioserve.kernels.reference as reference
import trioserve.models.step as step_module
from trioserve.kernels.cpu import resolve_dtype
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step
from trioserve.state.kv_pool import BlockPool

BLOCK = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-invariant", action="store_true", help="the fixed-order arithmetic")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint("smollm2", dtype=resolve_dtype("auto"))
    model = DecoderModel.from_checkpoint(checkpoint, use_int4=True, batch_invariant=args.batch_invariant)
    pool = BlockPool(4000, BLOCK)
    cache = model.new_kv_cache(pool.num_blocks, BLOCK)
    rng = random.Random(0)

    def forward(chunks):
        return model.forward(build_step(chunks, BLOCK, fixed=args.batch_invariant), cache).float()

    def prefill(name, ids, chunk):
        pool.free_sequence(name)
        table = pool.grow(name, len(ids) + 8)
        for start in range(0, len(ids), chunk):
            out = forward([SeqChunk(ids[start : start + chunk], start, table)])
        return table, out[-1]

    def report(what, got, want):
        print(f"{what:<48} max |diff| {(got - want).abs().max().item():.3e}  identical={torch.equal(got, want)}")

    target = [rng.randrange(100, 40000) for _ in range(100)]
    table, whole = prefill("target", target, len(target))
    others = []
    for i in range(31):
        ids = [rng.randrange(100, 40000) for _ in range(rng.randrange(5, 300))]
        others.append((ids, prefill(f"other{i}", ids, 512)[0]))

    def decode(n):
        rows = [SeqChunk([7], len(target), table, decode=True)]
        rows += [SeqChunk([7], len(ids), t, decode=True) for ids, t in others[:n]]
        return forward(rows)[0]

    alone = decode(0)
    for n in (1, 7, 31):
        report(f"decode beside {n} decode rows", decode(n), alone)
    for chunk in (64, 37, 16, 1):
        report(f"prefill in chunks of {chunk}", prefill("t", target, chunk)[1], whole)
    pool.free_sequence("t")
    t = pool.grow("t", len(target) + 8)
    mixed = [SeqChunk([7], len(ids), tt, decode=True) for ids, tt in others[:8]] + [SeqChunk(target, 0, t)]
    report("prefill beside 8 decode rows", forward(mixed)[-1], whole)
    if args.batch_invariant:
        fixed_only(rng, target, whole, prefill, forward, report, pool)
        return
    step_module.SDPA_MIN_QUERIES = reference.SDPA_MIN_QUERIES = 10**9
    matmul_whole = prefill("t", target, len(target))[1]
    report("one chunk: matmul path vs fused kernel", matmul_whole, whole)
    for chunk in (64, 37, 16, 1):
        report(f"matmul path only: prefill in chunks of {chunk}", prefill("t", target, chunk)[1], matmul_whole)


def fixed_only(rng, target, whole, prefill, forward, report, pool):
    """Chunk boundaries at random places, and a prompt's second half
    written by decoding token by token vs by prefilling."""
    for trial in range(5):
        cuts = sorted(rng.sample(range(1, len(target)), rng.randrange(1, 6)))
        pool.free_sequence("t")
        t = pool.grow("t", len(target) + 8)
        start = 0
        for end in [*cuts, len(target)]:
            out = forward([SeqChunk(target[start:end], start, t)])[-1]
            start = end
        report(f"prefill cut at {cuts}", out, whole)
    pool.free_sequence("t")
    t = pool.grow("t", len(target) + 8)
    half = len(target) // 2
    forward([SeqChunk(target[:half], 0, t)])
    for pos in range(half, len(target)):
        out = forward([SeqChunk([target[pos]], pos, t, decode=True)])[-1]
    report("second half decoded (4-bit path, differs by design)", out, whole)


if __name__ == "__main__":
    main()
