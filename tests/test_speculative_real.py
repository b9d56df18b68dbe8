"""Speculative decoding on the real default model (SmolLM2-135M): greedy and
seeded requests give the same tokens and logprobs with --speculative ngram
as without, alone and four at a time, while drafts are kept and rejected.
Slow: a few seconds to load, ~30 s to run."""

from __future__ import annotations

import time
from contextlib import aclosing

import pytest
import trio

from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.kernels.cpu import resolve_dtype
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import load_checkpoint
from trioserve.types import FinalEvent, GenerateRequest, SamplingParams, TokenEvent

pytestmark = pytest.mark.slow

PROMPTS = [
    ("List the numbers from 1 to 20, separated by commas.", SamplingParams(max_tokens=60, temperature=0.0, seed=1)),
    ("Repeat after me three times: the quick brown fox jumps over the lazy dog.", SamplingParams(max_tokens=60, temperature=0.0, seed=2, logprobs=True, top_logprobs=2)),
    # Shorter than the first: four at a time, a run's step count is its
    # longest request's, and that should be one whose drafts are kept (the
    # greedy list), not a temperature-1 sample's.
    ("Write a Python function that adds two numbers.", SamplingParams(max_tokens=48, temperature=1.0, seed=3, logprobs=True)),
    ("Name the days of the week.", SamplingParams(max_tokens=48, temperature=0.7, top_p=0.9, seed=4)),
]


@pytest.fixture(scope="module")
def smollm2():
    return load_checkpoint("smollm2", dtype=resolve_dtype("auto"))


async def answers(checkpoint, *, together: bool, **kw):
    tok = checkpoint.tokenizer
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    requests = [GenerateRequest(tok.encode(template.render([{"role": "user", "content": q}])), p) for q, p in PROMPTS]
    out: dict[int, tuple] = {}

    async def one(engine, i: int) -> None:
        events = []
        async with aclosing(engine.generate(requests[i])) as stream:
            async for e in stream:
                events.append((e.token_id, e.text, e.logprob, e.top_logprobs) if isinstance(e, TokenEvent) else (e.finish_reason, e.usage, e.draw_end, e.text))
        assert isinstance(e, FinalEvent)
        out[i] = tuple(events)

    config = EngineConfig(max_num_seqs=4, kv_cache_bytes=64 << 20, **kw)
    async with open_engine(config, checkpoint=checkpoint, model=None) as engine:
        started = time.perf_counter()
        if together:
            async with trio.open_nursery() as nursery:
                for i in range(len(requests)):
                    nursery.start_soon(one, engine, i)
        else:
            for i in range(len(requests)):
                await one(engine, i)
        elapsed = time.perf_counter() - started
        stats = engine.statistics()
    return [out[i] for i in range(len(requests))], stats, elapsed


@pytest.mark.parametrize("together", [False, True], ids=["alone", "four-at-a-time"])
async def test_the_same_answers_with_and_without_drafts(smollm2, together):
    with trio.fail_after(300):
        plain, plain_stats, plain_s = await answers(smollm2, together=together)
        spec, stats, spec_s = await answers(smollm2, together=together, speculative="ngram")
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, PROMPTS[i][0]
    assert 0 < stats.draft_accepted < stats.draft_tokens
    assert stats.steps < plain_stats.steps
    assert stats.kv_blocks_used == 0
    print(
        f"together={together}: steps {plain_stats.steps} -> {stats.steps}, accepted {stats.draft_accepted}/{stats.draft_tokens}, "
        f"{plain_s:.2f} s -> {spec_s:.2f} s"
    )
