"""What the engine's plumbing costs per token, before and after a change, in
one run: inter-token latency at 1 stream over HTTP minus the forward step,
tokens/s at 1 and 32 streams, and what recording a trace costs at 32.

    .venv/bin/python bench/hops.py [--before REF] [--threads 1] [--rounds 2] [--max-tokens 128]

Variants, each a fresh server on the default model, measured one after the
other with bench/serve.py (streaming chat, temperature 0, ignore_eos):
- "before": the tree at git ref REF (default: the last commit before the
  engine core, 604ffcf), imported from a temporary `git worktree`;
- "after": this tree;
- "after+record": this tree with `--record` into a temporary directory.

The forward step is timed in process on this tree's worker function
(`StepRunner.forward`, models/step_runner.py: building the step's inputs and the forward
pass, as the worker thread runs it) for one decode row at the context the
HTTP run sees, median of many steps, measured before and after the servers
run; the per-token overhead is ITL p50 minus that median. The servers and
the in-process timing use ``--threads`` torch threads (default 1: on two
cores shared with the load generator, two OpenMP threads that wait for
each other double a step now and then, which swamps what is measured
here). The variants run ``--rounds`` times in turn; each figure is the
best of its rounds. Run on a quiet machine. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BEFORE = "604ffcf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tree: Path, extra: list[str], log: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = "import sys; from trioserve.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--threads", str(threads), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=str(tree))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def load(url: str, concurrency: int, requests: int, args) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "serve.py"), "--base-url", url, "--concurrency", str(concurrency),
           "--requests", str(requests), "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])


def forward_step_ms(context: int, steps: int, threads: int) -> float:
    """Median ms of the step runner's forward pass for one decode row."""
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(threads)
    from trioserve.kernels.cpu import resolve_dtype
    from trioserve.models.checkpoint import load_checkpoint
    from trioserve.models.decoder import DecoderModel
    from trioserve.models.step_runner import StepRunner
    from trioserve.state.kv_pool import BlockPool
    from trioserve.types import PlanRow, SampleRow, SamplingParams, StepPlan

    checkpoint = load_checkpoint("smollm2", dtype=resolve_dtype("auto"))
    model = DecoderModel.from_checkpoint(checkpoint, use_int4=True)
    block = 16
    pool = BlockPool(-(-(context + steps + 1) // block), block)
    cache = model.new_kv_cache(pool.num_blocks, block)
    table = tuple(pool.grow("s", context + steps + 1))
    prompt = tuple(range(100, 100 + context))
    sample = SampleRow(SamplingParams(temperature=0.0), 0, 0)
    runner = StepRunner(model, cache, vocab_size=checkpoint.tokenizer.vocab_size)
    runner.forward(StepPlan(1, (PlanRow("s", prompt, 0, table, False, sample),)))
    times = []
    for k in range(steps):
        plan = StepPlan(2 + k, (PlanRow("s", (7,), context + k, table, True, sample),))
        t0 = time.perf_counter()
        runner.forward(plan)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=DEFAULT_BEFORE, help=f"git ref of the 'before' tree (default {DEFAULT_BEFORE})")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-1", type=int, default=4)
    p.add_argument("--requests-32", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="decode steps timed in process (default 200)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the servers and of the step timing (default 1)")
    p.add_argument("--rounds", type=int, default=2, help="times each variant runs, in turn (default 2)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trioserve-hops-"))
    before = work / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True, capture_output=True)
    context = 200  # ~135 prompt tokens (with the template) + half of 128 outputs
    try:
        step_ms = [forward_step_ms(context, args.steps, args.threads)]
        variants = {"before": (before, []), "after": (ROOT, []), "after+record": (ROOT, ["--record", str(work / "traces")])}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for round_ in range(args.rounds):
            for name, (tree, extra) in variants.items():
                proc, url = start(tree, extra, work / f"{name}-{round_}.log", args.threads)
                try:
                    load(url, 4, 4, args)  # warm-up: the first steps of each shape build oneDNN kernels
                    one = load(url, 1, args.requests_1, args)
                    many = load(url, 32, args.requests_32, args)
                finally:
                    stop(proc)
                run = {"itl_p50_ms": one["itl_ms"]["p50"], "tokens_per_s": {"1": one["tokens_per_s"], "32": many["tokens_per_s"]}}
                runs[name].append(run)
                print(f"round {round_ + 1} {name}: {run}", flush=True)
        step_ms.append(forward_step_ms(context, args.steps, args.threads))
        results = {
            name: {
                "itl_p50_ms": min(r["itl_p50_ms"] for r in rs),
                "tokens_per_s": {k: max(r["tokens_per_s"][k] for r in rs) for k in ("1", "32")},
            }
            for name, rs in runs.items()
        }
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    step = statistics.mean(step_ms)
    print(f"\nforward step, 1 decode row at context {context}, {args.threads} thread(s): {step_ms[0]:.2f} ms before the servers ran, {step_ms[1]:.2f} ms after")
    print(f"best of {args.rounds} round(s) per variant:")
    print("| variant | ITL p50 ms | ITL p50 - step ms | tok/s at 1 | tok/s at 32 |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['itl_p50_ms']:.1f} | {r['itl_p50_ms'] - step:.1f} | {r['tokens_per_s']['1']:.1f} | {r['tokens_per_s']['32']:.1f} |")
    cost = 1 - results["after+record"]["tokens_per_s"]["32"] / results["after"]["tokens_per_s"]["32"]
    print(f"recording cost at 32: {cost * 100:.1f}% of tokens/s")
    summary = {
        "step_ms": round(step, 2),
        "overhead_ms": {k: round(v["itl_p50_ms"] - step, 2) for k, v in results.items()},
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in results.items()},
        "record_cost_32": round(cost, 4),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
