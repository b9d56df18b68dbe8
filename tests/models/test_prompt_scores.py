"""Prompt scores from the step runner, on the tiny model's float32 weights
and on its 4-bit ones with the served arithmetic (bf16, per-row heads):
one prefill's scores are, bit for bit, the logprobs the sampler reports
for each prefix's next token (each prefix prefilled in a step of its own,
in the company of another sequence), and the head's slices do not change
a bit of them."""

from __future__ import annotations

import pytest
import torch

from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.scoring import score_rows
from trioserve.models.step import SeqChunk, build_step
from trioserve.models.step_runner import StepRunner
from trioserve.types import PlanRow, SampleRow, SamplingParams, ScoreRow, StepPlan

BLOCK = 4
TABLE = tuple(range(16))  # 64 positions: room for the prompt
OTHER = tuple(range(16, 32))  # the company's blocks
LOGPROBS = SamplingParams(max_tokens=1, temperature=0.0, seed=0, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module", params=["f32", "q4_1"])
def model(request, tiny_checkpoints) -> DecoderModel:
    if request.param == "f32":
        checkpoint = load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32)
        return DecoderModel.from_checkpoint(checkpoint, use_int4=False, batch_invariant=True)
    checkpoint = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.bfloat16)
    return DecoderModel.from_checkpoint(checkpoint, use_int4=True, batch_invariant=True)


def runner(model: DecoderModel) -> StepRunner:
    return StepRunner(model, model.new_kv_cache(40, BLOCK), vocab_size=model.config.vocab_size)


def prompt(n: int = 30) -> list[int]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(3, 200, (n,), generator=gen).tolist()


def test_one_prefills_scores_are_each_prefixs_generation_logprob(model):
    ids = prompt()
    step = runner(model)
    scored = step.run(StepPlan(1, (PlanRow("s", tuple(ids), 0, TABLE, False, score=ScoreRow(tuple(ids[1:]), 3)),)))
    assert scored.refused is None and scored.fatal is None, scored
    (scores,) = scored.scored
    assert [s.token for s in scores] == ids[1:]
    for k in range(1, len(ids)):
        company = PlanRow("o", tuple(ids[::-1][:5]), 0, OTHER, False)  # another prompt's chunk in the same step
        row = PlanRow("p", tuple(ids[:k]), 0, TABLE, False, SampleRow(LOGPROBS, 0, 0))
        plain = runner(model).run(StepPlan(k + 1, (company, row)))
        (sampled,) = plain.sampled[0]
        assert scores[k - 1].top == sampled.top_logprobs, k  # the same three likeliest, bit for bit
        listed = dict(sampled.top_logprobs)
        if ids[k] in listed:
            assert scores[k - 1].logprob == listed[ids[k]], k
        assert scores[k - 1].rank >= 1 and (scores[k - 1].rank <= 3) == (ids[k] in listed)


def test_the_heads_slices_change_no_bit(model):
    ids = prompt(40)
    cache = model.new_kv_cache(40, BLOCK)
    batch = build_step([SeqChunk(ids, 0, TABLE)], BLOCK, fixed=True)
    rows = torch.arange(len(ids) - 1)
    outs = {}
    for size in (3, 16, 128):
        parts: list[torch.Tensor] = []
        model.forward_parts(batch, cache, torch.tensor([len(ids) - 1]), scored_rows=rows, scored=parts.append, slice_rows=size)
        assert len(parts) == -(-len(rows) // size)
        outs[size] = score_rows(torch.cat(parts), ids[1:], [4] * len(rows), model.config.vocab_size)
    assert outs[3] == outs[16] == outs[128]
