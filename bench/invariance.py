"""What batch invariance costs and whether it holds, over HTTP (issue #11):
tokens/s at 1 and 32 concurrent requests with ``--batch-invariant`` on and
off, and the share of seeded sampled requests whose output is identical
alone and in a crowd, in one run.

    .venv/bin/python bench/invariance.py [--trials 100] [--threads 2] [--levels 1 32] \\
        [--requests-per-level N] [--target-tokens 48] [--modes on off] [--rounds 2] [--port-base P]

Servers. Every measurement runs against a fresh ``trioserve serve --model
smollm2`` subprocess on 127.0.0.1 (a free port, or ``--port-base``, +1 per
start), the same settings for both modes (``--threads``, default 2) except
``--batch-invariant`` / ``--no-batch-invariant``; the mode is checked in the
``/v1/models`` card. A server is always stopped (SIGTERM, then kill) when its
part is done, on an error or on Ctrl-C. Its log goes to a temporary folder,
kept and named when something failed.

Throughput. bench/serve.py's workload through its own ``run_level``: N
workers keep N streaming chat requests in flight, each a unique ~100-word
prompt (``--prompt-tokens``; the chat template adds SmolLM2's system prompt,
the table shows the server's count), ``--max-tokens`` output tokens (128),
``ignore_eos``, temperature 0; tokens/s = output tokens / the level's wall
time. Each level runs ``--requests-per-level`` requests (default 2 x the
level, at least 4; never fewer than the level). Short warm-up requests (1
alone, then 4 at once, 16 tokens) come first on every server.

Order (against drift on a shared machine). Round 1 runs the modes in the
order given (on, off): each server measures the levels, then the identity
trials. Rounds 2.. (``--rounds``, default 2) start a fresh server per mode
again, in reversed order every other round (off, on), and measure the
levels only. Each figure is the best of its rounds; the cost at a level is
1 - on / off of those best figures. So with the defaults the servers run
on, off, off, on: a drift over the run hits both modes alike.

Identity trials (round 1, per mode). ``--trials`` T seeded requests
(temperature 1, seed, buffered chat, a prompt of 5-150 random words,
``--target-tokens`` 48, EOS honoured) — the same T requests for both modes.
Each runs twice, compared on the full text and the finish_reason:

- alone: one at a time, sent only when the server's /metrics shows nothing
  running or waiting;
- crowded: ``--crowd`` (31) closed-loop workers keep random streaming
  requests in flight (10-300 words, 16-128 tokens, EOS ignored, half greedy
  and half sampled at temperature 1), and up to ``--overlap`` (8) targets at
  once are sent into it. A target is sent only when all crowd workers have a
  request open and /metrics shows at least ``--crowd`` sequences running, so
  with max-num-seqs 32 each target shares its steps with 31 other rows
  (crowd or other targets; with 31 + 8 requests open some wait in the queue,
  which refills a freed slot at once). /metrics is polled every 0.2 s while
  the crowd runs; the report gives the fewest and the mean number of
  sequences seen running while any target was open (32 = every slot full;
  fewer = finished crowd requests not yet replaced in the engine).

The alone run of a prompt leaves its whole blocks in the prefix cache, so
the second run of it reuses them and prefills only the tail. To cover both
paths, the even-numbered trials run alone before the crowd (their crowded
run prefills in the crowd from the cached prefix) and the odd-numbered ones
alone after it (their crowded run prefills the whole prompt among the crowd,
chunked by what budget the step had left; their alone run may then hit the
cache). Both are covered by the guarantee (docs/determinism.md).

Output: a markdown table (mode, tok/s per level, cost of on vs off per
level, identical n/T), then as its LAST line one JSON object:
{"tokens_per_s": {"on": {"1": a, "32": b}, "off": {...}}, "identical": {"on": n, "off": m},
 "trials": T, "cost": {"1": c1, "32": c32}}
(cost only when both modes ran). Exit status 0 when the run completed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for the sibling scripts
from serve import WORDS, one_request, run_level  # noqa: E402  bench/serve.py: the load generator
from soak import free_port, get_metrics, stop_server, wait_ready  # noqa: E402  bench/soak.py: server handling

ERROR_SNIPPET = 200
MAX_NUM_SEQS = 32  # the server's default --max-num-seqs: no more sequences run at once


# ---------------------------------------------------------------- servers


@contextlib.contextmanager
def server(args, mode: str, label: str):
    """A fresh server in ``mode`` ('on' / 'off'); yields its base URL."""
    port = args.port_base + args.starts if args.port_base else free_port()
    args.starts += 1
    exe = Path(sys.executable).with_name("trioserve")
    cmd = [str(exe), "serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(args.threads), "--drain-timeout", "5", "--log-level", "warning",
           "--batch-invariant" if mode == "on" else "--no-batch-invariant"]
    log_path = args.log_dir / f"{label}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        print(f"[{label}] server pid {proc.pid} on port {port}: {' '.join(cmd[1:])}", flush=True)
        yield f"http://127.0.0.1:{port}", proc
    except BaseException:
        args.keep_logs = True
        raise
    finally:
        stop_server(proc)


async def ready(http: httpx.AsyncClient, proc: subprocess.Popen, mode: str, args) -> str:
    """Wait for /health, check the mode in the model card; the model id."""
    await wait_ready(http, proc, args.ready_timeout)
    card = (await http.get("/v1/models", timeout=30)).json()["data"][0]
    if card.get("batch_invariant") is not (mode == "on"):
        raise RuntimeError(f"asked for batch invariance {mode}, the model card says batch_invariant={card.get('batch_invariant')!r}")
    return card["id"]


def http_client(url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0, connect=30.0))


# ---------------------------------------------------------------- throughput


def requests_for(level: int, args) -> int:
    n = args.requests_per_level if args.requests_per_level else max(4, 2 * level)
    return max(n, level)


async def throughput(http: httpx.AsyncClient, url: str, model: str, args, label: str) -> dict[int, float]:
    """tokens/s per level with bench/serve.py's run_level (after a warm-up)."""
    api = url + "/v1"
    base = dict(api=api, seed=args.seed, prompt_tokens=args.prompt_tokens, timeout=args.timeout)
    warm = min(4, max(args.levels))
    await run_level(http, SimpleNamespace(**base, requests=1, max_tokens=16), model, secrets.token_hex(4), 1)
    await run_level(http, SimpleNamespace(**base, requests=warm, max_tokens=16), model, secrets.token_hex(4), warm)
    rates = {}
    for level in args.levels:
        ns = SimpleNamespace(**base, requests=requests_for(level, args), max_tokens=args.max_tokens)
        lv = await run_level(http, ns, model, secrets.token_hex(4), level)
        if lv.errors:
            first = next((r.error for r in lv.results if r.error), "cut off by the level's deadline")
            raise RuntimeError(f"{lv.errors} of {ns.requests} requests failed at concurrency {level}: {first}")
        rates[level] = lv.tokens_per_s
        print(f"[{label}] concurrency {level}: {len(lv.ok)} requests, {lv.output_tokens} tokens "
              f"(prompt ~{lv.prompt_tokens()} tok) in {lv.wall:.1f} s: {lv.tokens_per_s:.1f} tok/s", flush=True)
    return rates


