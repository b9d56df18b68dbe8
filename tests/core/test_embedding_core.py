"""Embedding requests in the EngineCore alone (no model: the step results
are written here), and the fixed-point pooling both halves share
(state/pooling.py, actors/worker.py).

What is checked: an embedding's plan rows pool every token ("mean") or only
the prompt's last one ("last"), never sample, and the request ends with the
vector of exactly the sums it was given, once its prefill is done, with its
blocks freed; a result whose pooled rows do not match the plan is a misuse;
the vector is a float32 unit vector of the mean; and the worker's integer
sums of random rows are the same however the rows are split into chunks."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from trioserve.models.step_runner import fixed_point_sums
from trioserve.core.engine_core import CoreMisuse, CoreSettings, new_core
from trioserve.models.checkpoint import load_tokenizer
from trioserve.state.pooling import FRACTION_BITS, add_sums, embedding, float32s
from trioserve.types import FinalEvent, GenerateRequest, SamplingParams, StepResult

SETTINGS = CoreSettings(num_blocks=16, block_size=2, max_num_seqs=2, max_model_len=32, prefill_budget=5, max_queue=4)
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    return load_tokenizer(Path(tiny_checkpoints["gguf_f32"]))


def sums_for(rows: int, start: int) -> tuple[int, ...]:
    """Some fixed-point sums for a chunk: three values, made from its position."""
    return (rows << FRACTION_BITS, -(start + 1) << FRACTION_BITS, 7 * rows)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_an_embedding_pools_its_prefill_and_ends_with_the_vector_of_its_sums(tokenizer, pooling):
    core = new_core(SETTINGS, tokenizer)
    prompt = list(range(5, 17))  # 12 tokens: chunks of 5, 5 and 2
    assert core.submit("e", GenerateRequest(prompt, PARAMS, pooling=pooling), now=0.0) is None
    total, rows, now, finals = None, 0, 0.0, []
    pools = []
    while not finals:
        now += 1.0
        events, plan = core.plan(now)
        assert events == [] and plan is not None
        (row,) = plan.rows
        assert row.sample is None and plan.sampling == ()
        pools.append(row.pool)
        assert core.policy.pool.stats().used_blocks == 6  # the prompt's blocks, no room for output
        pooled = (sums_for(row.pool, row.start),) if row.pool else ()
        if row.pool:
            total, rows = add_sums(total, pooled[0]), rows + row.pool
        finals = core.result(StepResult(plan.number, pooled=pooled), now)
    assert pools == ([5, 5, 2] if pooling == "mean" else [0, 0, 1])
    (final,) = finals
    assert isinstance(final, FinalEvent) and final.finish_reason == "stop"
    assert final.embedding == embedding(total, rows)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (12, 0)
    assert core.policy.pool.stats().used_blocks == 0 and core.policy.cache.stats().cached_blocks == 0
    assert core.plan(now + 1) == ([], None)


def test_pooled_rows_that_do_not_match_the_plan_are_a_misuse(tokenizer):
    core = new_core(SETTINGS, tokenizer)
    core.submit("e", GenerateRequest([5, 6, 7], PARAMS, pooling="mean"), now=0.0)
    _, plan = core.plan(1.0)
    with pytest.raises(CoreMisuse, match="1 pooling rows but its result has 0"):
        core.result(StepResult(plan.number), 1.0)


def test_the_vector_is_the_float32_unit_vector_of_the_mean():
    scale = 1 << FRACTION_BITS
    sums = [3 * scale, -4 * scale, 0]  # over 2 rows: mean (1.5, -2, 0), norm 2.5
    assert embedding(sums, 2) == (0.6000000238418579, -0.800000011920929, 0.0)
    assert embedding(sums, 2) == float32s([0.6, -0.8, 0.0])
    assert embedding([0, 0], 3) == (0.0, 0.0)
    with pytest.raises(ValueError):
        embedding(sums, 0)
    with pytest.raises(ValueError):
        add_sums([1, 2], [3])


def test_the_worker_sums_are_exact_however_the_rows_are_chunked():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(97, 64, generator=gen) * 3  # fp32 rows of a 97-token prompt
    whole = fixed_point_sums(hidden, [97])[0]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, 97), rng.randrange(1, 12)))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, 97])]
        total = None
        for part in fixed_point_sums(hidden, counts):
            total = add_sums(total, part)
        assert tuple(total) == whole, counts
    mean = hidden.double().mean(0)
    got = torch.tensor(whole, dtype=torch.float64) / (97 * (1 << FRACTION_BITS))
    assert torch.allclose(got, mean, rtol=0, atol=2 ** -(FRACTION_BITS + 1))
    assert math.isclose(math.fsum(x * x for x in embedding(whole, 97)), 1.0, rel_tol=1e-6)
