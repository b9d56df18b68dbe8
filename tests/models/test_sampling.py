"""The sampling math: the counter-based stream, the draw, the masks on
distributions worked out by hand, penalties, logprobs and validation."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trioserve.errors import TrioserveError
from trioserve.kernels.logits import processed_logits
from trioserve.models.sampling import choose, new_seed, sample_rows, uniform
from trioserve.types import SampleRow, Sampled, SamplingError, SamplingParams

# ---------------------------------------------------------------- the stream


def test_uniform_is_a_pure_function_in_range() -> None:
    pairs = [(seed, index) for seed in (0, 1, 2, 12345, 2**63 - 1) for index in (0, 1, 2, 999, 2**40)]
    first = [uniform(seed, index) for seed, index in pairs]
    assert all(0.0 <= u < 1.0 for u in first)
    assert [uniform(seed, index) for seed, index in reversed(pairs)] == first[::-1]
    assert len(set(first)) == len(pairs)  # neighbouring seeds and indices differ


def test_uniform_is_philox4x64_as_numpy_computes_it() -> None:
    # numpy's Philox steps its counter once before the first block, so the
    # block at counter `index` is the first output of a generator set to index - 1.
    for seed, index in [(0, 0), (7, 1), (12345, 678), (2**63 - 1, 2**33 + 5)]:
        word = int(np.random.Philox(key=seed, counter=(index - 1) % 2**256).random_raw())
        assert uniform(seed, index) == (word >> 11) / 2**53


def test_uniform_is_the_same_in_another_process() -> None:
    pairs = [(3, 0), (3, 1), (99, 5), (2**62 + 1, 12)]
    code = f"from trioserve.models.sampling import uniform; print(repr([uniform(s, i) for s, i in {pairs!r}]))"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=root)
    assert eval(out.stdout) == [uniform(s, i) for s, i in pairs]


@pytest.mark.parametrize("along", ["index", "seed"])
def test_uniform_looks_uniform(along: str) -> None:
    n = 20_000
    us = np.array([uniform(42, i) if along == "index" else uniform(i, 42) for i in range(n)])
    # Mean 1/2 and variance 1/12 with standard errors of about 0.002 and 0.0006.
    assert abs(us.mean() - 0.5) < 0.01
    assert abs(us.var() - 1 / 12) < 0.004
    counts = np.bincount((us * 20).astype(int), minlength=20)
    chi2 = float(((counts - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < 60  # 19 degrees of freedom: the mean is 19, and 60 is far out in the tail


def test_uniform_refuses_out_of_range() -> None:
    with pytest.raises(ValueError):
        uniform(-1, 0)
    with pytest.raises(ValueError):
        uniform(0, -1)


def test_new_seed() -> None:
    seeds = {new_seed() for _ in range(8)}
    assert len(seeds) == 8
    assert all(0 <= s < 2**63 for s in seeds)


# ------------------------------------------------------------------ the draw


def test_choose_gives_each_token_its_slice_of_u() -> None:
    w = torch.tensor([0.125, 0.0, 0.375, 0.5]) * 3  # any positive total
    assert choose(w, 0.0) == 0
    assert choose(w, 0.125 - 1e-9) == 0
    assert choose(w, 0.125) == 2  # token 0 owns [0, 0.125), token 2 [0.125, 0.5)
    assert choose(w, 0.5 - 1e-9) == 2
    assert choose(w, 0.5) == 3
    assert choose(w, 1 - 2**-53) == 3


def test_choose_sweep_across_blocks() -> None:
    # Weights spread over several 256-token blocks, including a short last one.
    w = torch.zeros(1000)
    mass = {3: 1.0, 255: 2.0, 256: 3.0, 700: 0.5, 998: 1.5, 999: 2.0}
    for token, m in mass.items():
        w[token] = m
    total = sum(mass.values())
    grid = 4000
    counts: dict[int, int] = {}
    for k in range(grid):
        token = choose(w, (k + 0.5) / grid)
        counts[token] = counts.get(token, 0) + 1
    assert set(counts) == set(mass)
    for token, m in mass.items():
        assert abs(counts[token] / grid - m / total) <= 1 / grid


# ------------------------------------------------------ batching and greedy


def _random_params(rng: np.random.Generator) -> SamplingParams:
    kind = int(rng.integers(6))
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=float(rng.uniform(0.3, 1.5))),
        SamplingParams(temperature=0.9, top_k=int(rng.integers(1, 40))),
        SamplingParams(temperature=0.9, top_p=float(rng.uniform(0.2, 0.95)), min_p=0.02),
        SamplingParams(temperature=1.1, presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, logit_bias=((1, 5.0), (2, -100.0)), logprobs=True, top_logprobs=3),
    ][kind]


TARGETS = {
    "plain": SamplingParams(temperature=0.7),
    "filters": SamplingParams(temperature=1.2, top_k=50, top_p=0.8, min_p=0.01),
    "top_p": SamplingParams(temperature=2.0, top_p=0.9),
    "penalties": SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5),
    "logprobs": SamplingParams(temperature=0.9, logit_bias=((7, 3.0),), logprobs=True, top_logprobs=5),
    "greedy": SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=True, top_logprobs=2),
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_draw_does_not_depend_on_the_batch(name: str) -> None:
    vocab = 5000  # not a multiple of the 256-token blocks
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(2)
    history = [int(t) for t in rng.integers(0, vocab, 300)]
    target_logits = torch.randn(vocab, generator=gen) * 3
    for index in range(8):
        row = SampleRow(TARGETS[name], seed=987654321, draw_index=index, history=history)
        alone = sample_rows(target_logits[None, :], [row])
        others = [
            SampleRow(_random_params(rng), seed=int(rng.integers(2**63)), draw_index=int(rng.integers(100)), history=history)
            for _ in range(16)
        ]
        logits = torch.randn(16, vocab, generator=gen) * 3
        logits[5] = target_logits
        others[5] = row
        assert sample_rows(logits, others)[5] == alone[0]


def test_greedy_is_argmax_and_takes_no_draw() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.9]] * 3)
    rows = [SampleRow(SamplingParams(temperature=0.0), seed=s, draw_index=s * 7, history=()) for s in range(3)]
    assert sample_rows(logits, rows) == [Sampled(token=1, draws=0, logprob=None, top_logprobs=())] * 3


def test_a_sampled_token_takes_one_draw() -> None:
    out = sample_rows(torch.zeros(2, 10), [SampleRow(SamplingParams(), seed=5, draw_index=i, history=()) for i in range(2)])
    assert [s.draws for s in out] == [1, 1]


def test_logits_are_left_alone_and_any_float_dtype_works() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    params = SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.5, logit_bias=((3, 2.0),))
    rows = [SampleRow(params, seed=1, draw_index=i, history=[3, 4]) for i in range(3)]
    sample_rows(logits, rows)
    assert torch.equal(logits, before)
    low = logits.to(torch.bfloat16)
    assert sample_rows(low, rows) == sample_rows(low.float(), rows)
    with pytest.raises(ValueError):
        sample_rows(logits, rows[:2])


# ----------------------------------------------- masks on a known distribution

# Six tokens with these probabilities at temperature 1 (ids 2 and 5 tie).
PROBS = [0.05, 0.30, 0.10, 0.25, 0.20, 0.10]
# At temperature 0.5 they become p**2 / sum(p**2), sum(p**2) = 0.215:
#   [0.0116, 0.4186, 0.0465, 0.2907, 0.1860, 0.0465]

MASK_CASES = {
    # name: (params, kept ids) -- the kept ids share out u in proportion to p**(1/T)
    "none": (SamplingParams(temperature=1.0), {0, 1, 2, 3, 4, 5}),
    "temperature": (SamplingParams(temperature=0.5), {0, 1, 2, 3, 4, 5}),
    "top_k 3": (SamplingParams(top_k=3), {1, 3, 4}),
    # 0.30, 0.25, 0.20, then 0.10 twice: the lower id stays.
    "top_k 4 tie": (SamplingParams(top_k=4), {1, 3, 4, 2}),
    # 0.30 + 0.25 = 0.55 reaches 0.5.
    "top_p 0.5": (SamplingParams(top_p=0.5), {1, 3}),
    # 0.30 + 0.25 = 0.55 < 0.7; + 0.20 = 0.75.
    "top_p 0.7": (SamplingParams(top_p=0.7), {1, 3, 4}),
    # After temperature 0.5: 0.4186 + 0.2907 = 0.7093 already reaches 0.7.
    "temperature then top_p": (SamplingParams(temperature=0.5, top_p=0.7), {1, 3}),
    # Top-k 4 keeps 0.85 of the mass: 0.353, 0.294, 0.235, 0.118; 0.882 < 0.9.
    "top_k then top_p 0.9": (SamplingParams(top_k=4, top_p=0.9), {1, 3, 4, 2}),
    "top_k then top_p 0.8": (SamplingParams(top_k=4, top_p=0.8), {1, 3, 4}),
    "top_p tiny keeps one": (SamplingParams(top_p=1e-6), {1}),
    # Threshold 0.5 * 0.30 = 0.15.
    "min_p 0.5": (SamplingParams(min_p=0.5), {1, 3, 4}),
    # Threshold 0.3 * 0.30 = 0.09 keeps both 0.10s ...
    "min_p 0.3": (SamplingParams(min_p=0.3), {1, 2, 3, 4, 5}),
    # ... but after temperature 0.5 it is 0.3 * 0.4186 = 0.1256.
    "temperature then min_p": (SamplingParams(temperature=0.5, min_p=0.3), {1, 3, 4}),
    # Top-p 0.7 keeps 1, 3, 4 and min-p 0.5 keeps them too. (Min-p first would
    # leave 0.4, 0.333, 0.267, and top-p 0.7 would then keep only 1 and 3.)
    "top_p then min_p": (SamplingParams(top_p=0.7, min_p=0.5), {1, 3, 4}),
}


def _expected_token(u: float, kept: set[int], temperature: float) -> int | None:
    """The token u must give, or None when u sits too near a boundary for the
    float32 logits to decide."""
    mass = {t: PROBS[t] ** (1 / temperature) for t in sorted(kept)}
    total = sum(mass.values())
    edge = 0.0
    for t, m in mass.items():
        edge += m / total
        if abs(u - edge) < 1e-5:
            return None
        if u < edge:
            return t
    raise AssertionError("u beyond the last token")


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_masks_on_a_known_distribution(name: str) -> None:
    params, kept = MASK_CASES[name]
    n = 3000
    logits = torch.log(torch.tensor([PROBS] * n))
    rows = [SampleRow(params, seed=2024, draw_index=i, history=()) for i in range(n)]
    drawn = [s.token for s in sample_rows(logits, rows)]
    assert set(drawn) <= kept
    checked = 0
    for i, token in enumerate(drawn):
        expected = _expected_token(uniform(2024, i), kept, params.temperature)
        if expected is not None:
            assert token == expected, f"draw {i}"
            checked += 1
    assert checked > n - 10


def test_top_p_tie_at_the_cut_keeps_lowest_ids() -> None:
    # Five equal tokens; top_p 0.5 needs three of them (0.6): ids 0, 1, 2.
    rows = [SampleRow(SamplingParams(top_p=0.5), seed=3, draw_index=i, history=()) for i in range(600)]
    drawn = [s.token for s in sample_rows(torch.zeros(600, 5), rows)]
    assert set(drawn) == {0, 1, 2}


def test_frequencies_match_probabilities() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    logits = torch.log(torch.tensor([probs] * n))
    rows = [SampleRow(SamplingParams(temperature=1.0), seed=77, draw_index=i, history=()) for i in range(n)]
    counts = np.bincount([s.token for s in sample_rows(logits, rows)], minlength=4)
    # One standard error is at most sqrt(0.24 / 4000) = 0.008.
    assert np.all(np.abs(counts / n - np.array(probs)) < 0.03)


# ----------------------------------------------------------------- penalties


def _one(params: SamplingParams, history: list[int], logits: list[float]) -> list[float]:
    raw = torch.tensor([logits])
    return processed_logits(raw, [SampleRow(params, seed=0, draw_index=0, history=history)])[0].tolist()


def test_penalties_at_their_defaults_do_no_work() -> None:
    raw = torch.randn(4, 30)
    rows = [SampleRow(SamplingParams(temperature=0.7), seed=0, draw_index=0, history=[1, 2, 3])] * 4
    assert processed_logits(raw, rows) is raw


def test_repetition_divides_positive_and_multiplies_negative() -> None:
    params = SamplingParams(repetition_penalty=2.0)
    assert _one(params, [0, 1, 1], [2.0, -1.0, 0.5, 3.0]) == [1.0, -2.0, 0.5, 3.0]
    params = SamplingParams(repetition_penalty=0.5)  # below 1 encourages repeats
    assert _one(params, [0, 1], [2.0, -1.0, 0.5]) == [4.0, -0.5, 0.5]


def test_presence_once_and_frequency_per_count() -> None:
    logits = [1.0, 1.0, 1.0, 1.0]
    assert _one(SamplingParams(presence_penalty=0.75), [3, 3, 3, 1], logits) == [1.0, 0.25, 1.0, 0.25]
    assert _one(SamplingParams(frequency_penalty=0.5), [3, 3, 3, 1], logits) == [1.0, 0.5, 1.0, -0.5]
    assert _one(SamplingParams(frequency_penalty=-0.25), [2, 2], logits) == [1.0, 1.0, 1.5, 1.0]


def test_processing_order_bias_repetition_presence_frequency() -> None:
    params = SamplingParams(
        logit_bias=((0, 2.0),), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    # Token 0: (2 + 2) / 2 = 2, - 0.5 - 2 * 0.25 = 1. Token 1: unseen, untouched.
    assert _one(params, [0, 0], [2.0, 0.5]) == [1.0, 0.5]


def test_penalties_count_the_prompt() -> None:
    # Token 4 leads, but it was in the prompt (the start of the history).
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.5]])
    prompt, output = [4, 2, 2], [3]
    for params, expected in [
        (SamplingParams(temperature=0.0), 4),
        (SamplingParams(temperature=0.0, presence_penalty=1.0), 1),
        (SamplingParams(temperature=0.0, frequency_penalty=1.0), 1),
        (SamplingParams(temperature=0.0, repetition_penalty=2.0), 1),
    ]:
        row = SampleRow(params, seed=0, draw_index=0, history=prompt + output)
        assert sample_rows(logits, [row])[0].token == expected


# ---------------------------------------------------------------- logit bias


def test_logit_bias_bans_and_forces() -> None:
    n = 2000
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0]] * n)
    for temperature in (0.0, 1.0, 2.0):
        banned = SamplingParams(temperature=temperature, logit_bias=((2, -100.0),))
        tokens = {s.token for s in sample_rows(logits, [SampleRow(banned, 1, i, ()) for i in range(n)])}
        assert 2 not in tokens
        forced = SamplingParams(temperature=temperature, logit_bias=((0, 100.0),))
        tokens = {s.token for s in sample_rows(logits, [SampleRow(forced, 1, i, ()) for i in range(n)])}
        assert tokens == {0}


# ------------------------------------------------------------------ logprobs


def test_logprobs_describe_the_raw_distribution() -> None:
    raw = torch.randn(4, 50, generator=torch.Generator().manual_seed(5)) * 2
    reference = torch.log_softmax(raw.double(), dim=1)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
        SamplingParams(
            temperature=0.3, top_k=3, repetition_penalty=1.8, logit_bias=((9, 4.0),), logprobs=True, top_logprobs=5
        ),
        SamplingParams(temperature=1.0, logprobs=True),
        SamplingParams(temperature=1.0),
    ]
    rows = [SampleRow(p, seed=11, draw_index=0, history=[9, 10, 11]) for p in params]
    out = sample_rows(raw, rows)
    for r in range(3):
        s = out[r]
        assert s.logprob == pytest.approx(float(reference[r, s.token]), abs=1e-5)
    for r in range(2):
        top = out[r].top_logprobs
        assert len(top) == 5
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        best5 = torch.topk(reference[r], 5).indices.tolist()
        assert [t for t, _ in top] == best5
        for t, lp in top:
            assert lp == pytest.approx(float(reference[r, t]), abs=1e-5)
    assert out[0].top_logprobs[0] == (out[0].token, out[0].logprob)  # greedy: the chosen token is the best
    assert out[2].top_logprobs == ()
    assert (out[3].logprob, out[3].top_logprobs) == (None, ())


def test_top_logprobs_ties_by_id_and_short_vocabulary() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    top = sample_rows(logits, [SampleRow(params, 0, 0, ())])[0].top_logprobs
    assert [t for t, _ in top] == [1, 2]
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=20)
    top = sample_rows(logits, [SampleRow(params, 0, 0, ())])[0].top_logprobs
    assert [t for t, _ in top] == [1, 2, 3, 0]
    assert math.fsum(math.exp(lp) for _, lp in top) == pytest.approx(1.0)


# ---------------------------------------------------------------- validation

VOCAB = 100
BAD = [
    (dict(max_tokens=-1), "max_tokens", "at least 0"),  # 0: the prompt alone (prefilled, and scored when asked)
    (dict(prompt_logprobs=21), "prompt_logprobs", "from 0 to 20"),
    (dict(prompt_logprobs=True), "prompt_logprobs", "from 0 to 20"),
    (dict(temperature=3.0), "temperature", "temperature must be between 0 and 2, got 3.0"),
    (dict(temperature=-0.1), "temperature", "got -0.1"),
    (dict(temperature=float("nan")), "temperature", "nan"),
    (dict(top_k=-1), "top_k", "at least 0"),
    (dict(top_p=0.0), "top_p", "greater than 0 and at most 1"),
    (dict(top_p=1.5), "top_p", "got 1.5"),
    (dict(min_p=-0.1), "min_p", "between 0 and 1"),
    (dict(presence_penalty=2.5), "presence_penalty", "between -2 and 2"),
    (dict(frequency_penalty=-3), "frequency_penalty", "between -2 and 2"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "greater than 0"),
    (dict(repetition_penalty=2.1), "repetition_penalty", "at most 2"),
    (dict(logit_bias=((VOCAB, 1.0),)), "logit_bias", "not a token id"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias", "not a token id"),
    (dict(logit_bias=((3, 101.0),)), "logit_bias", "between -100 and 100"),
    (dict(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias", "more than once"),
    (dict(seed=-1), "seed", "2**63 - 1"),
    (dict(seed=2**63), "seed", "2**63 - 1"),
    (dict(top_logprobs=21, logprobs=True), "top_logprobs", "from 0 to 20"),
    (dict(top_logprobs=3), "top_logprobs", "needs logprobs"),
    (dict(stop=("x",) * 17), "stop", "at most 16"),
    (dict(stop=("ok", "")), "stop", "non-empty"),
    (dict(stop_token_ids=(5, VOCAB)), "stop_token_ids", "not a token id"),
]


@pytest.mark.parametrize(("kwargs", "field", "fragment"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_validate_names_the_field(kwargs: dict, field: str, fragment: str) -> None:
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs).validate(VOCAB)
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(field)
    assert fragment in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, TrioserveError)


def test_validate_accepts_the_edges() -> None:
    SamplingParams().validate(VOCAB)
    SamplingParams(
        max_tokens=1,
        temperature=2,
        top_k=10_000,  # beyond the vocabulary: keeps everything
        top_p=1.0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        logit_bias=((0, -100.0), (VOCAB - 1, 100)),
        seed=2**63 - 1,
        logprobs=True,
        top_logprobs=20,
        stop=("a",) * 16,
        stop_token_ids=(0, VOCAB - 1),
    ).validate(VOCAB)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.01).greedy


def test_greedy_ties_take_the_lowest_id() -> None:
    """Step 4's rule: among equal largest logits a greedy row takes the
    lowest id, whatever else shares the step (a greedy row alone, and among
    sampled rows), and a masked-out (-inf) row position never wins."""
    logits = torch.full((3, 300), -5.0)
    logits[0, [7, 3, 250]] = 2.5  # three-way tie: 3
    logits[1, [299, 100]] = 1.0  # 100
    logits[2, :] = float("-inf")
    logits[2, [42, 43]] = 0.0  # 42
    greedy = SamplingParams(temperature=0.0)
    rows = [SampleRow(greedy, seed=0, draw_index=0) for _ in range(3)]
    assert [s.token for s in sample_rows(logits, rows)] == [3, 100, 42]
    mixed = [rows[0], SampleRow(SamplingParams(temperature=1.0), seed=1, draw_index=0), rows[2]]
    picked = sample_rows(logits, mixed)
    assert (picked[0].token, picked[2].token) == (3, 42) and picked[0].draws == 0