# ---------------------------------------------------------------- identity trials


@dataclass
class Target:
    index: int
    body: dict
    alone: tuple | None = None  # (text, finish_reason) or ("error", message)
    crowded: tuple | None = None

    @property
    def identical(self) -> bool:
        return self.alone is not None and self.alone == self.crowded and self.alone[0] != "error"


def targets_for(args, model: str) -> list[Target]:
    """The same T seeded requests for every mode."""
    out = []
    for i in range(args.trials):
        rng = random.Random(f"invariance-{args.seed}-{i}")
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 150)))
        body = {"model": model, "messages": [{"role": "user", "content": f"Trial {i}: {words}"}],
                "max_tokens": args.target_tokens, "temperature": 1, "seed": rng.randrange(1 << 31)}
        out.append(Target(i, body))
    return out


async def complete(http: httpx.AsyncClient, body: dict, timeout: float) -> tuple:
    """One buffered chat completion: (text, finish_reason), or ('error', why)."""
    try:
        with trio.fail_after(timeout):
            response = await http.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            return ("error", f"HTTP {response.status_code}: {response.text[:ERROR_SNIPPET]}")
        choice = response.json()["choices"][0]
        message = choice.get("message") or {}
        text = (message.get("reasoning_content") or "") + (message.get("content") or "")
        return (text, choice.get("finish_reason"))
    except (httpx.HTTPError, trio.TooSlowError, ValueError, KeyError, IndexError) as exc:
        return ("error", f"{type(exc).__name__}: {str(exc)[:ERROR_SNIPPET]}")


