"""The per-step choice of CPU threads (kernels/cpu.py ThreadGovernor): the
policy on given timings, and the premise it rests on, that the C kernels
with int8 activations give a step the same bits on any thread count."""

from __future__ import annotations

import pytest
import torch

from trioserve.models.step_runner import thread_governor
from trioserve.kernels import native
from trioserve.kernels.cpu import ThreadGovernor
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step


def _run(governor: ThreadGovernor, tokens: int, seconds_on: dict[int, float], steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        threads = governor.choose(tokens)
        governor.record(tokens, threads, seconds_on[threads])
        chosen.append(threads)
    return chosen


def test_each_count_is_tried_then_the_fastest_runs_with_a_look_at_the_others():
    g = ThreadGovernor(2, explore_every=8)
    assert g.choices == [2, 1]
    chosen = _run(g, 1, {2: 0.008, 1: 0.013}, 24)
    assert chosen[:2] == [2, 1]  # each once, all the cores first
    assert chosen[2:] == [2, 2, 2, 2, 2, 1, 2, 2, 2, 2, 2, 2, 2, 1, 2, 2, 2, 2, 2, 2, 2, 1]  # every 8th step of the size looks again
    assert g.cost(1, 2) == pytest.approx(0.008) and g.cost(1, 1) == pytest.approx(0.013)


def test_a_busy_core_moves_the_steps_to_fewer_threads_and_back():
    g = ThreadGovernor(2, explore_every=8)
    _run(g, 32, {2: 0.044, 1: 0.072}, 10)
    assert g.choose(32) == 2
    busy = _run(g, 32, {2: 0.278, 1: 0.072}, 20)  # another process takes one core
    # One slow step is enough to switch; after it only the periodic looks use 2.
    assert busy[0] == 2 and busy[1] == 1 and busy[1:].count(2) <= 3
    quiet = _run(g, 32, {2: 0.044, 1: 0.072}, 40)  # it goes away: the next look at 2 threads finds it fast
    assert quiet[-16:].count(1) <= 2  # back on 2 threads, but for the periodic looks at 1


def test_step_sizes_are_judged_apart_and_one_core_has_no_choice():
    g = ThreadGovernor(4, explore_every=1000)
    assert g.choices == [4, 3, 1]
    _run(g, 1, {4: 0.009, 3: 0.008, 1: 0.012}, 5)
    _run(g, 512, {4: 0.2, 3: 0.25, 1: 0.7}, 5)
    assert g.choose(1) == 3 and g.choose(2) == 4  # 2 tokens: a size not yet seen
    assert g.choose(300) == 4  # 300 and 512 tokens share a bucket
    assert ThreadGovernor(1).choices == [1]


def test_the_int8_c_kernels_give_a_step_the_same_bits_on_any_thread_count(tiny_checkpoints):
    if not native.int4_q8_supported(16, 32):  # the model would refuse int8 activations
        pytest.skip("no C kernels with int8 activations here (no AVX2, AVX-512 VNNI or NEON dotprod, or no C compiler)")
    ckpt = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.float32)
    model = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, activations="int8")
    assert model.kernels.thread_invariant
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert thread_governor(model) is not None
        out = {}
        for threads in (2, 1):
            torch.set_num_threads(threads)
            cache = model.new_kv_cache(16, 4)
            prompt = build_step([SeqChunk(list(range(3, 40)), 0, list(range(10))), SeqChunk([7, 8, 9], 0, [10])], 4, fixed=True)
            first = model.forward(prompt, cache)
            decode = build_step([SeqChunk([5], 37, list(range(10)), decode=True), SeqChunk([6], 3, [10], decode=True)], 4, fixed=True)
            out[threads] = (first, model.forward(decode, cache))
        assert all(torch.equal(a, b) for a, b in zip(out[2], out[1], strict=True))
    finally:
        torch.set_num_threads(before)
    reference = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, activations="bf16")
    assert not reference.kernels.thread_invariant and thread_governor(reference) is None


def test_a_long_step_does_not_try_a_count_that_lost_everywhere_else():
    """A prompt's chunk (64 tokens or more) on a quiet machine: one thread
    lost in the decode steps, so the chunks all run on both cores but for
    the periodic look (before, the second chunk of a size ran on one thread,
    doubling that prompt's time to first token)."""
    g = ThreadGovernor(2, explore_every=8)
    _run(g, 1, {2: 0.008, 1: 0.013}, 3)
    chunks = _run(g, 110, {2: 0.5, 1: 0.9}, 16)
    assert chunks == [2] * 7 + [1] + [2] * 7 + [1]  # only the 8th step of the size looks at one thread
    assert g.cost(110, 1) == pytest.approx(0.9)


def test_a_long_step_tries_fewer_threads_at_once_where_they_won_elsewhere():
    """A busy core: the decode steps found one thread faster, so the first
    prompt chunk after that tries one thread at its second step, not its
    explore_every-th."""
    g = ThreadGovernor(2, explore_every=64)
    _run(g, 4, {2: 0.278, 1: 0.072}, 3)
    assert _run(g, 300, {2: 2.0, 1: 0.9}, 4) == [2, 1, 1, 1]
    # With nothing measured anywhere, a long step starts on all the cores.
    assert ThreadGovernor(4).choose(512) == 4
