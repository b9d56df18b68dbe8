"""Soak test: minutes of mixed traffic against one server, watching its
resident memory, throughput, errors, hangs and KV blocks.

    .venv/bin/python bench/soak.py --minutes 10 --load 2            # starts its own server
    .venv/bin/python bench/soak.py --base-url http://127.0.0.1:8000 --pid PID --capacity 32 --minutes 10 --load 2

Load. ``--load L`` runs round(L x capacity) closed-loop clients: each one
sends a request, waits for it to end, and sends the next, until the time is
up. Capacity is the concurrency that saturates throughput. By default it is
the server's ``--max-num-seqs`` (32): the scheduler decodes at most that many
rows in a step, and requests beyond it only queue, so throughput cannot rise
past it. ``--capacity N`` sets it; ``--measure-capacity`` measures it first
with short closed-loop runs at rising concurrency (streamed chat, fixed
lengths) and takes the smallest concurrency within 10% of the best
throughput. So "--load 2" with the defaults is 64 clients.

Traffic. Every client draws each request's kind from a fixed mix: chat
buffered, chat streamed, completions (buffered or streamed), streamed chat
cut by the client after a random number of chunks, a session (create, 2-4
turns, delete) and guided decoding (response_format json_schema). Prompts
are 10-300 words, half of the chats behind one of four shared system
prompts (prefix-cache hits); 16-128 output tokens, EOS ignored except for
guided requests. All traffic goes to 127.0.0.1.

Sampling. Every ``--sample-every`` seconds: the server process's VmRSS and
thread count from /proc/PID/status, and GET /metrics (generated tokens,
running, waiting, kv_blocks_used).

Report (markdown, printed and written to bench/out/soak-<time>.md): request
outcomes by status and by kind, 5xx, hangs (requests past ``--timeout``),
throughput (server-side generated tokens/s) in the window right after the
warm-up and in the last window, RSS after warm-up, at the end and the max,
and KV blocks still in use once the load has stopped and every session was
deleted (a leak if not zero; idle prefix-cache blocks and pinned session
blocks are reported beside it). The last line is one JSON object.

Exit status 0 when the run completed (whatever it found), 1 when the server
could not be started or reached.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from serve import WORDS  # bench/serve.py (this script's folder is on sys.path): one-token words
SYSTEMS = [f"You are assistant number {i}. " + " ".join(random.Random(i).choice(WORDS) for _ in range(90)) for i in range(4)]
SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "temp": {"type": "integer"}, "rain": {"type": "boolean"}},
                "required": ["name", "temp", "rain"],
            },
        }
    },
    "required": ["cities"],
}
# (kind, weight)
MIX = (("chat", 20), ("chat_stream", 20), ("completion", 15), ("cut_stream", 15), ("session", 15), ("guided", 15))
SNIPPET = 160


@dataclass
class Tally:
    """What every client adds to; read once at the end."""

    outcomes: Counter = field(default_factory=Counter)  # outcome -> count
    by_kind: dict = field(default_factory=dict)  # kind -> Counter of outcomes
    hangs: list = field(default_factory=list)  # (kind, seconds)
    errors: list = field(default_factory=list)  # first few error texts
    sessions_open: set = field(default_factory=set)

    def add(self, kind: str, outcome: str, detail: str | None = None) -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        if detail and len(self.errors) < 12:
            self.errors.append(f"{kind}: {outcome}: {detail[:SNIPPET]}")


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss_mb: float | None
    threads: int | None
    metrics: dict | None


def read_status(pid: int) -> tuple[float | None, int | None]:
    """(VmRSS in MB, thread count) of ``pid``; (None, None) once it is gone."""
    rss = threads = None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
    except OSError:
        return None, None
    return rss, threads


def prompt_text(rng: random.Random, tag: str) -> str:
    return f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 300)))


class Client:
    """One closed-loop client: a request at a time until ``stop_at``."""

    def __init__(self, http: httpx.AsyncClient, model: str, tally: Tally, args, index: int, run_id: str):
        self.http, self.model, self.tally, self.args = http, model, tally, args
        self.rng = random.Random(f"{args.seed}-{index}")
        self.tag = f"soak {run_id} client {index}"
        self.count = 0

    def _tag(self) -> str:
        self.count += 1
        return f"{self.tag} request {self.count}"

    def _sampling(self) -> dict:
        body = {"max_tokens": self.rng.randint(16, 128), "ignore_eos": True}
        if self.rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=self.rng.randrange(1 << 30))
        return body

    def _messages(self) -> list[dict]:
        user = {"role": "user", "content": prompt_text(self.rng, self._tag())}
        if self.rng.random() < 0.5:
            return [{"role": "system", "content": self.rng.choice(SYSTEMS)}, user]
        return [user]

    async def run(self, stop_at: float) -> None:
        kinds, weights = zip(*MIX)
        while trio.current_time() < stop_at:
            kind = self.rng.choices(kinds, weights)[0]
            if kind == "session":
                await self.session(stop_at)
                continue
            body: dict = {"model": self.model, **self._sampling()}
            path = "/v1/chat/completions"
            stream = kind in ("chat_stream", "cut_stream") or (kind in ("completion", "guided") and self.rng.random() < 0.5)
            cut = self.rng.randint(1, body["max_tokens"]) if kind == "cut_stream" else None
            if kind == "completion":
                path = "/v1/completions"
                body["prompt"] = prompt_text(self.rng, self._tag())
            else:
                body["messages"] = self._messages()
            if kind == "guided":
                body.pop("ignore_eos")
                body["messages"] = [{"role": "user", "content": f"{self._tag()}: list some cities with weather as JSON."}]
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
            await self.request(kind, path, body, stream=stream, cut=cut)

    async def session(self, stop_at: float) -> None:
        created = await self.request("session", "/v1/sessions", {"model": self.model, **self._sampling(), "system": self.rng.choice(SYSTEMS)})
        if not isinstance(created, dict) or "id" not in created:
            return
        sid = created["id"]
        self.tally.sessions_open.add(sid)
        try:
            for _ in range(self.rng.randint(2, 4)):
                if trio.current_time() >= stop_at:
                    break
                turn = {"messages": [{"role": "user", "content": prompt_text(self.rng, self._tag())}], "max_tokens": self.rng.randint(16, 96)}
                await self.request("session", f"/v1/sessions/{sid}/turns", turn, stream=self.rng.random() < 0.5)
        finally:
            with trio.CancelScope(shield=True):
                await self.request("session", f"/v1/sessions/{sid}", None, method="DELETE", timeout=30.0)
            self.tally.sessions_open.discard(sid)

    async def request(self, kind: str, path: str, body: dict | None, *, stream: bool = False, cut: int | None = None,
                      method: str = "POST", timeout: float | None = None):
        """Send one request and record its outcome. Returns the parsed JSON
        body of a buffered 200 answer, else None. Never raises for a failed
        request (cancellation passes through)."""
        timeout = timeout or self.args.timeout
        started = time.perf_counter()
        result = None
        outcome, detail = None, None
        with trio.move_on_after(timeout) as scope:
            try:
                if stream:
                    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
                    async with self.http.stream(method, path, json=body) as response:
                        if response.status_code != 200:
                            outcome, detail = str(response.status_code), (await response.aread()).decode("utf-8", "replace")
                        else:
                            outcome, detail = await self._read_stream(response, cut)
                else:
                    response = await self.http.request(method, path, json=body)
                    outcome = str(response.status_code)
                    if response.status_code == 200:
                        result = response.json()
                    else:
                        detail = response.text
            except (httpx.HTTPError, httpx.StreamError) as exc:
                outcome, detail = f"transport:{type(exc).__name__}", str(exc)
            except ValueError as exc:  # a body that is not JSON
                outcome, detail = "bad-body", str(exc)
        if scope.cancelled_caught:
            outcome, detail = "hang", f"{path} over {timeout:g} s"
            self.tally.hangs.append((kind, round(time.perf_counter() - started, 1)))
        if outcome == "429" or outcome.startswith("transport:"):
            await trio.sleep(1.0)  # a full queue or a server gone: back off, don't spin
        self.tally.add(kind, outcome, detail if outcome not in ("200", "cut") else None)
        return result

    @staticmethod
    async def _read_stream(response: httpx.Response, cut: int | None) -> tuple[str, str | None]:
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return "200", None
            obj = json.loads(data)
            if isinstance(obj, dict) and obj.get("error") is not None:
                return "stream-error", json.dumps(obj["error"])
            chunks += 1
            if cut is not None and chunks >= cut:
                return "cut", None  # leaving the block closes the connection mid-stream
        return "stream-ended-early", "no [DONE]"


async def get_metrics(http: httpx.AsyncClient) -> dict | None:
    try:
        with trio.fail_after(10):
            response = await http.get("/metrics")
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, trio.TooSlowError):
        return None


async def sample_loop(http: httpx.AsyncClient, pid: int | None, every: float, t0: float, out: list[Sample], stop: trio.Event) -> None:
    while not stop.is_set():
        rss, threads = read_status(pid) if pid else (None, None)
        metrics = await get_metrics(http)
        out.append(Sample(trio.current_time() - t0, rss, threads, metrics))
        with trio.move_on_after(every):
            await stop.wait()


async def measure_capacity(http: httpx.AsyncClient, model: str, args) -> tuple[int, list]:
    """Closed-loop streamed chat at rising concurrency, ``--ramp-seconds``
    each; the smallest level within 10% of the best tokens/s."""
    rows = []
    for level in args.ramp:
        tally = Tally()
        before = await get_metrics(http)
        start = trio.current_time()
        stop_at = start + args.ramp_seconds

        async def client(i: int) -> None:
            c = Client(http, model, tally, args, 10_000 + i, "ramp")
            while trio.current_time() < stop_at:
                body = {"model": model, "messages": [{"role": "user", "content": prompt_text(random.Random(i), c._tag())}],
                        "max_tokens": 64, "ignore_eos": True, "temperature": 0}
                await c.request("ramp", "/v1/chat/completions", body, stream=True)

        async with trio.open_nursery() as nursery:
            for i in range(level):
                nursery.start_soon(client, i)
        after = await get_metrics(http)
        elapsed = trio.current_time() - start
        rate = (after["generated_tokens"] - before["generated_tokens"]) / elapsed if before and after else 0.0
        rows.append((level, round(rate, 1)))
        print(f"capacity ramp: {level} clients -> {rate:.1f} tokens/s", flush=True)
    best = max(rate for _, rate in rows)
    return next(level for level, rate in rows if rate >= 0.9 * best), rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = Path(sys.executable).with_name("trioserve")
    cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), "--model", args.model,
           "--max-num-seqs", str(args.max_num_seqs), "--drain-timeout", "5", "--log-level", "warning"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += args.server_arg or []
    env = dict(os.environ)
    for item in args.server_env or []:
        key, _, value = item.partition("=")
        env[key] = value
    log = open(log_path, "w")  # noqa: SIM115 - kept open for the server's lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    print(f"started server pid {proc.pid}: {' '.join(cmd)} (log {log_path})", flush=True)
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def wait_ready(http: httpx.AsyncClient, proc: subprocess.Popen | None, limit: float) -> None:
    with trio.fail_after(limit):
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                if (await http.get("/health", timeout=5)).status_code == 200:
                    return
            await trio.sleep(0.5)


async def quiesce(http: httpx.AsyncClient, limit: float) -> dict | None:
    """Wait (at most ``limit`` s) until nothing runs or waits; the last metrics."""
    metrics = None
    with trio.move_on_after(limit):
        while True:
            metrics = await get_metrics(http)
            if metrics and metrics["running"] == 0 and metrics["waiting"] == 0:
                await trio.sleep(1.0)  # a step in flight settles its blocks
                return await get_metrics(http)
            await trio.sleep(0.5)
    return metrics


async def soak(args, base_url: str, pid: int | None) -> dict:
    clients_max = max(args.ramp + [int(args.load * (args.capacity or args.max_num_seqs)) + 1])
    limits = httpx.Limits(max_connections=clients_max + 8, max_keepalive_connections=clients_max + 8)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(args.timeout, connect=30.0)) as http:
        await wait_ready(http, args.proc, args.ready_timeout)
        model = args.model_id or (await http.get("/v1/models", timeout=30)).json()["data"][0]["id"]
        ramp_rows = []
        capacity = args.capacity
        if args.measure_capacity:
            capacity, ramp_rows = await measure_capacity(http, model, args)
        capacity = capacity or args.max_num_seqs
        clients = max(1, round(args.load * capacity))
        duration = args.minutes * 60.0
        print(f"soak: {clients} clients ({args.load:g} x capacity {capacity}) for {duration:.0f} s against {base_url}", flush=True)
        tally, samples = Tally(), []
        run_id = secrets.token_hex(3)
        t0 = trio.current_time()
        stop_sampling = trio.Event()
        async with trio.open_nursery() as outer:
            outer.start_soon(sample_loop, http, pid, args.sample_every, t0, samples, stop_sampling)
            # Clients stop starting work at the deadline; what is in flight
            # finishes, bounded by its own timeout (plus a session's DELETE).
            with trio.move_on_after(duration + args.timeout + 60):
                async with trio.open_nursery() as nursery:
                    for i in range(clients):
                        nursery.start_soon(Client(http, model, tally, args, i, run_id).run, t0 + duration)
            load_end = trio.current_time() - t0
            stop_sampling.set()
        rss_end_of_load = read_status(pid)[0] if pid else None
        for sid in list(tally.sessions_open):  # only if a client was cut off before its own DELETE
            with trio.move_on_after(30):
                await http.delete(f"/v1/sessions/{sid}")
        after = await quiesce(http, 60.0)
        rss_idle = read_status(pid)[0] if pid else None
    return {"capacity": capacity, "ramp": ramp_rows, "clients": clients, "duration": duration, "load_end": load_end,
            "tally": tally, "samples": samples, "after": after, "rss_after_load": rss_end_of_load, "rss_idle": rss_idle}


def rate_between(samples: list[Sample], lo: float, hi: float) -> float | None:
    """Server-side generated tokens/s between the samples nearest ``lo`` and ``hi``."""
    pts = [s for s in samples if s.metrics]
    a = min(pts, key=lambda s: abs(s.t - lo), default=None)
    b = min(pts, key=lambda s: abs(s.t - hi), default=None)
    if a is None or b is None or b.t <= a.t:
        return None
    return (b.metrics["generated_tokens"] - a.metrics["generated_tokens"]) / (b.t - a.t)


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return None if den == 0 else 60.0 * sum((t - mt) * (r - mr) for t, r in points) / den


def report(args, result: dict, header: str) -> tuple[str, dict]:
    tally, samples, duration = result["tally"], result["samples"], result["duration"]
    warm = min(args.warmup, duration / 3)
    window = min(60.0, (duration - warm) / 2)
    under_load = [s for s in samples if s.t <= duration and s.rss_mb is not None]
    after_warm = [s for s in under_load if s.t >= warm]
    rss_warm = after_warm[0].rss_mb if after_warm else None
    rss_end = under_load[-1].rss_mb if under_load else None
    rss_max = max((s.rss_mb for s in samples if s.rss_mb is not None), default=None)
    # Growth compares window means, which a single sample's jitter (the
    # server's periodic heap trim, a step's temporaries) does not sway.
    first = [s.rss_mb for s in after_warm if s.t <= warm + window]
    last = [s.rss_mb for s in under_load if s.t >= duration - window]
    mean_first = sum(first) / len(first) if first else None
    mean_last = sum(last) / len(last) if last else None
    growth = (mean_last / mean_first - 1) if mean_first and mean_last else None
    slope = slope_mb_per_min([(s.t, s.rss_mb) for s in after_warm])
    tps_start = rate_between(samples, warm, warm + window)
    tps_end = rate_between(samples, duration - window, duration)
    five = sum(n for k, n in tally.outcomes.items() if k[:1] == "5")
    after = result["after"] or {}
    prefix = after.get("prefix_cache") or {}
    threads = max((s.threads for s in samples if s.threads), default=None)

    def mb(v):
        return "n/a" if v is None else f"{v:.0f} MB"

    lines = [f"# Soak report", "", header, "",
             f"- load: {result['clients']} closed-loop clients = {args.load:g} x capacity {result['capacity']} "
             f"({'measured' if result['ramp'] else 'given' if args.capacity else 'the server max-num-seqs'}); "
             f"{duration / 60:g} min, load ended at {result['load_end']:.0f} s (in-flight requests finish after the deadline)",
             f"- server threads (OS, max seen): {threads}; torch threads: {args.threads or ('unknown (a server started elsewhere)' if args.base_url else 'torch default')}; "
             f"load average at the end: {os.getloadavg()[0]:.2f}, this run included (a shared machine: numbers are noisy)"]
    if result["ramp"]:
        lines.append("- capacity ramp (clients -> tokens/s): " + ", ".join(f"{c} -> {r}" for c, r in result["ramp"]))
    lines += ["", "| measure | value |", "|---|---|",
              f"| requests | {sum(tally.outcomes.values())} |",
              f"| outcomes | {', '.join(f'{k}: {v}' for k, v in sorted(tally.outcomes.items()))} |",
              f"| 5xx | {five} |",
              f"| hangs (> {args.timeout:g} s) | {len(tally.hangs)} |",
              f"| tokens/s after warm-up ({warm:.0f}-{warm + window:.0f} s) | {tps_start and round(tps_start, 1)} |",
              f"| tokens/s at the end ({duration - window:.0f}-{duration:.0f} s) | {tps_end and round(tps_end, 1)} |",
              f"| RSS after warm-up ({warm:.0f} s) | {mb(rss_warm)} |",
              f"| RSS at the end of the load | {mb(rss_end)} |",
              f"| RSS mean {warm:.0f}-{warm + window:.0f} s / last {window:.0f} s of the load | {mb(mean_first)} / {mb(mean_last)} |",
              f"| RSS growth after warm-up (of those means; target within 20%) | {'n/a' if growth is None else f'{growth:+.1%}'} |",
              f"| RSS slope after warm-up | {'n/a' if slope is None else f'{slope:+.1f} MB/min'} |",
              f"| RSS max | {mb(rss_max)} |",
              f"| RSS idle after the load | {mb(result['rss_idle'])} |",
              f"| KV blocks in use after the load (leak if > 0) | {after.get('kv_blocks_used')} of {after.get('kv_blocks_total')} |",
              f"| prefix-cache blocks idle / pinned by sessions | {prefix.get('idle_blocks')} / {prefix.get('pinned_blocks')} |",
              f"| running / waiting after the load | {after.get('running')} / {after.get('waiting')} |",
              "", "| kind | " + " | ".join(sorted(tally.outcomes)) + " |", "|---|" + "---|" * len(tally.outcomes)]
    for kind in sorted(tally.by_kind):
        lines.append(f"| {kind} | " + " | ".join(str(tally.by_kind[kind].get(k, 0)) for k in sorted(tally.outcomes)) + " |")
    lines += ["", "RSS and throughput over time (every sample):", "", "| t s | RSS MB | tokens/s since last | running | waiting | KV used |", "|---|---|---|---|---|---|"]
    prev = None
    for s in samples:
        m = s.metrics or {}
        rate = None
        if prev is not None and prev.metrics and m and s.t > prev.t:
            rate = (m["generated_tokens"] - prev.metrics["generated_tokens"]) / (s.t - prev.t)
        lines.append(f"| {s.t:.0f} | {'' if s.rss_mb is None else f'{s.rss_mb:.0f}'} | {'' if rate is None else f'{rate:.0f}'} "
                     f"| {m.get('running', '')} | {m.get('waiting', '')} | {m.get('kv_blocks_used', '')} |")
        prev = s
    if tally.errors:
        lines += ["", "First errors:", ""] + [f"- {e}" for e in tally.errors]
    summary = {
        "minutes": args.minutes, "load": args.load, "clients": result["clients"], "capacity": result["capacity"],
        "requests": sum(tally.outcomes.values()), "outcomes": dict(tally.outcomes), "5xx": five, "hangs": len(tally.hangs),
        "tokens_per_s": {"start": tps_start and round(tps_start, 1), "end": tps_end and round(tps_end, 1)},
        "rss_mb": {"warm": rss_warm and round(rss_warm), "end": rss_end and round(rss_end), "max": rss_max and round(rss_max),
                   "mean_after_warmup": mean_first and round(mean_first), "mean_last": mean_last and round(mean_last),
                   "growth": growth and round(growth, 3)},
        "kv_blocks_used_after": after.get("kv_blocks_used"), "pinned_blocks_after": prefix.get("pinned_blocks"),
    }
    lines += ["", json.dumps(summary)]
    return "\n".join(lines), summary


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (127.0.0.1 only); default: start one")
    p.add_argument("--pid", type=int, help="with --base-url: the server's process id, for its RSS")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the load (default 10)")
    p.add_argument("--load", type=float, default=2.0, help="clients as a multiple of capacity (default 2)")
    p.add_argument("--capacity", type=int, help="concurrency that saturates throughput (default: --max-num-seqs)")
    p.add_argument("--measure-capacity", action="store_true", help="measure capacity first with a closed-loop ramp")
    p.add_argument("--ramp", type=int, action="append", help="ramp levels (default 8 16 32 48)")
    p.add_argument("--ramp-seconds", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the RSS and throughput baseline (default 60)")
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds after which a request counts as a hang (default 180)")
    p.add_argument("--model", default="smollm2", help="model for a server started here")
    p.add_argument("--model-id", help="model id to send (default: the first of GET /v1/models)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="for a server started here (default 32)")
    p.add_argument("--threads", type=int, help="torch threads for a server started here")
    p.add_argument("--server-arg", action="append", help="extra option for a server started here (repeat)")
    p.add_argument("--server-env", action="append", help="KEY=VALUE in a started server's environment (repeat)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="a word for the report's file name and header")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "out"))
    args = p.parse_args(argv)
    args.ramp = sorted(set(args.ramp or [8, 16, 32, 48]))
    if args.base_url:
        host = httpx.URL(args.base_url).host
        if host not in ("127.0.0.1", "localhost"):
            p.error("--base-url must point at 127.0.0.1")
        if args.capacity is None and not args.measure_capacity:
            p.error("with --base-url give --capacity or --measure-capacity")
    if args.minutes <= 0 or args.load <= 0:
        p.error("--minutes and --load must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"soak-{stamp}{'-' + args.label if args.label else ''}"
    args.proc = None
    pid = args.pid
    base_url = args.base_url
    try:
        if base_url is None:
            args.proc, base_url = start_server(args, out_dir / f"{name}-server.log")
            pid = args.proc.pid
        try:
            result = trio.run(soak, args, base_url, pid)
        except (RuntimeError, trio.TooSlowError, httpx.HTTPError) as exc:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    finally:
        if args.proc is not None:
            stop_server(args.proc)
    header = (f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, target {base_url} (pid {pid}), "
              f"label {args.label or '-'}, env {' '.join(args.server_env or []) or '-'}")
    text, _ = report(args, result, header)
    print(text)
    (out_dir / f"{name}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