async def idle(http: httpx.AsyncClient, limit: float = 60.0) -> None:
    """Wait until /metrics shows nothing running or waiting."""
    with trio.fail_after(limit):
        while True:
            m = await get_metrics(http)
            if m and m["running"] == 0 and m["waiting"] == 0:
                return
            await trio.sleep(0.05)


async def run_alone(http: httpx.AsyncClient, targets: list[Target], args) -> None:
    for t in targets:
        await idle(http)
        t.alone = await complete(http, t.body, args.timeout)


@dataclass
class Crowd:
    open_: int = 0  # crowd requests open (client side)
    done: int = 0
    errors: list = field(default_factory=list)
    running: int = 0  # latest /metrics sample
    open_targets: int = 0  # targets open (crowded)
    running_seen: list = field(default_factory=list)  # /metrics running, sampled while a target was open


async def run_crowded(http: httpx.AsyncClient, model: str, targets: list[Target], args, label: str) -> Crowd:
    crowd = Crowd()
    run_id = secrets.token_hex(4)
    url = str(http.base_url).rstrip("/") + "/v1/chat/completions"

    async def crowd_worker(w: int) -> None:
        rng = random.Random(f"crowd-{args.seed}-{w}")
        k = 0
        while True:
            k += 1
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 300)))
            body = {"model": model, "messages": [{"role": "user", "content": f"Crowd {run_id}-{w}-{k}: {words}"}],
                    "max_tokens": rng.randint(16, 128), "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            if rng.random() < 0.5:
                body["temperature"] = 0
            else:
                body.update(temperature=1, seed=rng.randrange(1 << 31))
            crowd.open_ += 1
            try:
                res = await one_request(http, url, body, args.timeout)
            finally:
                crowd.open_ -= 1
            crowd.done += 1
            if not res.ok and len(crowd.errors) < 5:
                crowd.errors.append(res.error)

    async def sampler() -> None:
        while True:
            m = await get_metrics(http)
            if m:
                crowd.running = m["running"]
                if crowd.open_targets:
                    crowd.running_seen.append(m["running"])
            await trio.sleep(0.2)

    async def crowded_gate() -> None:
        with trio.fail_after(300):
            while not (crowd.open_ >= args.crowd and crowd.running >= min(args.crowd, MAX_NUM_SEQS)):
                await trio.sleep(0.05)

    async def target_worker(receive: trio.MemoryReceiveChannel) -> None:
        async with receive:
            async for t in receive:
                await crowded_gate()
                crowd.open_targets += 1
                try:
                    t.crowded = await complete(http, t.body, args.timeout)
                finally:
                    crowd.open_targets -= 1

    async with trio.open_nursery() as background:
        background.start_soon(sampler)
        for w in range(args.crowd):
            background.start_soon(crowd_worker, w)
        t0 = trio.current_time()
        await crowded_gate()
        print(f"[{label}] crowd of {args.crowd} in flight after {trio.current_time() - t0:.1f} s; "
              f"sending {len(targets)} targets, up to {args.overlap} at once", flush=True)
        async with trio.open_nursery() as nursery:
            send, receive = trio.open_memory_channel(0)
            async with send, receive:
                for _ in range(args.overlap):
                    nursery.start_soon(target_worker, receive.clone())
                for t in targets:
                    await send.send(t)
        background.cancel_scope.cancel()  # the server drops the crowd's requests as their connections close
    return crowd


async def identity(http: httpx.AsyncClient, model: str, args, label: str) -> tuple[list[Target], Crowd]:
    targets = targets_for(args, model)
    even, odd = targets[0::2], targets[1::2]
    t0 = time.perf_counter()
    await run_alone(http, even, args)
    t1 = time.perf_counter()
    crowd = await run_crowded(http, model, targets, args, label)
    t2 = time.perf_counter()
    await idle(http, limit=args.timeout)  # the cancelled crowd leaves the engine
    await run_alone(http, odd, args)
    t3 = time.perf_counter()
    n = sum(t.identical for t in targets)
    seen = crowd.running_seen
    print(f"[{label}] identity: {n}/{len(targets)} identical; alone {t1 - t0 + t3 - t2:.1f} s, crowded {t2 - t1:.1f} s "
          f"({crowd.done} crowd requests finished, {len(crowd.errors)} failed); sequences running while targets "
          f"were open: " + (f"min {min(seen)}, mean {sum(seen) / len(seen):.1f} ({len(seen)} samples)" if seen else "not sampled"),
          flush=True)
    for err in crowd.errors:
        print(f"  crowd error: {err}", flush=True)
    for t in [t for t in targets if not t.identical][:5]:
        a, c = t.alone or ("none", None), t.crowded or ("none", None)
        if "error" in (a[0], c[0]):
            print(f"  trial {t.index}: alone {a!r:.120} crowded {c!r:.120}", flush=True)
        else:
            at = next((k for k, (x, y) in enumerate(zip(a[0], c[0])) if x != y), min(len(a[0]), len(c[0])))
            print(f"  trial {t.index}: differs from char {at} (alone {len(a[0])} chars, {a[1]}; "
                  f"crowded {len(c[0])} chars, {c[1]}): {a[0][at:at + 40]!r} vs {c[0][at:at + 40]!r}", flush=True)
    return targets, crowd


# ---------------------------------------------------------------- one server's part


async def measure(url: str, proc: subprocess.Popen, mode: str, args, label: str, with_identity: bool) -> dict:
    async with http_client(url) as http:
        t0 = time.perf_counter()
        model = await ready(http, proc, mode, args)
        print(f"[{label}] ready in {time.perf_counter() - t0:.1f} s (model {model}, batch_invariant={mode == 'on'})", flush=True)
        out = {"rates": await throughput(http, url, model, args, label)}
        if with_identity and args.trials:
            targets, crowd = await identity(http, model, args, label)
            out["identical"] = sum(t.identical for t in targets)
            out["errors"] = sum("error" in ((t.alone or ("error",))[0], (t.crowded or ("error",))[0]) for t in targets)
            out["running"] = (min(crowd.running_seen), sum(crowd.running_seen) / len(crowd.running_seen)) if crowd.running_seen else None
        return out


def run(args) -> dict:
    best: dict[str, dict[int, float]] = {m: {} for m in args.modes}
    ident: dict[str, dict] = {}
    for round_ in range(args.rounds):
        order = list(args.modes) if round_ % 2 == 0 else list(reversed(args.modes))
        for mode in order:
            label = f"round {round_ + 1} {mode}"
            with server(args, mode, f"r{round_ + 1}-{mode}") as (url, proc):
                out = trio.run(measure, url, proc, mode, args, label, round_ == 0)
            for level, rate in out["rates"].items():
                best[mode][level] = max(best[mode].get(level, 0.0), rate)
            if "identical" in out:
                ident[mode] = out
    return {"best": best, "identity": ident}


# ---------------------------------------------------------------- report


def report(args, result: dict) -> None:
    best, ident = result["best"], result["identity"]
    both = "on" in best and "off" in best
    cost = {lv: 1 - best["on"][lv] / best["off"][lv] for lv in args.levels if both and best["off"][lv] > 0}
    print()
    print(f"best of {args.rounds} round(s); {args.threads} torch thread(s); identity: {args.trials} seeded trials, "
          f"{args.target_tokens} tokens, crowd {args.crowd}, up to {args.overlap} targets at once")
    head = ["mode"] + [f"tok/s @{lv}" for lv in args.levels]
    if both:
        head += [f"cost @{lv}" for lv in args.levels]
    head += ["identical", "running in crowd, min / mean"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for mode in args.modes:
        row = [mode] + [f"{best[mode][lv]:.1f}" for lv in args.levels]
        if both:
            row += [f"{cost[lv] * 100:.1f}%" if mode == "on" and lv in cost else "" for lv in args.levels]
        i = ident.get(mode)
        row += [f"{i['identical']}/{args.trials}" + (f" ({i['errors']} errors)" if i["errors"] else "") if i else "n/a",
                f"{i['running'][0]} / {i['running'][1]:.1f}" if i and i["running"] else "n/a"]
        print("| " + " | ".join(row) + " |")
    summary = {
        "tokens_per_s": {m: {str(lv): round(best[m][lv], 1) for lv in args.levels} for m in args.modes},
        "identical": {m: ident[m]["identical"] for m in args.modes if m in ident},
        "trials": args.trials,
    }
    if both:
        summary["cost"] = {str(lv): round(c, 4) for lv, c in cost.items()}
    print(json.dumps(summary), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=100, help="seeded alone-vs-crowded trials per mode (default 100; 0: none)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the servers (default 2)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 32], help="concurrency levels (default 1 32)")
    p.add_argument("--requests-per-level", type=int, help="requests per level (default 2 x level, at least 4)")
    p.add_argument("--modes", nargs="+", choices=["on", "off"], default=["on", "off"], help="default: on off")
    p.add_argument("--rounds", type=int, default=2, help="servers per mode for the throughput levels, in turn (default 2)")
    p.add_argument("--target-tokens", type=int, default=48, help="max_tokens of a trial (default 48)")
    p.add_argument("--crowd", type=int, default=31, help="crowd requests kept in flight (default 31)")
    p.add_argument("--overlap", type=int, default=8, help="trial targets in one crowd at once (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=100, help="throughput prompts, as bench/serve.py (default 100)")
    p.add_argument("--max-tokens", type=int, default=128, help="throughput output tokens per request (default 128)")
    p.add_argument("--port-base", type=int, default=0, help="first server port, +1 per start (default: free ports)")
    p.add_argument("--model", default="smollm2", help="--model of the servers (default smollm2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    args.modes = list(dict.fromkeys(args.modes))
    args.levels = list(dict.fromkeys(args.levels))
    if min(args.levels) < 1 or args.rounds < 1 or args.trials < 0 or args.crowd < 1 or args.overlap < 1 or args.target_tokens < 1:
        p.error("levels, rounds, crowd, overlap and target tokens must be positive, trials not negative")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.starts = 0
    args.keep_logs = False
    args.log_dir = Path(tempfile.mkdtemp(prefix="trioserve-invariance-"))
    t0 = time.perf_counter()
    try:
        result = run(args)
    except BaseException as exc:  # trio may wrap a Ctrl-C or an error in an exception group
        if isinstance(exc, KeyboardInterrupt) or (
                isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None):
            print(f"interrupted; server logs in {args.log_dir}", file=sys.stderr)
            return 130
        if not isinstance(exc, Exception):
            raise
        args.keep_logs = True
        if isinstance(exc, BaseExceptionGroup):
            traceback.print_exception(exc)
        print(f"error: {type(exc).__name__}: {exc}; server logs in {args.log_dir}", file=sys.stderr)
        return 1
    finally:
        if not args.keep_logs:
            shutil.rmtree(args.log_dir, ignore_errors=True)
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    report(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
