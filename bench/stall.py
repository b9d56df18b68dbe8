"""How long decoding streams wait while a long prompt is prefilled, with
and without `--max-step-ms`, in process through the real actors.

A few streams decode (short prompts, ``--output`` tokens each, EOS
ignored); once each has its first tokens, one long prompt
(``--prompt-tokens`` random tokens, 1 output token) arrives. Reported per
setting: the decoding streams' longest gap between two tokens and their
99th-percentile gap while the long prompt was being prefilled, their gap
p50 over the whole run, and the long prompt's time to first token.

    .venv/bin/python bench/stall.py [--model smollm2] [--max-step-ms 0 --max-step-ms 250] [--threads 2]

The last line is one JSON object: {"<max_step_ms>": {...}, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import torch
import trio

from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.types import FinalEvent, GenerateRequest, SamplingParams, TokenEvent


async def one_setting(model: str, max_step_ms: float, streams: int, output: int, prompt_tokens: int) -> dict:
    config = EngineConfig(model=model, max_step_ms=max_step_ms, max_num_seqs=max(4, streams + 1))
    gen = torch.Generator().manual_seed(0)
    gaps: list[tuple[float, float]] = []  # (when, gap) of the decoding streams' tokens
    window: dict[str, float] = {}
    async with open_engine(config) as engine:
        vocab = engine.tokenizer.vocab_size
        started = trio.Event()
        firsts = 0

        async def decoder() -> None:
            nonlocal firsts
            prompt = torch.randint(3, vocab, (16,), generator=gen).tolist()
            params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
            last = None
            async for event in engine.generate(GenerateRequest(prompt, params)):
                if isinstance(event, TokenEvent):
                    now = trio.current_time()
                    if last is None:
                        firsts += 1
                        if firsts == streams:
                            started.set()
                    else:
                        gaps.append((now, now - last))
                    last = now

        async def long_prompt() -> None:
            await started.wait()
            await trio.sleep(0.5)  # a few decode steps first
            prompt = torch.randint(3, vocab, (prompt_tokens,), generator=gen).tolist()
            window["start"] = trio.current_time()
            async for event in engine.generate(GenerateRequest(prompt, SamplingParams(max_tokens=1, temperature=0.0))):
                if isinstance(event, TokenEvent) and "end" not in window:
                    window["end"] = trio.current_time()
                if isinstance(event, FinalEvent) and "end" not in window:
                    window["end"] = trio.current_time()

        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(decoder)
            nursery.start_soon(long_prompt)
    during = sorted(gap for when, gap in gaps if window["start"] <= when <= window["end"] + 1e-3)
    return {
        "ttft_s": round(window["end"] - window["start"], 3),
        "gap_max_during_s": round(max(during), 3) if during else None,
        "gap_p99_during_s": round(during[min(len(during) - 1, int(0.99 * len(during)))], 3) if during else None,
        "gap_p50_s": round(statistics.median(g for _, g in gaps), 4),
        "decode_tokens": len(gaps) + streams,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-step-ms", type=float, action="append", help="settings to compare (default: 0, then 250)")
    parser.add_argument("--streams", type=int, default=4, help="decoding streams")
    parser.add_argument("--output", type=int, default=200, help="tokens each decoding stream generates")
    parser.add_argument("--prompt-tokens", type=int, default=3000, help="the long prompt's length")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    settings = args.max_step_ms or [0.0, 250.0]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.model}, {args.streams} streams decoding, a {args.prompt_tokens}-token prompt arrives"
    )
    results = {}
    for ms in settings:
        results[f"{ms:g}"] = trio.run(one_setting, args.model, ms, args.streams, args.output, args.prompt_tokens)
    print("| --max-step-ms | long prompt TTFT s | decoders' longest gap during it s | their gap p99 during it s | gap p50 s |")
    print("|---|---|---|---|---|")
    for ms, r in results.items():
        print(f"| {ms} | {r['ttft_s']} | {r['gap_max_during_s']} | {r['gap_p99_during_s']} | {r['gap_p50_s']} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
