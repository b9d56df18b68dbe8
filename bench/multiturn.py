"""Multi-turn chat, in process: time to first token per turn with the prefix
cache on and off, on the default model through the real actors.

    .venv/bin/python bench/multiturn.py [--sessions 10] [--turns 8] [--max-tokens 32] [--threads N]

This is the stateless-with-prefix-cache part of the sessions benchmark
(the /v1/sessions variant, where the server keeps the conversation, is not
measured here yet): every turn resends the whole conversation so far
(a system message, then alternating user and assistant messages, the
assistant's being the model's own earlier replies) rendered through the
model's chat template, plus a new user message of ~20 words unique to its
conversation and turn. Replies are greedy, ``--max-tokens`` long, EOS
ignored, so histories grow steadily. The conversations run concurrently
(each one's turns in order).

The same conversations run twice, each on a fresh engine (the checkpoint is
loaded once): with EngineConfig(prefix_cache=True), then with
prefix_cache=False. Prompt tokens per turn are each request's own prompt
length (the engine's prompt counters are engine-wide and the conversations
overlap); the prefix-cache hit rate is the engine-wide one of the cache-on
run, its warm-up excluded.

Prints a table (turn, mean prompt tokens, mean TTFT with and without the
cache, their ratio), the hit rate, then as its last line one JSON object:
{"ttft_ms": {"cache": [per-turn means], "no_cache": [...]}, "turn8_ratio": x}
where turn8_ratio is TTFT with / without the cache at turn 8 (at the last
turn when --turns is below 8).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random

import torch
import trio

from trioserve.actors.messages import FinalEvent, GenerateRequest, TokenEvent
from trioserve.config import MIB, EngineConfig
from trioserve.engine import open_engine, resolve_dtype
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.llama import LlamaModel
from trioserve.models.sampling import SamplingParams

SYSTEM = "You are a helpful assistant. Answer briefly and stay on the topic the user raises."
USER_WORDS = 20
WORDS = (
    "river mountain garden window coffee bicycle library engine harbor lantern violin "
    "meadow castle rocket pencil summer winter autumn spring island forest desert valley "
    "bridge market kitchen teacher doctor farmer painter sailor pilot baker poet "
    "orange purple silver golden yellow quiet bright gentle rapid ancient modern simple "
    "travel build write paint cook plant repair measure explain compare describe imagine "
    "history science music weather ocean planet garden recipe journey museum festival "
    "village station theater question answer number letter story picture memory"
).split()


def user_message(session: int, turn: int) -> str:
    """About USER_WORDS words, the same in every run, unique per (session, turn)."""
    rng = random.Random(f"multiturn-{session}-{turn}")
    words = " ".join(rng.choice(WORDS) for _ in range(USER_WORDS - 4))
    return f"Conversation {session}, turn {turn}: {words}?"


async def conversation(engine, template: ChatTemplate, session: int, turns: int, max_tokens: int, out: list) -> None:
    """Run one conversation's turns in order; append (prompt tokens, TTFT s, prompt ids) per turn to ``out``."""
    messages = [{"role": "system", "content": SYSTEM}]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for turn in range(turns):
        messages.append({"role": "user", "content": user_message(session, turn)})
        prompt = engine.tokenizer.encode(template.render(messages, add_generation_prompt=True))
        text, ttft = [], None
        async for event in engine.generate(GenerateRequest(prompt, params, request_id=f"s{session}-t{turn}")):
            if isinstance(event, TokenEvent):
                text.append(event.text)
            elif isinstance(event, FinalEvent):
                if event.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"session {session} turn {turn}: {event.finish_reason}: {event.error}")
                text.append(event.text)
                ttft = event.timings.ttft_s
        out.append((len(prompt), ttft, tuple(prompt)))
        messages.append({"role": "assistant", "content": "".join(text)})


