"""`max_step_s` through the EngineCore: a step's time is what passes between
its plan and its result, by the callers' clocks, so while other requests
decode a long prompt goes in chunks that fit the time; and since those
times are in the trace, a replay plans the very same chunks (and a trace
whose times were changed plans others, which replay names).

The step results are written here (no model): each sampling row gets
token A, and each step "takes" the made-up machine's time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trioserve.core.engine_core import CoreSettings, new_core
from trioserve.core.replay import replay_trace
from trioserve.core.trace import Recording, TraceWriter, header
from trioserve.models.checkpoint import checkpoint_digest, load_tokenizer
from trioserve.types import GenerateRequest, Sampled, SamplingParams, StepPlan, StepResult

A = 35  # "A" in the tiny tokenizer
DECODE_S, TOKEN_S = 0.25, 1 / 256  # exact in binary, so the sums below are too


def settings(max_step_s: float) -> CoreSettings:
    return CoreSettings(num_blocks=1024, block_size=4, max_num_seqs=4, max_model_len=2048, prefill_budget=512, max_queue=8, max_step_s=max_step_s)


def took(plan: StepPlan) -> float:
    """The made-up machine: DECODE_S for any decode rows, TOKEN_S a prompt token."""
    prompt = sum(len(r.token_ids) for r in plan.rows if not r.decode)
    return (DECODE_S if any(r.decode for r in plan.rows) else 0.0) + TOKEN_S * prompt


def run(core, now: float) -> tuple[float, StepPlan]:
    """One step: plan at ``now``, its result after the machine's time."""
    _, plan = core.plan(now)
    assert plan is not None
    now += took(plan)
    sampled = tuple((Sampled(A, 0),) for r in plan.rows if r.sample is not None)
    core.result(StepResult(plan.number, sampled), now)
    return now, plan


def drive(core) -> list[int]:
    """Two requests decode, then a 1,500-token prompt arrives: the sizes of
    its first four chunks."""
    greedy = SamplingParams(max_tokens=400, temperature=0.0, seed=0, ignore_eos=True)
    now = 1.0
    for rid in ("d1", "d2"):
        assert core.submit(rid, GenerateRequest([A, A], greedy), now) is None
    for _ in range(2):  # their prompts, then a step of decode rows alone
        now, _ = run(core, now)
    assert core.submit("long", GenerateRequest([A] * 1500, SamplingParams(max_tokens=2, temperature=0.0, seed=0)), now) is None
    sizes = []
    for _ in range(4):
        now, plan = run(core, now)
        sizes.append(sum(len(r.token_ids) for r in plan.rows if r.request_id == "long"))
    return sizes


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    path = Path(tiny_checkpoints["gguf_f32"])
    return path, checkpoint_digest(path), load_tokenizer(path)


def test_chunks_fit_the_step_time_and_replay_plans_the_same(checkpoint, tmp_path):
    path, digest, tok = checkpoint
    trace = tmp_path / "trace.jsonl"
    writer = TraceWriter(trace, header(settings(0.5), checkpoint_path=str(path), digest=digest, engine={}, vocab_size=tok.vocab_size))
    # The whole budget until a step has priced a prompt token; then (0.5 - 0.25) / (1/256).
    assert drive(Recording(new_core(settings(0.5), tok), writer)) == [510, 64, 64, 64]
    took_step_3 = DECODE_S + 510 * TOKEN_S
    writer.close()
    assert replay_trace(trace).difference is None

    # The first step to carry prompt tokens beside decode rows (step 3) took
    # twice as long: the replay plans smaller chunks after it, and says where.
    slow = []
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        if record.get("in") == "result" and record["result"]["step"] == 3:
            record["now"] += took_step_3
        slow.append(json.dumps(record))
    tampered = tmp_path / "slow.jsonl"
    tampered.write_text("\n".join(slow) + "\n")
    difference = replay_trace(tampered).difference
    assert difference is not None and (difference.what, difference.step) == ("plan", 4)
    assert difference.expected["rows"][2][2] == 64
    # a prompt token now costs (2 x step 3's time - the decode part) / 510; 1/4 s of them
    assert difference.actual["rows"][2][2] == int(DECODE_S / ((2 * took_step_3 - DECODE_S) / 510)) == 30


def test_off_by_default_and_in_old_traces(checkpoint, tmp_path):
    path, digest, tok = checkpoint
    assert CoreSettings(num_blocks=1, block_size=1, max_num_seqs=1, max_model_len=1, prefill_budget=2, max_queue=1).max_step_s == 0.0
    trace = tmp_path / "trace.jsonl"
    writer = TraceWriter(trace, header(settings(0.0), checkpoint_path=str(path), digest=digest, engine={}, vocab_size=tok.vocab_size))
    assert drive(Recording(new_core(settings(0.0), tok), writer)) == [510, 510, 480, 1]  # the last: its one decode token
    writer.close()
    # A trace from before the setting existed: its header has no max_step_s, and it replays as off.
    lines = trace.read_text().splitlines()
    head = json.loads(lines[0])
    del head["core"]["max_step_s"]
    old = tmp_path / "old.jsonl"
    old.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    summary = replay_trace(old)
    assert summary.difference is None and summary.lines == len(lines) - 1
