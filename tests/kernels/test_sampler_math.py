"""The sampler's fixed-order arithmetic (kernels/sampler_math.py, csrc/sampler.c):
the C kernels at every level this CPU builds give the numpy twins' bits for
exp, block sums and log_softmax, on rows of awkward widths and values; the
numbers are right (against torch and float64 within rounding); and
`sample_rows` picks the same tokens with the same logprobs through the C
kernels of each level and through the twins."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trioserve.kernels import native_build
from trioserve.kernels.cpu import level_fits
from trioserve.kernels.sampler_math import BLOCK, FIXED, Numerics, log_fixed
from trioserve.models.sampling import sample_rows
from trioserve.types import SampleRow, SamplingParams

TWIN = Numerics(lib=None)
WIDTHS = [1, 7, 15, 16, 17, 255, 256, 257, 360, 1000, 49152]


def _levels() -> list[str]:
    return [level for level in ("native", "avx2", "generic") if not level_fits(level)]


def _native(level: str) -> Numerics:
    lib = native_build.library_at(level)
    if lib is None:
        pytest.skip("the C kernels do not build here")
    return Numerics(lib=lib)


def _rows(width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + width)
    x = torch.randn(6, width, generator=gen) * 5
    x[1] = 0.25  # every entry equal
    x[2, : width // 2] = -float("inf")  # masked tokens
    x[3, width // 3] = 80.0  # one far above the rest: the others' exps underflow
    x[4] *= 40  # a wide spread
    x[5] = x[5] * 1e-3 + 1e4  # large values close together
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.numpy(), b.numpy(), equal_nan=True)


@pytest.mark.parametrize("level", _levels())
@pytest.mark.parametrize("width", WIDTHS)
def test_the_c_kernels_give_the_twins_bits(level, width):
    native = _native(level)
    x = _rows(width, 1)
    assert _same(native.log_softmax(x), TWIN.log_softmax(x))
    shift = x.amax(dim=1)
    assert _same(native.exp_shifted(x, shift), TWIN.exp_shifted(x, shift))
    weights = TWIN.exp_shifted(x, shift)
    for block in (BLOCK, 16, 48):
        assert _same(native.block_sums(weights, block), TWIN.block_sums(weights, block)), block


@pytest.mark.parametrize("width", [16, 360, 49152])
def test_the_numbers_are_right(width):
    x = _rows(width, 2)[[0, 3, 4]]
    lp = TWIN.log_softmax(x)
    torch.testing.assert_close(lp, torch.log_softmax(x.double(), dim=1).float(), atol=2e-5, rtol=1e-6)
    shift = x.amax(dim=1)
    e = TWIN.exp_shifted(x, shift)
    torch.testing.assert_close(e, torch.exp((x - shift[:, None]).double()).float(), atol=1e-30, rtol=1e-6)
    sums = TWIN.block_sums(e)
    exact = torch.stack([e.double()[:, i : i + BLOCK].sum(1) for i in range(0, width, BLOCK)], dim=1)
    torch.testing.assert_close(sums, exact, atol=0, rtol=1e-13)


def test_log_fixed_is_the_log():
    rng = np.random.default_rng(0)
    for s in [1.0, 1.5, 2.0, math.sqrt(2), 3.0, 49152.0, 1e-300, 7e300, *rng.uniform(1, 5e4, 200)]:
        assert log_fixed(float(s)) == pytest.approx(math.log(s), rel=4e-16, abs=4e-16), s
    assert log_fixed(0.0) == -math.inf and math.isinf(log_fixed(math.inf)) and math.isnan(log_fixed(math.nan))


def _sample_rows_cases(seed: int) -> tuple[torch.Tensor, list[SampleRow]]:
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((8, 360)).astype(np.float32) * 3)
    choices = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=1.0, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.9, logprobs=True),
        SamplingParams(temperature=1.3, top_k=50, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=1.0, min_p=0.1, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.9, frequency_penalty=0.5, logit_bias=((7, 3.0),)),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]
    rows = [SampleRow(p, int(rng.integers(2**62)), int(rng.integers(100)), tuple(int(t) for t in rng.integers(0, 360, 20))) for p in choices]
    return logits, rows


@pytest.mark.parametrize("level", _levels())
def test_sample_rows_is_the_same_through_every_level_and_the_twins(level):
    native = _native(level)
    for seed in range(5):
        logits, rows = _sample_rows_cases(seed)
        assert sample_rows(logits, rows, numerics=native) == sample_rows(logits, rows, numerics=TWIN), seed
        # and a row's result does not depend on the rows beside it
        alone = [sample_rows(logits[i : i + 1], rows[i : i + 1], numerics=native)[0] for i in range(len(rows))]
        assert alone == sample_rows(logits, rows, numerics=native)


def test_the_default_is_the_fixed_arithmetic():
    logits, rows = _sample_rows_cases(9)
    assert sample_rows(logits, rows) == sample_rows(logits, rows, numerics=FIXED)
