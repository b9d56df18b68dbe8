"""Prompt log-probabilities with the real default model (SmolLM2, served as
by default: bf16 with the checkpoint's 4-bit projections, batch-invariant;
issue #29, part 2), through the real HTTP server.

A prompt is walked as in test_prompt_logprobs.py: after each prefix the
server generates one token (greedy, logprobs 5) and the next prompt token
is one of the five it lists, so generation's log-probability of every
prompt token is known. Scoring the whole prompt as lm-evaluation-harness
asks (echo, logprobs, max_tokens 0), prefilled in chunks of 32 tokens, must
give those numbers (within float tolerance; they are the same rows, so in
practice bit for bit) and their sum; and the same scores alone as among a
crowd of long generations and another scored prompt. Slow: loads the model."""

from __future__ import annotations

import math

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import eventually, metrics, start_server
from tests.http.test_prompt_logprobs import TOP, scoring, score, single_token_texts, walk_prompt
from trioserve.config import EngineConfig, ServerSettings
from trioserve.models.checkpoint import load_tokenizer

pytestmark = pytest.mark.slow

LENGTH = 48  # prefilled in two chunks of 32 and 16 tokens alone


async def post(client: httpx.AsyncClient, body: dict) -> None:
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


async def test_smollm2_prompt_scores_are_generations_logprobs_alone_and_in_a_crowd(nursery):
    engine = EngineConfig(model="smollm2", max_num_seqs=16, prefill_budget=32)
    settings = attrs.evolve(ServerSettings(engine=engine), host="127.0.0.1", port=0, log_level="warning")
    assert settings.engine.batch_invariant is True
    url = await start_server(nursery, settings)
    tokenizer = load_tokenizer("smollm2")
    ids_of = single_token_texts(tokenizer)
    first = tokenizer.encode("The")[0]
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as client:
        with trio.fail_after(600):
            ids, refs, _ = await walk_prompt(client, ids_of, first=first, length=LENGTH)
            alone = await score(client, scoring(ids))
            other = ids[:20] + ids[30:]
            crowded: dict = {}
            async with trio.open_nursery() as crowd:
                for i in range(6):
                    body = {"prompt": f"Write a long story about the number {i}.", "max_tokens": 96, "temperature": 1, "seed": i, "ignore_eos": True}
                    crowd.start_soon(post, client, body)

                async def running() -> str | None:
                    now = (await metrics(client))["running"]
                    return None if now >= 6 else f"{now} running"

                await eventually(running, timeout=60, what="the crowd running")

                async def scored(name: str, body: dict) -> None:
                    crowded[name] = await score(client, body)

                async with trio.open_nursery() as targets:
                    targets.start_soon(scored, "target", scoring(ids))
                    targets.start_soon(scored, "other", scoring(other))
                assert (await metrics(client))["running"] >= 1  # the crowd outlived the scoring
    choice = alone["choices"][0]
    assert choice["finish_reason"] == "length" and alone["usage"]["completion_tokens"] == 0
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == LENGTH
    assert got[1:] == pytest.approx(refs, abs=1e-4)
    assert math.fsum(got[1:]) == pytest.approx(math.fsum(refs), abs=1e-3)
    exact = sum(a == b for a, b in zip(got[1:], refs, strict=True))
    print(f"{exact} of {len(refs)} prompt tokens scored bit for bit as generation gave them")
    assert crowded["target"]["choices"][0]["logprobs"] == choice["logprobs"]  # alone == in the crowd, exactly
    assert len(crowded["other"]["choices"][0]["logprobs"]["tokens"]) == len(other)
    assert all(len(top) <= TOP for top in choice["logprobs"]["top_logprobs"][1:])
