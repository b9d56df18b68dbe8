"""Prompt scoring (SamplingParams.prompt_logprobs) in the EngineCore alone,
with the step results written here, and recorded and replayed with the
real tiny model.

What is checked: each prompt chunk of a scoring request is planned with the
prompt tokens its positions predict (the last prompt position predicts
none); the scores come back in one PromptEvent once the prefill is done,
before the first token; max_tokens 0 ends the request ("length") right
there with nothing generated; a scoring request never takes its prefix
from the cache (a cached block has no logits) but leaves its blocks there;
scores that do not match the plan are a misuse; a request that does not
score costs nothing (no score on its rows); and a recorded run with a
scoring request replays identically, fast and on the model."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest
import torch
import trio

from trioserve.config import EngineConfig
from trioserve.core.engine_core import CoreMisuse, CoreSettings, new_core
from trioserve.core.replay import replay_trace
from trioserve.core.trace import event_json, request_from_json, request_json, result_from_json, result_json
from trioserve.engine import open_engine
from trioserve.errors import RequestError
from trioserve.models.checkpoint import load_checkpoint, load_tokenizer
from trioserve.types import FinalEvent, GenerateRequest, PromptEvent, PromptLogprob, Sampled, SamplingParams, StepResult, TokenEvent

SETTINGS = CoreSettings(num_blocks=32, block_size=2, max_num_seqs=4, max_model_len=64, prefill_budget=5, max_queue=4)
PROMPT = list(range(5, 17))  # 12 tokens: chunks of 5, 5 and 2


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    return load_tokenizer(Path(tiny_checkpoints["gguf_f32"]))


def params(max_tokens: int, prompt_logprobs: int | None = 2) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0, prompt_logprobs=prompt_logprobs)


def fake_score(token: int, position: int) -> PromptLogprob:
    """A score for ``token`` predicted at ``position``: made from both, so a misplaced one shows."""
    return PromptLogprob(token, -0.5 * position - token / 1000, position + 1, ((position, -0.1), (token, -0.2)))


def step_result(plan, token: int = 40) -> StepResult:
    """A result for ``plan``: each scoring row's fake scores, token ``token`` for each sampling row."""
    scored = tuple(tuple(fake_score(t, r.start + i) for i, t in enumerate(r.score.targets)) for r in plan.scoring)
    sampled = tuple((Sampled(token, 0),) for _ in plan.sampling)
    return StepResult(plan.number, sampled=sampled, scored=scored)


def run_to_end(core, now: float = 0.0) -> tuple[list, list]:
    """Plan and answer steps until nothing runs; the plans and the events."""
    plans, events = [], []
    while True:
        now += 1.0
        out, plan = core.plan(now)
        events += out
        if plan is None:
            return plans, events
        plans.append(plan)
        events += core.result(step_result(plan), now)


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_a_scored_prompt_comes_in_one_event_before_any_token(tokenizer, max_tokens):
    core = new_core(SETTINGS, tokenizer)
    assert core.submit("s", GenerateRequest(PROMPT, params(max_tokens)), now=0.0) is None
    plans, events = run_to_end(core)
    rows = [plan.rows[0] for plan in plans]
    assert [(r.start, len(r.token_ids)) for r in rows[:3]] == [(0, 5), (5, 5), (10, 2)]
    assert [r.score.targets for r in rows[:3]] == [tuple(PROMPT[1:6]), tuple(PROMPT[6:11]), (PROMPT[11],)]
    assert all(r.score.top == 2 for r in rows[:3]) and all(r.score is None for r in rows[3:])  # decode rows score nothing
    assert [r.sample is not None for r in rows] == [False, False, max_tokens > 0] + [True] * (len(rows) - 3)
    prompt, *rest = events
    assert isinstance(prompt, PromptEvent) and prompt.request_id == "s"
    assert prompt.logprobs == tuple(fake_score(t, p) for p, t in enumerate(PROMPT[1:]))
    assert [type(e) for e in rest] == [TokenEvent] * max_tokens + [FinalEvent]
    final = rest[-1]
    assert final.finish_reason == "length" and (final.usage.prompt_tokens, final.usage.completion_tokens) == (12, max_tokens)
    assert core.policy.pool.stats().used_blocks == core.policy.cache.stats().idle_blocks  # only the cache holds blocks now


