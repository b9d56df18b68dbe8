"""LoRA adapters (trioserve/models/lora_set.py, trioserve/http/lora.py)
through the real server on the tiny model: an adapter served on its base
answers as the model with the adapter merged into its weights; rows of
the base model and of two adapters share steps and keep their bits; the
prefix cache never crosses adapters; loading, listing, refusing and
draining as a model's."""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, metrics, read_sse, start_server
from tests.lora_files import merged_weights, write_peft_adapter
from tests.tiny_model import TINY, tiny_weights, train_tiny_tokenizer, write_gguf

TIMEOUT = 60
PROMPTS = ("The quick brown fox", "Once upon a time there", "1 2 3 4 5")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random adapters for the tiny model (every target, different
    seeds and ranks), one for another shape, and the base model with the
    first merged into its weights."""
    root = tmp_path_factory.mktemp("lora")
    tokenizer = train_tiny_tokenizer()
    a = write_peft_adapter(root / "a", TINY, rank=4, seed=1, scale_b=0.2)
    b = write_peft_adapter(root / "b", TINY, rank=8, seed=2, scale_b=0.2, targets=("q_proj", "v_proj", "down_proj"))
    wide = write_peft_adapter(root / "wide", {**TINY, "hidden_size": 128}, rank=4, seed=3)
    merged = write_gguf(root / "merged-a.gguf", merged_weights(tiny_weights(tokenizer.get_vocab_size(), seed=0), a), tokenizer)
    return {"a": a, "b": b, "wide": wide, "merged_a": merged}


async def load(client: httpx.AsyncClient, name: str, path: Path) -> httpx.Response:
    return await client.post("/v1/lora_adapters", json={"name": name, "path": str(path)})


async def greedy(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int = 10) -> tuple[list[str], list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    lp = response.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


async def test_an_adapter_answers_as_the_merged_model(nursery, tiny_gguf, adapters):
    url = await start_server(nursery, make_settings(tiny_gguf))
    merged = await start_server(nursery, attrs.evolve(make_settings(adapters["merged_a"]), served_model_name="merged"))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            client.base_url = url
            loaded = await load(client, "tuned", adapters["a"])
            assert loaded.status_code == 200, loaded.text
            assert loaded.json() == {"name": "tuned", "base_model": MODEL_NAME, "path": str(adapters["a"]), "rank": 4, "state": "ready", "requests_in_flight": 0, "shared": True}
            for prompt in PROMPTS:
                client.base_url = url
                tokens, logprobs = await greedy(client, "tuned", prompt)
                base_tokens, _ = await greedy(client, MODEL_NAME, prompt)
                client.base_url = merged
                want_tokens, want = await greedy(client, "merged", prompt)
                assert tokens == want_tokens, prompt
                assert max(abs(x - y) for x, y in zip(logprobs, want, strict=True)) < 1e-4, (logprobs, want)
                assert base_tokens != tokens or prompt != PROMPTS[0]  # the adapter changes what the model says
            client.base_url = url
            listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
            assert listed["tuned"]["parent"] == MODEL_NAME and listed["tuned"]["state"] == "ready"


async def test_base_and_two_adapters_share_steps_and_keep_their_bits(nursery, tiny_gguf, adapters):
    url = await start_server(nursery, make_settings(tiny_gguf, max_num_seqs=4))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            assert (await load(client, "a", adapters["a"])).status_code == 200
            assert (await load(client, "b", adapters["b"])).status_code == 200
            models = (MODEL_NAME, "a", "b")
            solo = {m: await greedy(client, m, PROMPTS[1], 24) for m in models}
            assert len({tuple(t) for t, _ in solo.values()}) == 3  # three different models
            steps_before = (await metrics(client))["steps"]
            together: dict[str, tuple] = {}
            async with trio.open_nursery() as inner:
                for m in models:

                    async def one(m=m):
                        together[m] = await greedy(client, m, PROMPTS[1], 24)

                    inner.start_soon(one)
            steps = (await metrics(client))["steps"] - steps_before
            assert steps < 3 * 24, f"{steps} steps: the three requests did not share steps"
            assert together == solo  # bit for bit: tokens and logprobs


async def test_the_prefix_cache_never_crosses_adapters(nursery, tiny_gguf, adapters):
    url = await start_server(nursery, make_settings(tiny_gguf))
    prompt = "a long shared prompt " * 6

    async def cached(client, model) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            assert (await load(client, "a", adapters["a"])).status_code == 200
            assert (await load(client, "b", adapters["b"])).status_code == 200
            assert await cached(client, MODEL_NAME) == 0
            assert await cached(client, MODEL_NAME) > 0  # the base model's own prefix, found
            assert await cached(client, "a") == 0  # not the base model's
            assert await cached(client, "b") == 0  # nor a's
            assert await cached(client, "a") > 0  # its own, found


async def test_adapter_refusals(nursery, tiny_gguf, adapters):
    url = await start_server(nursery, make_settings(tiny_gguf, max_loras=2, max_lora_rank=4))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            wide = await load(client, "wide", adapters["wide"])
            assert_error(wide, 400, fragment="adapter 'wide': layers.0.self_attn.q_proj.lora_A.weight has shape (4, 128); the model needs (4, 64)", param="path")
            rank = await load(client, "b", adapters["b"])
            assert_error(rank, 400, fragment="adapter 'b': rank 8 is more than --max-lora-rank 4", param="path")
            nowhere = await load(client, "x", adapters["a"].parent / "none")
            assert_error(nowhere, 400, fragment="adapter 'x'", param="path")
            taken = await load(client, MODEL_NAME, adapters["a"])
            assert_error(taken, 409, fragment=f"the model name '{MODEL_NAME}' is already served", param="name", code="model_exists")
            assert (await load(client, "a1", adapters["a"])).status_code == 200
            twice = await load(client, "a1", adapters["a"])
            assert_error(twice, 409, fragment="the model name 'a1' is already served", param="name", code="model_exists")
            assert (await load(client, "a2", adapters["a"])).status_code == 200
            full = await load(client, "a3", adapters["a"])
            assert_error(full, 400, fragment="holds 2 adapters, as many as --max-loras (2) allows", param="name", code="too_many_adapters")
            missing = await client.post("/v1/lora_adapters", json={"path": str(adapters["a"])})
            assert_error(missing, 400, fragment="name: expected a non-empty string", param="name")
            unknown = await client.delete("/v1/lora_adapters/ghost")
            assert_error(unknown, 404, fragment="no LoRA adapter 'ghost'", param="name", code="adapter_not_found")
            bad = await client.delete("/v1/lora_adapters/a1", params={"timeout_s": "soon"})
            assert_error(bad, 400, fragment="timeout_s: expected a number of seconds, 0 or more, got 'soon'", param="timeout_s")
            listed = (await client.get("/v1/lora_adapters")).json()["data"]
            assert [a["name"] for a in listed] == ["a1", "a2"]
            gone = await client.delete("/v1/lora_adapters/a1")
            assert gone.status_code == 200 and gone.json()["unloaded"] is True
            assert (await load(client, "a3", adapters["a"])).status_code == 200  # room again


async def test_unloading_an_adapter_in_use_drains_it(nursery, tiny_gguf, adapters, slow_steps):
    url = await start_server(nursery, make_settings(tiny_gguf))
    slow_steps(0.02)
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            assert (await load(client, "a", adapters["a"])).status_code == 200
            out: list = []
            started = trio.Event()

            async def stream(model: str) -> None:
                body = {"model": model, "prompt": "Tell me", "max_tokens": 60, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    started.set()
                    out.append((model, await read_sse(response)))

            async with trio.open_nursery() as inner:
                inner.start_soon(stream, "a")
                await started.wait()
                started = trio.Event()
                inner.start_soon(stream, MODEL_NAME)
                await started.wait()
                while (await metrics(client))["running"] < 2:
                    await trio.sleep(0.01)
                gone = await client.delete("/v1/lora_adapters/a", params={"timeout_s": "0"})
            assert gone.status_code == 200, gone.text
            assert gone.json() == {"name": "a", "unloaded": True, "requests_in_flight": 1, "requests_ended": 1}
            results = dict(out)
            assert "the LoRA adapter 'a' was unloaded" in results["a"].chunks[-1]["error"]["message"]
            assert results[MODEL_NAME].chunks[-1]["choices"][0]["finish_reason"] == "length"  # the base model's stream went on
            refused = await client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
            assert_error(refused, 404, fragment="the model 'a' does not exist", param="model", code="model_not_found")


async def test_adapters_given_at_start(nursery, tiny_gguf, adapters):
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), loras=[("a", str(adapters["a"]))]))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            listed = (await client.get("/v1/lora_adapters")).json()["data"]
            assert [(a["name"], a["base_model"], a["state"]) for a in listed] == [("a", MODEL_NAME, "ready")]
            assert (await greedy(client, "a", PROMPTS[0]))[0] != (await greedy(client, MODEL_NAME, PROMPTS[0]))[0]
            vectors = []
            for model in ("a", MODEL_NAME, "a"):
                response = await client.post("/v1/embeddings", json={"model": model, "input": "the same words"})
                assert response.status_code == 200, response.text
                vectors.append(response.json()["data"][0]["embedding"])
            assert vectors[0] == vectors[2] and vectors[0] != vectors[1]  # the adapter's own hidden states
