"""Embedding requests through the real engine (tiny random Llama, fp32, the
real scheduler, worker and sampler actors): `Engine.embed`.

What is checked: a vector is bit-identical however its prompt is chunked
(three step budgets) and whether generation shares its steps, for both
poolings; generation beside embeddings gives exactly its solo tokens; an
embedding reserves its prompt's blocks only, never reads the prefix cache
(a cached prompt is still prefilled whole) and leaves nothing in it; a
cancelled embedding mid-prefill frees every block; impossible or malformed
embedding requests are refused by name."""

from __future__ import annotations

import pytest
import torch
import trio

from tests.test_engine import collect, config, solo_runs
from trioserve.cli import build_parser
from trioserve.config import EngineConfig, settings_from_env
from trioserve.engine import Engine, open_engine
from trioserve.errors import RequestError, RequestTooLarge
from trioserve.models.checkpoint import Checkpoint, load_checkpoint
from trioserve.types import FinalEvent, GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints) -> Checkpoint:
    return load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32)


PROMPTS = [[3 + (i * 11 + j * 5) % 350 for j in range(n)] for i, n in enumerate((37, 90, 5, 61))]
GENERATE = [GenerateRequest([7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=25, temperature=1.0, seed=s, ignore_eos=True)) for s in (1, 2)]


async def embed_all(engine: Engine, prompts: list[list[int]], *, generate: list[GenerateRequest] = ()) -> tuple[list[FinalEvent], list]:
    """Every prompt embedded and every generation run, all at once."""
    finals: dict[int, FinalEvent] = {}
    outcomes: dict[int, object] = {}

    async def one(i: int) -> None:
        finals[i] = await engine.embed(prompts[i])

    async def gen(i: int) -> None:
        outcomes[i] = await collect(engine, generate[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(generate)):
            nursery.start_soon(gen, i)
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return [finals[i] for i in range(len(prompts))], [outcomes[i] for i in range(len(generate))]


@pytest.mark.parametrize("pooling", ["mean", "last"])
async def test_a_vector_does_not_depend_on_chunking_or_company(ckpt, pooling):
    with trio.fail_after(60):
        async with open_engine(config(max_num_seqs=1, prefill_budget=512, embedding_pooling=pooling), checkpoint=ckpt) as engine:
            alone = [await engine.embed(p) for p in PROMPTS]
        solo = await solo_runs(ckpt, GENERATE)
        for budget in (7, 13, 64):
            async with open_engine(config(max_num_seqs=4, prefill_budget=budget, embedding_pooling=pooling), checkpoint=ckpt) as engine:
                finals, outcomes = await embed_all(engine, PROMPTS, generate=GENERATE)
                stats = engine.statistics()
            for i, (got, want) in enumerate(zip(finals, alone, strict=True)):
                assert got.finish_reason == "stop" and got.error is None
                assert got.embedding == want.embedding, f"prompt {i}, budget {budget}"
                assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(PROMPTS[i]), 0)
            for got, want in zip(outcomes, solo, strict=True):
                assert got.same_as(want), f"generation beside embeddings changed (budget {budget})"
            assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert all(len(f.embedding) == ckpt.config.hidden_size for f in alone)
    assert len({f.embedding for f in alone}) == len(PROMPTS)


