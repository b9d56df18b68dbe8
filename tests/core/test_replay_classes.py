"""A trace replays on another CPU class (#47).

The fixtures avx512-tiny-q4_1.jsonl and avx512-tiny-q8_0.jsonl were
recorded on an AMD EPYC with AVX-512 (VNNI, BF16) by tests/core/test_replay.py's
`record` on the tiny model this test tree writes (the same bytes every
time): greedy, seeded and top-k/top-p sampling, top logprobs, penalties, a
stop string, a guided request and a cancelled one, with int8 activations
and the fixed-order sampler (kernels/sampler_math.py); their headers name
that class (torch AVX512, C kernels avx512-vnni).

Checked, each replay in a child process pinned to a level
(`TRIOSERVE_CPU_FEATURES`, `ATEN_CPU_CAPABILITY`) with no fallback
(`TRIOSERVE_REPLAY_PINNED`): both replay identically at every level this
CPU can run. A trace whose header names a class this CPU cannot run, and
whose bits differ here, ends with status 3 and one line saying so; one of
this class with a changed result is a difference (status 1), and so is one
of a runnable other class, after the replay at its level. A new recording's
header names this machine's class. And the property: random prompts and
sampling settings recorded here replay identically at every level."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio

from tests.core.test_replay import BS, KV_BYTES_PER_TOKEN, run
from trioserve import cli
from trioserve.config import EngineConfig
from trioserve.core.replay import PINNED_ENV
from trioserve.engine import open_engine
from trioserve.kernels import native, native_build
from trioserve.kernels.cpu import level_fits
from trioserve.models.checkpoint import load_checkpoint
from trioserve.types import GenerateRequest, SamplingParams

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TRACES = {"gguf_q4_1": FIXTURES / "avx512-tiny-q4_1.jsonl", "gguf_q8_0": FIXTURES / "avx512-tiny-q8_0.jsonl"}
ATEN_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"), "avx2": ("avx2", "fma"), "default": ()}


def _runnable(level: str, aten: str) -> str | None:
    from trioserve.kernels.cpu import cpu_flags

    if native_build.library_at("native") is None:
        return "the C kernels do not build here"
    unfit = level_fits(level)
    if unfit:
        return unfit
    if not all(f in cpu_flags() for f in ATEN_FLAGS[aten]):
        return f"torch's {aten} level needs {', '.join(ATEN_FLAGS[aten])}"
    return None


def replay_at(trace: Path, checkpoint: Path, level: str, aten: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRIOSERVE_CPU_FEATURES": level, "ATEN_CPU_CAPABILITY": aten, PINNED_ENV: "1"}
    return subprocess.run(
        [sys.executable, "-m", "trioserve", "replay", str(trace), "--model", "--checkpoint", str(checkpoint)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


# Each trace at a few levels, together every kernel level and each of torch's (a child process each).
CASES = [("gguf_q4_1", "native", "avx512"), ("gguf_q4_1", "avx2", "avx2"), ("gguf_q4_1", "generic", "default"),
         ("gguf_q8_0", "avx2", "default"), ("gguf_q8_0", "generic", "avx2")]  # fmt: skip


@pytest.mark.parametrize(("kind", "level", "aten"), CASES, ids=["-".join(c) for c in CASES])
def test_an_avx512_trace_replays_identically_at_every_level(tiny_checkpoints, kind, level, aten):
    why = _runnable(level, aten)
    if why:
        pytest.skip(why)
    head = json.loads(TRACES[kind].read_text().splitlines()[0])
    assert head["sampler"] == "fixed" and head["cpu"]["torch"] == "AVX512" and head["cpu"]["activations"] == "int8"
    done = replay_at(TRACES[kind], tiny_checkpoints[kind], level, aten)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "replay (model): identical: " in done.stdout and "11 requests" in done.stdout, done.stdout


def _tamper_logprob(trace: Path, dest: Path, cpu: dict | None = None) -> int:
    """A copy of ``trace`` whose first recorded logprob is changed in its last
    bit (and whose header's class is ``cpu``, when given); the step changed."""
    lines = trace.read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    if cpu is not None:
        head["cpu"] = {**head["cpu"], **cpu}
        lines[0] = json.dumps(head, separators=(",", ":")) + "\n"
    for number, line in enumerate(lines[1:], start=1):
        record = json.loads(line)
        for row in (record.get("result") or {}).get("sampled", []):
            for sampled in row:
                if sampled[2] is not None:
                    sampled[2] = float(torch.tensor(sampled[2]).nextafter(torch.tensor(-1.0)))
                    lines[number] = json.dumps(record, separators=(",", ":")) + "\n"
                    dest.write_text("".join(lines))
                    return record["result"]["step"]
    raise AssertionError("no logprob in the trace")


def _here() -> dict:
    return {"arch": os.uname().machine, "torch": torch.backends.cpu.get_cpu_capability(), "cpu_kernels": native.isa()}


def test_a_class_this_cpu_cannot_run_is_status_3_in_one_line(tiny_checkpoints, tmp_path, capsys):
    if native_build.library_at("native") is None:
        pytest.skip("the trace ran int8 activations, which need the C kernels")
    kind = "gguf_q4_1"
    step = _tamper_logprob(TRACES[kind], tmp_path / "other.jsonl", {"arch": "riscv64", "cpu_kernels": "rvv"})
    status = cli.main(["replay", str(tmp_path / "other.jsonl"), "--model", "--checkpoint", str(tiny_checkpoints[kind])])
    out, err = capsys.readouterr()
    assert status == 3, out + err
    assert "DIFFERENT" not in out and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert "came from another CPU class (riscv64, torch AVX512, C kernels rvv" in line, line
    assert f"step {step} gave other bits here" in line and "it ran on riscv64" in line, line


def test_a_changed_result_of_this_class_is_a_difference(tiny_checkpoints, tmp_path, capsys):
    if native_build.library_at("native") is None:
        pytest.skip("the trace ran int8 activations, which need the C kernels")
    kind = "gguf_q8_0"
    step = _tamper_logprob(TRACES[kind], tmp_path / "same.jsonl", _here())
    status = cli.main(["replay", str(tmp_path / "same.jsonl"), "--model", "--checkpoint", str(tiny_checkpoints[kind])])
    out, err = capsys.readouterr()
    assert (status, err) == (1, ""), out + err
    assert out.startswith(f"DIFFERENT step result at line") and f"step {step}," in out.splitlines()[0], out


def test_a_changed_result_of_a_runnable_class_is_a_difference_at_its_level(tiny_checkpoints, tmp_path, capsys):
    """The header says AVX2 (which an AVX-512 CPU runs): the replay differs
    here, runs again at torch's AVX2 and the avx2 kernels, and differs there
    too, so the difference stands (status 1), shown from that run."""
    why = _runnable("avx2", "avx2")
    if why:
        pytest.skip(why)
    here = _here()
    other = {"torch": "AVX2", "cpu_kernels": "avx2"} if here["cpu_kernels"] != "avx2" else {"torch": "DEFAULT", "cpu_kernels": "generic"}
    kind = "gguf_q4_1"
    step = _tamper_logprob(TRACES[kind], tmp_path / "runnable.jsonl", other)
    status = cli.main(["replay", str(tmp_path / "runnable.jsonl"), "--model", "--checkpoint", str(tiny_checkpoints[kind])])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert out.startswith("DIFFERENT step result") and f"step {step}," in out.splitlines()[0], out


async def _record_random(path: Path, record_dir: Path, rng: random.Random) -> None:
    config = EngineConfig(
        model=str(path), dtype="float32", kv_cache_bytes=96 * BS * KV_BYTES_PER_TOKEN, block_size=BS, max_num_seqs=4,
        prefill_budget=16, record_dir=str(record_dir),
    )  # fmt: skip
    async with open_engine(config, checkpoint=load_checkpoint(path, dtype=torch.float32)) as engine:
        vocab = engine.tokenizer.vocab_size
        requests = []
        for i in range(6):
            prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(1, 30)))
            logprobs = rng.random() < 0.7
            params = SamplingParams(
                max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 0.7, 1.0, 1.6]), seed=rng.randrange(2**63),
                top_k=rng.choice([0, 0, 5, 50]), top_p=rng.choice([1.0, 1.0, 0.8, 0.95]), min_p=rng.choice([0.0, 0.0, 0.05]),
                logprobs=logprobs, top_logprobs=rng.randint(0, 5) if logprobs else 0, frequency_penalty=rng.choice([0.0, 0.3]), ignore_eos=True,
            )  # fmt: skip
            requests.append(GenerateRequest(prompt, params, request_id=f"r{i}"))
        async with trio.open_nursery() as nursery:
            for request in requests:
                nursery.start_soon(run, engine, request)


