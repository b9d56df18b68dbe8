"""Multi-turn chat through the real HTTP server: time to first token per turn
for sessions, for stateless requests with the prefix cache, and with the
cache off, on the default model.

    .venv/bin/python bench/multiturn.py [--sessions 10] [--turns 8] [--max-tokens 32] [--threads N]

Each conversation has a system message and, every turn, a new user message
of ~20 words unique to its conversation and turn; replies are greedy,
``--max-tokens`` long, EOS ignored, so histories grow steadily. The
conversations run concurrently (each one's turns in order), in three modes,
each on a fresh server (127.0.0.1, a free port) over the same loaded
checkpoint:

- sessions: POST /v1/sessions once, then POST /v1/sessions/{id}/turns with
  only the new message; the server keeps the history and its KV;
- stateless: POST /v1/chat/completions with the whole conversation so far
  (the model's own earlier replies included), prefix cache on;
- no cache: the same stateless requests, server started with the prefix
  cache off.

TTFT is measured by the client: from sending the streamed request to the
first chunk carrying a token. Prompt tokens per turn come from each
response's usage. Prints a table (turn, mean prompt tokens, mean TTFT per
mode, ratios to no cache), then as its last line one JSON object:
{"ttft_ms": {"sessions": [...], "stateless": [...], "no_cache": [...]},
 "turn8_ratio": {"sessions": x, "stateless": y}} (at the last turn when
--turns is below 8).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import attrs
import httpx
import torch
import trio

from trioserve.config import MIB, EngineConfig, ServerSettings
from trioserve.kernels.cpu import resolve_dtype
from trioserve.http.serve import serve_app
from trioserve.models.checkpoint import load_checkpoint

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
MODES = ("sessions", "stateless", "no_cache")


def user_message(session: int, turn: int) -> str:
    """About USER_WORDS words, the same in every run, unique per (session, turn)."""
    rng = random.Random(f"multiturn-{session}-{turn}")
    words = " ".join(rng.choice(WORDS) for _ in range(USER_WORDS - 4))
    return f"Conversation {session}, turn {turn}: {words}?"


async def streamed(client: httpx.AsyncClient, path: str, body: dict) -> tuple[str, float, int]:
    """POST a streamed request: (reply text, seconds to the first token, prompt tokens)."""
    start = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage = None
    async with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{path}: {response.status_code} {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"{path}: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                content = choice["delta"].get("content")
                if content is not None and "role" not in choice["delta"]:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(content)
    if ttft is None or usage is None:
        raise RuntimeError(f"{path}: the stream ended without a token or usage")
    return "".join(text), ttft, usage["prompt_tokens"]


async def conversation(client, mode: str, session: int, turns: int, max_tokens: int, out: list) -> None:
    """One conversation's turns in order; appends (prompt tokens, TTFT s) per turn to ``out``."""
    settings = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    sid = None
    if mode == "sessions":
        created = await client.post("/v1/sessions", json={"system": SYSTEM, **settings})
        created.raise_for_status()
        sid = created.json()["id"]
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        question = {"role": "user", "content": user_message(session, turn)}
        if sid is not None:
            reply, ttft, prompt = await streamed(client, f"/v1/sessions/{sid}/turns", {"messages": [question]})
        else:
            messages.append(question)
            reply, ttft, prompt = await streamed(client, "/v1/chat/completions", {"messages": messages, **settings})
            messages.append({"role": "assistant", "content": reply})
        out.append((prompt, ttft))


async def one_mode(args, checkpoint, mode: str) -> dict:
    engine = EngineConfig(
        model=args.model,
        max_num_seqs=max(args.sessions, 1),
        prefill_budget=max(512, args.sessions + 1),
        kv_cache_bytes=args.kv_cache_mib * MIB,
        prefix_cache=mode != "no_cache",
    )
    settings = attrs.evolve(ServerSettings(engine=engine), host="127.0.0.1", port=0, log_level="warning")
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(lambda task_status: serve_app(settings, checkpoint=checkpoint, task_status=task_status))
        url = next(u for u in urls if u.startswith("http://127.0.0.1:"))
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
            # Warm-up: one unrelated request (it shares no prefix with the conversations).
            warm = {"prompt": "The quick brown fox jumps over the lazy dog. " * 12, "max_tokens": 4, "ignore_eos": True}
            (await client.post("/v1/completions", json=warm)).raise_for_status()
            per_session: list[list] = [[] for _ in range(args.sessions)]
            start = time.perf_counter()
            async with trio.open_nursery() as conversations:
                for s in range(args.sessions):
                    conversations.start_soon(conversation, client, mode, s, args.turns, args.max_tokens, per_session[s])
            elapsed = time.perf_counter() - start
            stats = (await client.get("/metrics")).json()
        nursery.cancel_scope.cancel()
    return {"sessions": per_session, "seconds": elapsed, "prefix": stats["prefix_cache"], "prompt_tokens": stats["prompt_tokens"]}


def per_turn(run: dict, turns: int, index: int) -> list[float]:
    """Mean over conversations of field ``index`` of each turn."""
    return [sum(s[t][index] for s in run["sessions"]) / len(run["sessions"]) for t in range(turns)]


async def main_async(args) -> dict:
    checkpoint = await trio.to_thread.run_sync(lambda: load_checkpoint(args.model, dtype=resolve_dtype("auto")))
    return {mode: await one_mode(args, checkpoint, mode) for mode in MODES}


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
        f"{args.sessions} conversations x {args.turns} turns, {args.max_tokens} tokens per reply"
    )
    runs = trio.run(main_async, args)
    ttft = {mode: [round(v * 1000, 1) for v in per_turn(runs[mode], args.turns, 1)] for mode in MODES}
    prompts = {mode: per_turn(runs[mode], args.turns, 0) for mode in MODES}
    none = ttft["no_cache"]
    print("| turn | mean prompt tokens | TTFT ms sessions | TTFT ms stateless + cache | TTFT ms no cache | sessions / no cache | stateless / no cache |")
    print("|---|---|---|---|---|---|---|")
    for t in range(args.turns):
        print(
            f"| {t + 1} | {prompts['sessions'][t]:.1f} | {ttft['sessions'][t]:.1f} | {ttft['stateless'][t]:.1f} | {none[t]:.1f} "
            f"| {ttft['sessions'][t] / none[t]:.2f} | {ttft['stateless'][t] / none[t]:.2f} |"
        )
    for mode in MODES:
        run = runs[mode]
        p = run["prefix"]
        hits = f", prefix-cache hit rate {p['hit_rate']:.1%}" if p else ""
        print(f"# {mode}: wall {run['seconds']:.1f} s, prompt tokens prefilled {run['prompt_tokens']}{hits}")
    last = min(8, args.turns) - 1
    ratios = {mode: round(ttft[mode][last] / none[last], 3) for mode in ("sessions", "stateless")}
    print(json.dumps({"ttft_ms": ttft, "turn8_ratio": ratios}))


if __name__ == "__main__":
    main()
