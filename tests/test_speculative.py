"""Speculative decoding with prompt-lookup drafts (--speculative ngram):
the tiny random Llama through the real engine (scheduler, worker, sampler),
and the core and the proposer on their own.

What is checked: greedy, seeded, penalized and stop-string requests give the
same tokens, text, logprobs and draw positions with and without drafts, alone
and together, while drafts are both kept and thrown away; a rejected draft
leaves nothing in the cache's count of a sequence or in what the prefix
cache registers; cancelling a request mid-verification frees every block;
the proposer finds the latest longest match."""

from __future__ import annotations

from contextlib import aclosing

import pytest
import torch
import trio

from tests.test_engine import BS, collect, config
from trioserve.core.engine_core import CoreSettings, new_core
from trioserve.engine import open_engine
from trioserve.models.checkpoint import load_checkpoint, load_tokenizer
from trioserve.state.ngram import propose
from trioserve.state.scheduling import DRAFT_MAX_ROWS
from trioserve.types import GenerateRequest, Sampled, SamplingParams, StepResult, TokenEvent


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32)


def requests(vocab: int) -> list[GenerateRequest]:
    """Prompts that repeat themselves, so the proposer has matches."""
    loop = [5, 9, 17, 33, 41, 7]
    return [
        GenerateRequest(loop * 6, SamplingParams(max_tokens=40, temperature=0.0, seed=1, ignore_eos=True)),
        GenerateRequest([3, 4] * 10 + loop, SamplingParams(max_tokens=33, temperature=0.0, seed=2, logprobs=True, top_logprobs=2)),
        GenerateRequest(loop * 4, SamplingParams(max_tokens=30, temperature=1.0, seed=7, logprobs=True, ignore_eos=True)),
        GenerateRequest(loop * 3 + [11, 12], SamplingParams(max_tokens=30, temperature=0.8, top_k=5, seed=123, ignore_eos=True)),
        GenerateRequest(loop * 5, SamplingParams(max_tokens=25, temperature=0.0, seed=3, frequency_penalty=0.5, repetition_penalty=1.2, ignore_eos=True)),
        GenerateRequest(loop * 5, SamplingParams(max_tokens=35, temperature=0.0, seed=4, stop=("\n",))),
    ]


def signature(outcome) -> tuple:
    f = outcome.final
    return (outcome.tokens, outcome.text, f.finish_reason, f.usage, f.seed, f.draw_end)


