"""Traces recorded before the step-runner redesign (#26) still replay
identical. Both were recorded at 4657e30 (the worker and sampler actors of
before, their own step functions) by tests/core/test_replay.py's `record`
on the tiny model this test tree writes (the same bytes every time, so the
recorded checkpoint digests match): one on its F32 GGUF, one on its Q4_1
GGUF with int8 activations, on an AVX2 CPU.

Fast mode (the recorded results fed back to a fresh core) checks that the
core makes the same decisions; model mode re-runs every step through
today's StepRunner and checks each result equals the recorded one. Model
mode runs the Q4_1 trace: its int8-activation kernels give the same bits at
every instruction-set level (tests/test_cpu_levels.py), while the F32
trace's float kernels are only held to a tolerance across levels. Both
sampled with torch's arithmetic, before the fixed order
(kernels/sampler_math.py), on an AVX2 CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trioserve import cli
from trioserve.core.replay import replay_trace
from trioserve.kernels import native
from trioserve.kernels.cpu import cpu_flags

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TRACES = {"gguf_f32": FIXTURES / "pre26-tiny-f32.jsonl", "gguf_q4_1": FIXTURES / "pre26-tiny-q4_1.jsonl"}


@pytest.mark.parametrize("kind", sorted(TRACES))
def test_a_trace_from_before_the_redesign_replays_identical_on_the_core(tiny_checkpoints, kind):
    summary = replay_trace(TRACES[kind], checkpoint=tiny_checkpoints[kind])
    assert summary.difference is None, summary.difference.report()
    assert summary.submits == 11 and summary.finals == 11 and summary.steps > 30, summary.report("fast")


def test_a_trace_from_before_the_redesign_replays_identical_on_the_model(tiny_checkpoints, capsys):
    """It sampled with torch's arithmetic, whose last bits follow torch's
    CPU capability (an AVX2 machine's here), and its header names no CPU
    class: on a wider CPU the replay tries torch's narrower levels in a child
    process (core/replay.py) and must find the recorded bits at one."""
    if not native.int4_q8_supported(16, 32):
        pytest.skip("the trace ran int8 activations, which need the C kernels (AVX2, AVX-512 VNNI or NEON dotprod, and a C compiler)")
    status = cli.main(["replay", str(TRACES["gguf_q4_1"]), "--model", "--checkpoint", str(tiny_checkpoints["gguf_q4_1"])])
    out, err = capsys.readouterr()
    assert (status, err) == (0, ""), out + err
    found = re.search(r"identical: \d+ records, 11 requests, (\d+) steps \((\d+) re-run on the model\), \d+ tokens, 11 finished", out)
    assert found and found[1] == found[2] and int(found[1]) > 30, out


def test_the_legacy_sampler_arithmetic_is_what_the_trace_recorded(tiny_checkpoints):
    """At torch's AVX2 level (this CPU's own, or pinned in a child process)
    the replay is identical in-process: the torch arithmetic kept for old
    traces (kernels/sampler_math.TORCH) is the sampler's of before."""
    if not native.int4_q8_supported(16, 32):
        pytest.skip("the trace ran int8 activations, which need the C kernels (AVX2, AVX-512 VNNI or NEON dotprod, and a C compiler)")
    if "avx2" not in cpu_flags():
        pytest.skip("the trace was recorded at torch's AVX2 level, which this CPU cannot run")
    code = (
        "import sys; from trioserve.core.replay import replay_trace; "
        "s = replay_trace(sys.argv[1], checkpoint=sys.argv[2], model=True); "
        "print(s.difference.report() if s.difference else 'same', s.model_steps)"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(TRACES["gguf_q4_1"]), str(tiny_checkpoints["gguf_q4_1"])],
        env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    assert done.stdout.split()[0] == "same", done.stdout + done.stderr
