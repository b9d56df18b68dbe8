"""Guided decoding overhead: output tokens/s with 1 and 32 concurrent
requests constrained by a JSON schema, against the same requests
unconstrained, on the default model through the real actors.

    .venv/bin/python bench/guided.py [--concurrency 1 --concurrency 32] [--tokens 64] [--rounds 2] [--threads N]

Every request has the same short chat prompt, greedy sampling, EOS ignored
and ``--tokens`` output tokens. The constraint is a JSON array of at least
100 objects {"city": string, "temp": number, "rain": boolean}: it cannot end
before max_tokens, so both runs produce the same number of tokens, and it
keeps the matcher busy with strings, numbers and keys (the masks are
computed in a thread while each forward pass runs). Unconstrained and
constrained rounds alternate, ``--rounds`` of each, on one engine; the
figure is the best round of each.

Prints a table, then as its last line one JSON object:
{"tokens_per_s": {"free": {...}, "guided": {...}}, "loss": {"1": x, "32": y}}
where loss = 1 - guided / free at that concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch
import trio

from trioserve.types import FinalEvent, GenerateRequest
from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.guided import GuideSpec
from trioserve.types import SamplingParams

SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "temp": {"type": "number"}, "rain": {"type": "boolean"}},
        "required": ["city", "temp", "rain"],
        "additionalProperties": False,
    },
}
QUESTION = "List the weather in many cities as JSON."


async def one_round(engine, prompt: list[int], concurrency: int, tokens: int, guided: bool) -> float:
    """``concurrency`` requests at once; returns output tokens/s."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    guides = await trio.to_thread.run_sync(engine.guides.guides, GuideSpec("json_schema", SCHEMA), concurrency) if guided else [None] * concurrency
    produced = 0

    async def one(i: int) -> None:
        nonlocal produced
        async for event in engine.generate(GenerateRequest(prompt, params, guide=guides[i])):
            if isinstance(event, FinalEvent):
                if event.finish_reason != "length":
                    raise RuntimeError(f"request {i} ended with {event.finish_reason}: {event.error}")
                produced += event.usage.completion_tokens

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(one, i)
    return produced / (trio.current_time() - start)


async def main_async(args) -> dict:
    config = EngineConfig(model=args.model, max_num_seqs=max(args.concurrency), prefill_budget=max(512, max(args.concurrency) + 1), prefix_cache=False)
    results: dict[str, dict[int, float]] = {"free": {}, "guided": {}}
    async with open_engine(config) as engine:
        tok = engine.tokenizer
        template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
        prompt = tok.encode(template.render([{"role": "user", "content": QUESTION}], add_generation_prompt=True))
        await one_round(engine, prompt, 2, 8, guided=True)  # warm-up, both paths
        for n in args.concurrency:
            for _ in range(args.rounds):
                for mode in ("free", "guided"):
                    rate = await one_round(engine, prompt, n, args.tokens, mode == "guided")
                    results[mode][n] = max(results[mode].get(n, 0.0), rate)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", type=int, action="append", help="repeatable (default 1 and 32)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.concurrency = args.concurrency or [1, 32]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; {args.tokens} tokens per request")
    results = trio.run(main_async, args)
    print("| concurrent | free tok/s | guided tok/s | loss |")
    print("|---|---|---|---|")
    loss = {}
    for n in args.concurrency:
        free, guided = results["free"][n], results["guided"][n]
        loss[str(n)] = round(1 - guided / free, 3)
        print(f"| {n} | {free:.1f} | {guided:.1f} | {loss[str(n)]:.1%} |")
    rounded = {mode: {str(n): round(v, 1) for n, v in r.items()} for mode, r in results.items()}
    print(json.dumps({"tokens_per_s": rounded, "loss": loss}))


if __name__ == "__main__":
    main()
