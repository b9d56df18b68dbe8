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
trace's float kernels are only held to a tolerance across levels."""

from __future__ import annotations

from pathlib import Path

import pytest

from trioserve.core.replay import replay_trace
from trioserve.kernels import native

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TRACES = {"gguf_f32": FIXTURES / "pre26-tiny-f32.jsonl", "gguf_q4_1": FIXTURES / "pre26-tiny-q4_1.jsonl"}


@pytest.mark.parametrize("kind", sorted(TRACES))
def test_a_trace_from_before_the_redesign_replays_identical_on_the_core(tiny_checkpoints, kind):
    summary = replay_trace(TRACES[kind], checkpoint=tiny_checkpoints[kind])
    assert summary.difference is None, summary.difference.report()
    assert summary.submits == 11 and summary.finals == 11 and summary.steps > 30, summary.report("fast")


def test_a_trace_from_before_the_redesign_replays_identical_on_the_model(tiny_checkpoints):
    if not native.int4_q8_supported(16, 32):
        pytest.skip("the trace ran int8 activations, which need the C kernels (AVX2, AVX-512 VNNI or NEON dotprod, and a C compiler)")
    summary = replay_trace(TRACES["gguf_q4_1"], checkpoint=tiny_checkpoints["gguf_q4_1"], model=True)
    assert summary.difference is None, summary.difference.report()
    assert summary.model_steps == summary.steps > 30, summary.report("model")
