"""Speculative decoding (--speculative ngram) against plain decoding, in
process, on the default model: one request at a time, greedy, 128 tokens
ignoring EOS, for two kinds of prompt -- free chat answers, and answers that
copy from the prompt (where prompt lookup has something to find) -- in
alternating rounds on one engine per setting, best round each.

Prints a table of output tokens/s, the share of draft tokens kept and the
speed-up, then as its last line one JSON object:
{"tokens_per_s": {"chat": {"off": x, "ngram": y}, "copy": {...}}, "accepted": {...}, "speedup": {...}}

    .venv/bin/python bench/speculative.py [--rounds 2] [--tokens 4] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import trio

from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.kernels.cpu import resolve_dtype
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import load_checkpoint
from trioserve.types import GenerateRequest, SamplingParams, TokenEvent

CHAT = [
    "Write a Python function that computes the factorial of a number, with a docstring.",
    "Explain photosynthesis in simple terms.",
    "List the planets of the solar system with one fact each.",
]
PASSAGE = (
    "The committee met on Tuesday to review the budget. It approved funding for the new library, "
    "postponed the decision on the bridge repairs, and asked the city engineer to report on the "
    "water main project by the end of the month."
)
COPY = [
    f"Repeat this text exactly, word for word:\n\n{PASSAGE}",
    f"Fix the spelling in this text and write it out again in full:\n\n{PASSAGE.replace('budget', 'budjet')}",
    f"Rewrite this text as a bulleted list, keeping the wording:\n\n{PASSAGE}",
]


async def round_tokens_per_s(engine, requests) -> float:
    tokens = 0
    started = time.perf_counter()
    for request in requests:
        async for event in engine.generate(request):
            tokens += isinstance(event, TokenEvent)
    return tokens / (time.perf_counter() - started)


async def measure(args) -> dict:
    checkpoint = load_checkpoint("smollm2", dtype=resolve_dtype("auto"))
    tok = checkpoint.tokenizer
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    params = SamplingParams(max_tokens=128, temperature=0.0, seed=1, ignore_eos=True)
    kinds = {
        name: [GenerateRequest(tok.encode(template.render([{"role": "user", "content": q}])), params) for q in prompts]
        for name, prompts in (("chat", CHAT), ("copy", COPY))
    }
    best = {kind: {"off": 0.0, "ngram": 0.0} for kind in kinds}
    accepted = {}
    for mode in ("off", "ngram"):
        config = EngineConfig(max_num_seqs=4, kv_cache_bytes=64 << 20, speculative=mode, speculative_tokens=args.tokens)
        async with open_engine(config, checkpoint=checkpoint) as engine:
            await round_tokens_per_s(engine, kinds["chat"][:1])  # warm-up
            for _ in range(args.rounds):
                for kind, requests in kinds.items():
                    before = engine.statistics()
                    rate = await round_tokens_per_s(engine, requests)
                    after = engine.statistics()
                    best[kind][mode] = max(best[kind][mode], rate)
                    if mode == "ngram":
                        drafted = after.draft_tokens - before.draft_tokens
                        accepted[kind] = (after.draft_accepted - before.draft_accepted) / drafted if drafted else 0.0
    return {
        "tokens_per_s": {k: {m: round(v, 1) for m, v in modes.items()} for k, modes in best.items()},
        "accepted": {k: round(v, 3) for k, v in accepted.items()},
        "speedup": {k: round(modes["ngram"] / modes["off"], 2) for k, modes in best.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4, help="--speculative-tokens")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    result = trio.run(measure, args)
    print("| prompts | off tok/s | ngram tok/s | speed-up | draft tokens kept |")
    print("|---|---|---|---|---|")
    for kind, modes in result["tokens_per_s"].items():
        print(f"| {kind} | {modes['off']} | {modes['ngram']} | {result['speedup'][kind]}x | {result['accepted'][kind]:.0%} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
