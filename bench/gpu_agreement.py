"""Greedy agreement between two kernel sets on one device (issue #14):
the real default model answers the same 16 chat prompts (64 tokens each,
temperature 0) with ``--kernels A`` and ``--kernels B``, and this counts the
replies that are token for token the same, and the first differing token's
place in the others.

    .venv/bin/python bench/gpu_agreement.py [--device cuda] [--kernels triton --versus reference] [--tokens 64] [--dtype auto]

Where two replies part, each side's gap between its two likeliest tokens
(log-probabilities) at that place is printed and reported ("gaps"): a gap
of a few thousandths is a near tie that summation order may decide; a gap
of whole units is a bug.

Prints one line per prompt, then as its LAST line one JSON object:
{"device": ..., "dtype": ..., "kernels": [A, B], "prompts": 16, "identical": n, "first_difference": [...], "gaps": [...]}"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trioserve.config import EngineConfig  # noqa: E402
from trioserve.engine import open_engine  # noqa: E402
from trioserve.http.tools import render_prompt_ids  # noqa: E402
from trioserve.models.chat_template import ChatTemplate  # noqa: E402
from trioserve.types import FinalEvent, GenerateRequest, SamplingParams, TokenEvent  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "Write a haiku about the sea.", "What is 12 times 7?", "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?", "List the planets of the solar system.",
    "Translate 'good morning' into Spanish.", "What does a CPU do?", "Give me a synonym for happy.",
    "Why is the sky blue?", "What is the largest ocean on Earth?", "Describe a cat in five words.", "What year did World War II end?",
]  # fmt: skip


Reply = list[tuple[int, float]]  # (token, gap between the two likeliest log-probabilities)


async def answers(kernels: str, device: str, tokens: int, dtype: str) -> list[Reply]:
    config = EngineConfig(model="smollm2", device=device, kernels=kernels, max_num_seqs=16, dtype=dtype)
    async with open_engine(config) as engine:
        tok = engine.tokenizer
        template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
        out: list[Reply] = [[] for _ in QUESTIONS]
        params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=True, top_logprobs=2)

        async def one(i: int) -> None:
            prompt = render_prompt_ids(tok, template, [{"role": "user", "content": QUESTIONS[i]}])
            async for event in engine.generate(GenerateRequest(prompt, params)):
                if isinstance(event, TokenEvent):
                    top = [lp for _, lp in event.top_logprobs]
                    out[i].append((event.token_id, top[0] - top[1] if len(top) > 1 else float("inf")))
                elif isinstance(event, FinalEvent) and event.finish_reason == "error":
                    raise RuntimeError(event.error)

        async with trio.open_nursery() as nursery:
            for i in range(len(QUESTIONS)):
                nursery.start_soon(one, i)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernels", default="triton")
    p.add_argument("--versus", default="reference")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    a = trio.run(answers, args.kernels, args.device, args.tokens, args.dtype)
    b = trio.run(answers, args.versus, args.device, args.tokens, args.dtype)
    first: list[int | None] = []
    gaps: list[list[float] | None] = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        at = next((j for j, (s, t) in enumerate(zip(x, y)) if s[0] != t[0]), None if len(x) == len(y) else min(len(x), len(y)))
        first.append(at)
        gap = None if at is None or at >= min(len(x), len(y)) else [round(x[at][1], 5), round(y[at][1], 5)]
        gaps.append(gap)
        print(f"{i:2} {'same' if at is None else f'differs at token {at} (gaps {gap})'}: {QUESTIONS[i]}", flush=True)
    print(json.dumps({"device": args.device, "dtype": args.dtype, "kernels": [args.kernels, args.versus], "prompts": len(QUESTIONS),
                      "identical": sum(at is None for at in first), "first_difference": first, "gaps": gaps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