async def one_run(args, checkpoint, model, prefix_cache: bool) -> dict:
    config = EngineConfig(
        model=args.model,
        max_num_seqs=max(args.sessions, 1),
        prefill_budget=max(512, args.sessions + 1),
        kv_cache_bytes=args.kv_cache_mib * MIB,
        prefix_cache=prefix_cache,
    )
    async with open_engine(config, checkpoint=checkpoint, model=model) as engine:
        tok = engine.tokenizer
        template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
        # Warm-up: one unrelated request (shares no prefix with the conversations).
        warm = tok.encode("The quick brown fox jumps over the lazy dog. " * 12)
        async for _ in engine.generate(GenerateRequest(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))):
            pass
        before = engine.statistics()
        per_session: list[list] = [[] for _ in range(args.sessions)]
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for s in range(args.sessions):
                nursery.start_soon(conversation, engine, template, s, args.turns, args.max_tokens, per_session[s])
        elapsed = trio.current_time() - start
        after = engine.statistics()
    hit_rate = None
    if after.prefix is not None:
        queried = after.prefix.query_tokens - before.prefix.query_tokens
        hit = after.prefix.hit_tokens - before.prefix.hit_tokens
        hit_rate = hit / queried if queried else 0.0
    return {
        "sessions": per_session,
        "seconds": elapsed,
        "prefilled": after.prompt_tokens - before.prompt_tokens,
        "hit_rate": hit_rate,
    }


def per_turn(run: dict, turns: int, index: int) -> list[float]:
    """Mean over sessions of field ``index`` of each turn."""
    return [sum(s[t][index] for s in run["sessions"]) / len(run["sessions"]) for t in range(turns)]


async def main_async(args) -> dict:
    checkpoint = await trio.to_thread.run_sync(lambda: load_checkpoint(args.model, dtype=resolve_dtype("auto")))
    model = await trio.to_thread.run_sync(lambda: LlamaModel.from_checkpoint(checkpoint, use_int4=True, device="cpu"))
    cache = await one_run(args, checkpoint, model, prefix_cache=True)
    no_cache = await one_run(args, checkpoint, model, prefix_cache=False)
    return {"cache": cache, "no_cache": no_cache}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sessions", type=int, default=10, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=8, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=32, help="reply length (EOS ignored)")
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.sessions < 1 or args.turns < 1 or args.max_tokens < 1:
        parser.error("--sessions, --turns and --max-tokens must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.sessions} sessions x {args.turns} turns, {args.max_tokens} tokens per reply"
    )
    runs = trio.run(main_async, args)
    cache, no_cache = runs["cache"], runs["no_cache"]
    prompt_tokens = per_turn(cache, args.turns, 0)
    raw_cache, raw_none = per_turn(cache, args.turns, 1), per_turn(no_cache, args.turns, 1)
    ratios = [c / n if n else float("nan") for c, n in zip(raw_cache, raw_none, strict=True)]
    ttft_cache = [round(v * 1000, 1) for v in raw_cache]
    ttft_none = [round(v * 1000, 1) for v in raw_none]
    print("| turn | mean prompt tokens | mean TTFT ms (cache) | mean TTFT ms (no cache) | ratio cache/no cache |")
    print("|---|---|---|---|---|")
    for t in range(args.turns):
        print(f"| {t + 1} | {prompt_tokens[t]:.1f} | {ttft_cache[t]:.1f} | {ttft_none[t]:.1f} | {ratios[t]:.2f} |")
    print(f"# prefix-cache hit rate (cache run, engine-wide): {cache['hit_rate']:.1%}")
    print(
        f"# prompt tokens prefilled: {cache['prefilled']} with the cache, {no_cache['prefilled']} without; "
        f"wall time {cache['seconds']:.1f} s with, {no_cache['seconds']:.1f} s without"
    )
    # Greedy replies may still differ between the runs: which requests share
    # a step depends on timing, and with the cache only a prompt's uncached
    # tail is computed, so the step shapes differ and rounding with them.
    # From the first differing reply on, that conversation's prompts differ.
    diverged = {}
    for s, (sa, sb) in enumerate(zip(cache["sessions"], no_cache["sessions"], strict=True)):
        turns = [t for t, (a, b) in enumerate(zip(sa, sb, strict=True)) if a[2] != b[2]]
        if turns:
            diverged[s] = turns
    if diverged:
        where = ", ".join(f"session {s} from turn {turns[0] + 1}" for s, turns in diverged.items())
        count = sum(len(turns) for turns in diverged.values())
        print(f"# note: {count} of {args.sessions * args.turns} prompts differ between the runs (replies diverged: {where})")
    last = min(8, args.turns) - 1
    print(json.dumps({"ttft_ms": {"cache": ttft_cache, "no_cache": ttft_none}, "turn8_ratio": round(ratios[last], 3)}))


if __name__ == "__main__":
    main()
