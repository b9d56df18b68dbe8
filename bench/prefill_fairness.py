"""Short requests beside long prompts of the same tenant (#49, item 8): the
time to first token of short requests that arrive while long prompts are
being prefilled, with each step's prefill budget shared evenly between the
requests (today's `prefill_sharing="requests"`) and in admission order
(before #49, and what older traces replay with: "tenants"). One engine, the
default model, the two arms in alternating rounds of one run.

Each round: LONGS prompts of about LONG_TOKENS tokens are submitted at
once, then SHORTS prompts of a few tokens, one every GAP_S, while those
prefill; every request generates one token. Prompts differ per round and
arm, so the prefix cache never serves one from another.

    .venv/bin/python bench/prefill_fairness.py [--rounds 3] [--longs 3] [--long-tokens 1500] [--shorts 8]

Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import trio

from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.kernels.cpu import cpu_flags
from trioserve.types import GenerateRequest, SamplingParams

ARMS = ("requests", "tenants")
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def ttft(engine, prompt: list[int], out: list[float]) -> None:
    started = time.perf_counter()
    async for _ in engine.generate(GenerateRequest(prompt, PARAMS)):
        out.append(time.perf_counter() - started)  # the first event: the token (or the end)
        break


async def one_round(engine, arm: str, tag: str, longs: int, long_tokens: int, shorts: int, gap_s: float) -> dict:
    engine._scheduler.core.policy.prefill_sharing = arm  # the bench's switch; a server takes today's default
    tok = engine.tokenizer
    filler = tok.encode(" the quiet river runs past the old mill and on to the sea", add_bos=False)
    long_out: list[float] = []
    short_out: list[float] = []
    async with trio.open_nursery() as nursery:
        for i in range(longs):
            head = tok.encode(f"[{tag} long {i}]", add_bos=False)
            nursery.start_soon(ttft, engine, (head + filler * (long_tokens // len(filler) + 1))[:long_tokens], long_out)
        for i in range(shorts):
            await trio.sleep(gap_s)
            nursery.start_soon(ttft, engine, tok.encode(f"[{tag} short {i}] Say hello.", add_bos=False), short_out)
    return {"long": long_out, "short": short_out}


async def main(args) -> dict:
    config = EngineConfig(kv_cache_bytes=1 << 30, prefill_budget=args.prefill_budget)
    rows: dict[str, dict[str, list[float]]] = {arm: {"long": [], "short": []} for arm in ARMS}
    async with open_engine(config) as engine:
        await one_round(engine, "requests", "warm", 1, 64, 1, 0.0)
        for r in range(args.rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                got = await one_round(engine, arm, f"r{r}-{arm}", args.longs, args.long_tokens, args.shorts, args.gap)
                for kind in ("long", "short"):
                    rows[arm][kind] += got[kind]
    summary = {
        arm: {
            "short_ttft_p50_s": statistics.median(v["short"]),
            "short_ttft_p99_s": percentile(v["short"], 0.99),
            "long_ttft_mean_s": statistics.fmean(v["long"]),
            "long_ttft_max_s": max(v["long"]),
            "shorts": len(v["short"]),
        }
        for arm, v in rows.items()
    }
    return {
        "bench": "prefill_fairness",
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni"})},
        "setting": {k: getattr(args, k) for k in ("rounds", "longs", "long_tokens", "shorts", "gap", "prefill_budget")},
        "arms": summary,
        "short_p99_ratio_tenants_over_requests": summary["tenants"]["short_ttft_p99_s"] / summary["requests"]["short_ttft_p99_s"],
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--longs", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between two short requests")
    parser.add_argument("--prefill-budget", type=int, default=512)
    args = parser.parse_args()
    report = trio.run(main, args)
    print(f"{'arm':10} {'short p50 s':>12} {'short p99 s':>12} {'long mean s':>12} {'long max s':>11}")
    for arm, s in report["arms"].items():
        print(f"{arm:10} {s['short_ttft_p50_s']:12.3f} {s['short_ttft_p99_s']:12.3f} {s['long_ttft_mean_s']:12.3f} {s['long_ttft_max_s']:11.3f}")
    print(json.dumps(report))


if __name__ == "__main__":
    cli()