async def run_all(ckpt, reqs, *, together: bool, **kw):
    async with open_engine(config(**kw), checkpoint=ckpt) as engine:
        if together:
            out: dict[int, object] = {}

            async def one(i: int) -> None:
                out[i] = await collect(engine, reqs[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(reqs)):
                    nursery.start_soon(one, i)
            outcomes = [out[i] for i in range(len(reqs))]
        else:
            outcomes = [await collect(engine, r) for r in reqs]
        stats = engine.statistics()
    return outcomes, stats


@pytest.mark.parametrize("together", [False, True], ids=["alone", "together"])
async def test_drafts_change_no_token_logprob_or_draw(ckpt, together):
    reqs = requests(ckpt.tokenizer.vocab_size)
    kw = dict(max_num_seqs=DRAFT_MAX_ROWS, prefill_budget=64)
    with trio.fail_after(60):
        plain, plain_stats = await run_all(ckpt, reqs, together=together, **kw)
        spec, stats = await run_all(ckpt, reqs, together=together, speculative="ngram", speculative_tokens=4, **kw)
    assert plain_stats.draft_tokens == 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert signature(a) == signature(b), i
    assert stats.draft_tokens > 0
    assert 0 < stats.draft_accepted < stats.draft_tokens  # some kept, some thrown away
    assert stats.generated_tokens == plain_stats.generated_tokens
    assert stats.steps < plain_stats.steps  # the kept drafts saved steps
    assert stats.kv_blocks_used == 0 and stats.running == 0


async def test_logprobs_are_the_same_with_drafts(ckpt):
    """Token by token: the logprob and top logprobs of every event."""
    req = requests(ckpt.tokenizer.vocab_size)[1]

    async def events(**kw):
        async with open_engine(config(**kw), checkpoint=ckpt) as engine:
            async with aclosing(engine.generate(req)) as stream:
                return [(e.token_id, e.logprob, e.top_logprobs) async for e in stream if isinstance(e, TokenEvent)]

    with trio.fail_after(30):
        assert await events() == await events(speculative="ngram")


async def test_cancelling_mid_verification_frees_every_block(ckpt):
    req = GenerateRequest([5, 9, 17, 33, 41, 7] * 6, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    with trio.fail_after(60):
        async with open_engine(config(speculative="ngram", speculative_tokens=6), checkpoint=ckpt) as engine:
            for stop_after in (1, 3, 9, 20):
                got = 0
                async with aclosing(engine.generate(req)) as stream:
                    async for event in stream:
                        got += isinstance(event, TokenEvent)
                        if got == stop_after:
                            break
                while engine.statistics().running:
                    await trio.sleep(0.001)
                s = engine.statistics()
                assert s.kv_blocks_used == 0, stop_after
            assert engine.statistics().draft_tokens > 0
            after = await collect(engine, GenerateRequest([4, 5, 6], SamplingParams(max_tokens=5, temperature=0.0)))
            assert after.final.finish_reason in ("stop", "length")


def test_a_rejected_draft_counts_for_nothing_and_is_never_shared(tiny_checkpoints):
    """The core alone, fed results by hand: a row drafted 3 tokens; the
    step's sampler kept the first token only (the draft's first was wrong).
    The sequence then holds only its fed tokens, the next plan feeds the
    corrected token at the rejected draft's position, and the prefix cache
    registers only blocks of committed tokens."""
    tok = load_tokenizer(tiny_checkpoints["gguf_f32"])
    settings = CoreSettings(
        num_blocks=32, block_size=2, max_num_seqs=2, max_model_len=128, prefill_budget=16, max_queue=4, draft_tokens=3
    )
    core = new_core(settings, tok)
    prompt = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    params = SamplingParams(max_tokens=8, temperature=0.0, seed=0, ignore_eos=True)  # 2 is the end token
    assert core.submit("r", GenerateRequest(prompt, params), 0.0) is None
    _, plan = core.plan(1.0)
    assert plan.rows[0].sample.draft == ()  # prefill rows never carry drafts
    core.result(StepResult(plan.number, ((Sampled(3, 0),),)), 1.1)  # the model says 3
    _, plan = core.plan(1.2)
    row = plan.rows[0]
    # "1 2 3" last occurred before "8 1 2"
    assert row.decode and row.token_ids == (3, 8, 1, 2) and row.sample.draft == (8, 1, 2) and row.start == len(prompt)
    core.result(StepResult(plan.number, ((Sampled(9, 0),),)), 1.3)  # 9, not the draft's 8
    seq = core.seqs["r"]
    assert seq.num_cached == len(prompt) + 1 and seq.output_ids == [3, 9]
    _, plan = core.plan(1.4)
    row = plan.rows[0]
    assert row.start == len(prompt) + 1 and row.token_ids[0] == 9  # fed where the rejected 8 was written
    draft = row.sample.draft
    assert draft == (1, 2, 3)  # what followed the earlier "3 9"
    core.result(StepResult(plan.number, (tuple(Sampled(t, 0) for t in (*draft, 4)),)), 1.5)  # all kept, and a bonus 4
    assert seq.num_cached == len(prompt) + 2 + len(draft) and seq.output_ids == [3, 9, 1, 2, 3, 4]
    s = core.snapshot()
    assert (s.draft_tokens, s.draft_accepted) == (3 + len(draft), len(draft))
    # Run it out: every block comes back, and what the cache registered
    # matches the committed history, block by block.
    while core.seqs:
        _, plan = core.plan(2.0)
        n = len(plan.rows[0].sample.draft)
        core.result(StepResult(plan.number, ((Sampled(3, 0),) * (1 + n),)), 2.1)
    assert core.snapshot().kv_blocks_used == 0
    cache = core.policy.cache
    history = prompt + seq.output_ids
    hit = cache.match(history + [1, 1, 1], 3.0)
    assert len(hit) * settings.block_size <= seq.num_cached  # nothing past what was fed and kept


def test_the_proposer_finds_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert propose([1, 2, 3, 8, 2, 3, 9, 2, 3], 2) == [9, 2]  # the latest of two equal matches
    assert propose([4, 2, 3, 7, 8, 1, 5, 3, 6, 2, 3], 2) == [7, 8]  # "2 3" beats the later "3"
    assert propose([5, 3, 6, 1, 3], 2) == []  # a lone matching token is not enough by default
    assert propose([5, 3, 6, 1, 3], 2, min_n=1) == [6, 1]
    assert propose([1, 2, 3], 4) == [] and propose([1, 2, 1, 2], 0) == [] and propose([7], 3) == []
    assert propose([5, 5, 5, 5], 3) == [5]
    assert propose([1, 2, 3, 9, 1, 2, 3], 3, min_n=4) == []


def test_bad_speculative_settings_are_refused_by_name():
    from tests.test_cli import run_cli
    from trioserve.config import EngineConfig, settings_from_env

    proc = run_cli("serve", "--speculative", "eagle", "--port", "0")
    assert proc.returncode == 2 and "argument --speculative: invalid choice: 'eagle' (choose from 'off', 'ngram')" in proc.stderr, proc.stderr
    proc = run_cli("serve", "--speculative-tokens", "0", "--port", "0")
    assert proc.returncode == 2 and "--speculative-tokens: must be a positive integer, got 0" in proc.stderr, proc.stderr
    with pytest.raises(ValueError, match=r"TRIOSERVE_SPECULATIVE: must be one of off, ngram, got 'eagle'"):
        settings_from_env({"TRIOSERVE_SPECULATIVE": "eagle"})
    with pytest.raises(ValueError, match="speculative_tokens"):
        settings_from_env({"TRIOSERVE_SPECULATIVE_TOKENS": "0"})
    assert settings_from_env({"TRIOSERVE_SPECULATIVE": "ngram", "TRIOSERVE_SPECULATIVE_TOKENS": "6"}).engine.draft_tokens == 6
    assert EngineConfig().draft_tokens == 0 and EngineConfig(speculative="ngram").draft_tokens == 4
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="eagle")


@pytest.mark.parametrize("flags", [(), ("--model",)], ids=["fast", "model"])
async def test_a_speculative_run_replays_identically(ckpt, tiny_checkpoints, tmp_path, flags):
    """A recorded run with drafts (kept and rejected) replays: the fresh core
    plans the same drafts, and --model re-runs and re-samples them alike."""
    from trioserve import cli

    ckpt = load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32)
    reqs = requests(ckpt.tokenizer.vocab_size)[:4]
    with trio.fail_after(60):
        _, stats = await run_all(ckpt, reqs, together=True, speculative="ngram", record_dir=str(tmp_path), max_num_seqs=4, prefill_budget=64)
    assert 0 < stats.draft_accepted < stats.draft_tokens
    (trace,) = tmp_path.iterdir()
    status = await trio.to_thread.run_sync(cli.main, ["replay", str(trace), *flags])
    assert status == 0
