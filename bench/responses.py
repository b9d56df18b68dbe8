"""What the Responses API costs over chat completions (issue #13's
benchmark): one trioserve server, the same streaming load through
POST /v1/chat/completions and POST /v1/responses, level after level in
turns (chat, responses, chat, responses, ...), so that both meet the same
machine. Prints each round, a table of the medians, and as its LAST line one
JSON object:
{"concurrency": C, "rounds": R, "chat": {...}, "responses": {...}, "overhead": x}
where overhead = 1 - responses tokens/s / chat tokens/s (the target is at
most 0.05).

    .venv/bin/python bench/responses.py [--concurrency 8] [--rounds 3] \\
        [--requests 16] [--max-tokens 128] [--prompt-tokens 128] [--model smollm2] [--threads 2]

Run it on a quiet machine: nothing else may use the cores."""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compare import Server, default_trioserve_cmd, expand, machine, resolve_model, wait_ready  # noqa: E402
from bench.serve import find_model, run_level  # noqa: E402

ROUTES = ("chat", "responses")


async def rounds(args, server: Server) -> dict[str, list]:
    limits = httpx.Limits(max_connections=args.concurrency + 1, max_keepalive_connections=args.concurrency + 1)
    timeout = httpx.Timeout(args.timeout, connect=30.0, pool=args.timeout)
    results: dict[str, list] = {route: [] for route in ROUTES}
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await wait_ready(client, server, 300.0)
        base = dict(api=server.base_url + "/v1", model=None, seed=0, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, timeout=args.timeout)
        model = await find_model(client, SimpleNamespace(**base, requests=1))
        for route in ROUTES:  # warm both paths (templates, caches, first-call costs)
            await run_level(client, SimpleNamespace(**{**base, "max_tokens": 8}, requests=1, route=route), model, secrets.token_hex(4), 1)
        for number in range(args.rounds):
            for route in ROUTES if number % 2 == 0 else reversed(ROUTES):
                load = SimpleNamespace(**base, requests=args.requests, route=route)
                level = await run_level(client, load, model, secrets.token_hex(4), args.concurrency)
                if level.errors:
                    raise SystemExit(f"{route}: {level.errors} requests failed ({[r.error for r in level.results if r.error][:3]})")
                results[route].append(level)
                print(f"round {number + 1} {route:9}: {level.tokens_per_s:7.1f} tok/s  TTFT p50 {level.ttft_ms(50):7.1f} ms  ITL p50 {level.itl_ms(50):5.1f} ms", flush=True)
    return results


def summary(levels: list) -> dict:
    return {
        "tokens_per_s": round(statistics.median(lv.tokens_per_s for lv in levels), 1),
        "ttft_p50_ms": round(statistics.median(lv.ttft_ms(50) for lv in levels), 1),
        "itl_p50_ms": round(statistics.median(lv.itl_ms(50) for lv in levels), 2),
        "itl_p99_ms": round(statistics.median(lv.itl_ms(99) for lv in levels), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16, help="requests per level (default 16)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="trioserve-bench-")) / "server.log"
    argv_ = expand(default_trioserve_cmd(), port=args.port, model=resolve_model(args.model), threads=args.threads)
    server = Server("trioserve", argv_, args.port, log)
    print(f"machine: {machine()}\nserver: {' '.join(argv_)}", flush=True)
    server.start()
    try:
        results = trio.run(rounds, args, server)
    finally:
        server.stop()
    chat, responses = summary(results["chat"]), summary(results["responses"])
    overhead = 1.0 - responses["tokens_per_s"] / chat["tokens_per_s"]
    print()
    print(f"medians of {args.rounds} rounds at {args.concurrency} streams, {args.requests} requests, {args.max_tokens} tokens each:")
    print("| route | tokens/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|")
    for name, row in (("chat/completions", chat), ("responses", responses)):
        print(f"| {name} | {row['tokens_per_s']} | {row['ttft_p50_ms']} | {row['itl_p50_ms']} | {row['itl_p99_ms']} |")
    print(f"overhead (1 - responses/chat tokens/s): {overhead:+.3f}")
    print(json.dumps({"concurrency": args.concurrency, "rounds": args.rounds, "chat": chat, "responses": responses, "overhead": round(overhead, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