async def test_embeddings_beside_speculative_decode_rows(ckpt):
    """Drafted decode rows become several chunks in the worker: the pooled
    tokens are still found where they are."""
    looping = GenerateRequest([5, 6, 7, 8] * 6, SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
    with trio.fail_after(30):
        async with open_engine(config(max_num_seqs=1, prefill_budget=512), checkpoint=ckpt) as engine:
            alone = [await engine.embed(p) for p in PROMPTS]
        async with open_engine(config(max_num_seqs=4, prefill_budget=24, speculative="ngram"), checkpoint=ckpt) as engine:
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(collect, engine, looping)
                while engine.statistics().draft_tokens == 0:  # the decode rows carry drafts now
                    await trio.sleep(0)
                finals, _ = await embed_all(engine, PROMPTS)
                during = engine.statistics()
                nursery.cancel_scope.cancel()
    assert during.running == 2, "the generations ended before the embeddings did"
    assert [f.embedding for f in finals] == [f.embedding for f in alone]


async def test_an_embedding_neither_reads_nor_fills_the_prefix_cache(ckpt):
    prompt = PROMPTS[1]
    with trio.fail_after(30):
        async with open_engine(config(prefix_cache=False), checkpoint=ckpt) as engine:
            uncached = await engine.embed(prompt)
        async with open_engine(config(), checkpoint=ckpt) as engine:
            await collect(engine, GenerateRequest(prompt, SamplingParams(max_tokens=2, temperature=0.0)))
            before = engine.statistics()
            first = await engine.embed(prompt)
            second = await engine.embed(prompt)
            after = engine.statistics()
    assert before.prefix.cached_blocks > 0  # the generation left its prompt there
    assert first.embedding == second.embedding == uncached.embedding
    assert first.usage.cached_tokens == second.usage.cached_tokens == 0
    assert after.prefix.cached_blocks == before.prefix.cached_blocks
    assert (after.prefix.query_tokens, after.prefix.hit_tokens) == (before.prefix.query_tokens, before.prefix.hit_tokens)
    assert after.prompt_tokens == before.prompt_tokens + 2 * len(prompt)  # prefilled whole, both times


async def test_an_embedding_reserves_its_prompt_only_and_a_cancelled_one_frees_it(ckpt):
    prompt = [3 + j % 300 for j in range(250)]  # 50 steps of 5 tokens
    with trio.fail_after(30):
        async with open_engine(config(max_num_seqs=2, prefill_budget=5), checkpoint=ckpt) as engine:
            scope = trio.CancelScope()
            got = []

            async def consumer() -> None:
                with scope:
                    got.append(await engine.embed(prompt))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer)
                while engine.statistics().prompt_tokens < 10:
                    await trio.sleep(0)
                during = engine.statistics()
                scope.cancel()
            while engine.statistics().running:
                await trio.sleep(0.001)
            after = engine.statistics()
    assert during.running == 1 and during.kv_blocks_used == 250 // 4 + 1  # ceil(250 / 4): no room for output
    assert got == [] and scope.cancelled_caught
    assert after.kv_blocks_used == 0 and after.waiting == 0
    assert after.finished_count("cancelled") == 1 and after.finished_count("stop") == 0
    assert after.prefix.cached_blocks == 0


async def test_impossible_and_malformed_embeddings_are_refused_by_name(ckpt):
    with trio.fail_after(20):
        async with open_engine(config(blocks=16, max_model_len=100), checkpoint=ckpt) as engine:
            with pytest.raises(RequestTooLarge, match=r"the prompt \(101 tokens\) exceeds the maximum model length of 100") as long:
                await engine.embed([5] * 101)
            with pytest.raises(RequestTooLarge, match=r"the prompt \(65 tokens\) needs 17 KV blocks but the pool has 16") as big:
                await engine.embed([5] * 65)
            assert long.value.field == big.value.field == "prompt"
            for request, field, message in [
                (GenerateRequest([5, 6], pooling="max"), "pooling", "pooling must be one of last, mean, first, score, got 'max'"),
                # A decoder's prompt may run in chunks: its first token's state is no [CLS] pooling.
                (GenerateRequest([5, 6], pooling="first"), "pooling", r"pooling 'first' needs each prompt whole in one step \(an encoder's engine\)"),
                (GenerateRequest([5, 6], pooling="mean", retain="sess"), "pooling", "takes no retain owner"),
                (GenerateRequest([], pooling="mean"), "prompt", "the prompt is empty"),
                (GenerateRequest([5, 9999], pooling="mean"), "prompt", "outside the vocabulary"),
            ]:
                with pytest.raises(RequestError, match=message) as refused:
                    async with engine.open_generation(request):
                        pass
                assert refused.value.field == field
            fine = await engine.embed([5] * 64)  # exactly the pool
    assert fine.finish_reason == "stop" and len(fine.embedding) == ckpt.config.hidden_size


def test_embedding_pooling_is_a_checked_setting_flag_and_variable(capsys):
    assert EngineConfig().embedding_pooling == "auto"  # the file's pooling, else mean (tests/http/test_model_purpose.py)
    assert EngineConfig(embedding_pooling="last").embedding_pooling == "last"
    with pytest.raises(ValueError, match="embedding_pooling"):
        EngineConfig(embedding_pooling="max")
    assert settings_from_env({"TRIOSERVE_EMBEDDING_POOLING": "last"}).engine.embedding_pooling == "last"
    with pytest.raises(ValueError, match="TRIOSERVE_EMBEDDING_POOLING: must be one of auto, mean, last, got 'max'"):
        settings_from_env({"TRIOSERVE_EMBEDDING_POOLING": "max"})
    parser = build_parser()
    assert parser.parse_args(["serve"]).embedding_pooling == "auto"
    assert parser.parse_args(["serve", "--embedding-pooling", "last"]).embedding_pooling == "last"
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["serve", "--embedding-pooling", "max"])
    assert refused.value.code == 2 and "invalid choice: 'max'" in capsys.readouterr().err