def test_a_one_token_prompt_scores_nothing_and_says_so(tokenizer):
    core = new_core(SETTINGS, tokenizer)
    core.submit("s", GenerateRequest([7], params(0)), now=0.0)
    plans, events = run_to_end(core)
    assert [r.score for r in plans[0].rows] == [None]
    assert [type(e) for e in events] == [PromptEvent, FinalEvent] and events[0].logprobs == ()


def test_a_scoring_request_skips_the_prefix_cache_and_leaves_its_blocks_there(tokenizer):
    core = new_core(SETTINGS, tokenizer)
    core.submit("plain", GenerateRequest(PROMPT, params(1, None)), now=0.0)
    run_to_end(core)
    core.submit("scored", GenerateRequest(PROMPT, params(0)), now=10.0)
    plans, events = run_to_end(core, 10.0)
    assert plans[0].rows[0].start == 0  # from the first token, though the cache holds 10 of them
    assert events[-1].usage.cached_tokens == 0
    core.submit("after", GenerateRequest(PROMPT + [30], params(1, None)), now=20.0)
    plans, events = run_to_end(core, 20.0)
    assert plans[0].rows[0].start == 12 and events[-1].usage.cached_tokens == 12


def test_requests_that_do_not_score_have_no_score_on_their_rows(tokenizer):
    core = new_core(SETTINGS, tokenizer)
    core.submit("plain", GenerateRequest(PROMPT, params(2, None)), now=0.0)
    plans, events = run_to_end(core)
    assert all(r.score is None for plan in plans for r in plan.rows)
    assert not any(isinstance(e, PromptEvent) for e in events)


def test_scores_that_do_not_match_the_plan_are_a_misuse(tokenizer):
    core = new_core(SETTINGS, tokenizer)
    core.submit("s", GenerateRequest(PROMPT, params(0)), now=0.0)
    _, plan = core.plan(1.0)
    with pytest.raises(CoreMisuse, match="1 scoring rows but its result has 0"):
        core.result(StepResult(plan.number), 1.0)


def test_an_embedding_request_takes_no_prompt_logprobs(tokenizer):
    core = new_core(SETTINGS, tokenizer)
    refusal = core.submit("e", GenerateRequest(PROMPT, params(1), pooling="mean"), now=0.0)
    assert isinstance(refusal, RequestError) and refusal.field == "prompt_logprobs"


def test_the_trace_records_the_field_the_scores_and_the_event():
    request = GenerateRequest(PROMPT, params(0, 3))
    assert request_from_json(request_json(request), lambda _: None) == request
    plain = request_json(GenerateRequest(PROMPT, params(1, None)))
    assert "prompt_logprobs" not in plain["params"]  # absent, as before the field existed
    result = StepResult(4, scored=((fake_score(9, 0), fake_score(10, 1)),))
    assert result_from_json(result_json(result)) == result
    assert event_json(PromptEvent("s", (fake_score(9, 0),))) == {"prompt": "s", "logprobs": [[9, -0.009, 1, [[0, -0.1], [9, -0.2]]]]}


async def test_a_recorded_run_with_scored_prompts_replays_identically(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["gguf_f32"]
    config = EngineConfig(
        model=str(path), dtype="float32", kv_cache_bytes=64 * 4 * 512, block_size=4, max_num_seqs=4, prefill_budget=6,
        record_dir=str(tmp_path),
    )  # fmt: skip
    ckpt = load_checkpoint(path, dtype=torch.float32)
    seen: dict[str, list] = {}

    async def run(name: str, request: GenerateRequest) -> None:
        async with aclosing(engine.generate(request)) as events:
            seen[name] = [event async for event in events]

    async with open_engine(config, checkpoint=ckpt) as engine:
        prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "scored", GenerateRequest(prompt, params(0, 4)))
            nursery.start_soon(run, "scored and sampled", GenerateRequest(prompt[:7], SamplingParams(max_tokens=3, seed=5, prompt_logprobs=0)))
            nursery.start_soon(run, "plain", GenerateRequest(prompt[2:], SamplingParams(max_tokens=5, seed=1, logprobs=True)))
    scored = seen["scored"][0]
    assert isinstance(scored, PromptEvent) and len(scored.logprobs) == len(prompt) - 1
    assert seen["scored and sampled"][0].logprobs == tuple(p.__class__(p.token, p.logprob, p.rank, ()) for p in scored.logprobs[:6])
    (trace,) = tmp_path.glob("trace-*.jsonl")
    for model in (False, True):
        summary = replay_trace(trace, model=model)
        assert summary.difference is None, summary.difference.report()