@pytest.mark.parametrize("seed", [random.randrange(2**32)])
def test_random_requests_recorded_here_replay_identically_at_every_level(tiny_checkpoints, tmp_path, seed):
    """A property: whatever the prompts and settings (drawn afresh each run;
    the seed is in the test's id), the tokens, draws and logprobs are the
    same bits at the narrower levels (the C kernels' avx2 and generic, torch's
    DEFAULT and AVX2) as at this CPU's own."""
    own = ("native", torch.backends.cpu.get_cpu_capability().lower())
    runnable = [(level, aten) for level, aten in (("avx2", "default"), ("generic", "avx2")) if not _runnable(level, aten) and (level, aten) != own]
    if not runnable:
        pytest.skip("this CPU runs one level only")
    kind = "gguf_q4_1"
    trio.run(_record_random, tiny_checkpoints[kind], tmp_path / "rec", random.Random(seed))
    (trace,) = (tmp_path / "rec").iterdir()
    head = json.loads(trace.read_text().splitlines()[0])
    assert head["sampler"] == "fixed" and {k: head["cpu"][k] for k in ("arch", "torch", "cpu_kernels")} == _here(), head
    for level, aten in runnable:
        done = replay_at(trace, tiny_checkpoints[kind], level, aten)
        assert done.returncode == 0, f"seed {seed}, {level}/{aten}:\n{done.stdout}{done.stderr}"
        assert "identical: " in done.stdout and "6 requests" in done.stdout, done.stdout
