"""Embeddings per second through the real HTTP server (issue #13).

    .venv/bin/python bench/embeddings.py [--model smollm2] [--levels 1 8 32]
        [--tokens 128] [--rounds 4] [--threads N] [--base-url URL] [--server-arg ARG ...]

Starts `trioserve serve --model MODEL` on 127.0.0.1 (a free port) unless
``--base-url`` names a running server, waits for /health, warms up, then
for each level C measures two ways of asking for C embeddings of inputs of
``--tokens`` tokens each:

- concurrent: C clients, each posting one-input requests back to back,
  ``--rounds`` requests each (C x rounds embeddings in all);
- batched: one client posting requests of C inputs each, ``--rounds`` of
  them one after another.

Every input is distinct random text of common English words, one token
each in SmolLM2's vocabulary, so it is --tokens tokens long (the server's
usage.prompt_tokens is reported to confirm it). Per way and level:
embeddings per second (embeddings / wall time), request latency p50 and
p99 (nearest rank), mean prompt tokens per input, errors. Prints a table,
then as its LAST line one JSON object of every row.

The client runs on the same machine as the server: on 2 cores it takes some
of their time, and the figures are noisy."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for the sibling scripts
from serve import WORDS  # noqa: E402  one token each, with a leading space
from soak import stop_server, wait_ready  # noqa: E402  bench/soak.py: server handling


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(p / 100 * len(ordered)))) - 1]


def text_of(rng: random.Random, tokens: int) -> str:
    """Distinct text of about ``tokens`` tokens: the first word has no
    leading space, every other word is one token."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


class Tally:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.embeddings = 0
        self.prompt_tokens = 0
        self.errors: list[str] = []

    async def post(self, http: httpx.AsyncClient, inputs: list[str]) -> None:
        start = time.perf_counter()
        try:
            response = await http.post("/v1/embeddings", json={"input": inputs})
        except httpx.HTTPError as exc:
            self.errors.append(repr(exc))
            return
        if response.status_code != 200:
            self.errors.append(f"{response.status_code}: {response.text[:200]}")
            return
        body = response.json()
        self.latencies.append(time.perf_counter() - start)
        self.embeddings += len(body["data"])
        self.prompt_tokens += body["usage"]["prompt_tokens"]


async def measure(http: httpx.AsyncClient, way: str, level: int, args, rng: random.Random) -> dict:
    tally = Tally()
    start = time.perf_counter()
    if way == "concurrent":

        async def client() -> None:
            for _ in range(args.rounds):
                await tally.post(http, [text_of(rng, args.tokens)])

        async with trio.open_nursery() as nursery:
            for _ in range(level):
                nursery.start_soon(client)
    else:
        for _ in range(args.rounds):
            await tally.post(http, [text_of(rng, args.tokens) for _ in range(level)])
    wall = time.perf_counter() - start
    ms = lambda x: None if x is None else round(1000 * x, 1)  # noqa: E731
    return {
        "way": way,
        "level": level,
        "embeddings": tally.embeddings,
        "embeddings_per_s": round(tally.embeddings / wall, 2),
        "latency_ms": {"p50": ms(percentile(tally.latencies, 50)), "p99": ms(percentile(tally.latencies, 99))},
        "tokens_per_input": round(tally.prompt_tokens / tally.embeddings, 1) if tally.embeddings else None,
        "errors": len(tally.errors),
        "first_error": tally.errors[0] if tally.errors else None,
    }


async def run(args) -> list[dict]:
    proc = None
    url = args.base_url
    if url is None:
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        exe = Path(sys.executable).with_name("trioserve")
        cmd = [str(exe), "serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        cmd += args.server_arg
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"server pid {proc.pid}: {' '.join(cmd[1:])}", flush=True)
        url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as http:
            await wait_ready(http, proc, args.ready_timeout)
            rng = random.Random(args.seed)
            for _ in range(2):  # warm-up: kernels built, shapes seen
                await Tally().post(http, [text_of(rng, args.tokens) for _ in range(4)])
            for level in args.levels:
                for way in ("concurrent", "batched"):
                    row = await measure(http, way, level, args, rng)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--base-url", default=None, help="a running server (default: start one)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=128, help="tokens per input (default 128)")
    p.add_argument("--rounds", type=int, default=4, help="requests per client (concurrent) or in all (batched)")
    p.add_argument("--threads", type=int, default=None, help="the server's --threads (default: torch's choice)")
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for `trioserve serve`")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    args = p.parse_args()
    rows = trio.run(run, args)
    print("\n| way | inputs at once | embeddings/s | latency p50 ms | latency p99 ms | tokens/input | errors |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        lat = r["latency_ms"]
        print(f"| {r['way']} | {r['level']} | {r['embeddings_per_s']} | {lat['p50']} | {lat['p99']} | {r['tokens_per_input']} | {r['errors']} |")
    print(json.dumps(rows))
    return 0 if all(r["embeddings"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
