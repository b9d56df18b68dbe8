"""Several models in one server (trioserve/http/registry.py): each request
goes to the model it names, which answers exactly as it does served alone;
the listing, the metrics and the errors name the models."""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, start_server
from tests.tiny_model import tiny_weights, train_tiny_tokenizer, write_gguf
from trioserve import cli
from trioserve.config import ServerSettings

TIMEOUT = 60
OTHER = "other"
PROMPTS = ("The quick brown fox", "Once upon a time", "1 2 3 4")


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model: the same shape and tokenizer, other weights."""
    tokenizer = train_tiny_tokenizer()
    return write_gguf(tmp_path_factory.mktemp("other") / "other.gguf", tiny_weights(tokenizer.get_vocab_size(), seed=7), tokenizer)


def two_models(first: Path, second: Path, **engine: object) -> ServerSettings:
    return attrs.evolve(make_settings(first, **engine), more_models=[(OTHER, str(second))])


async def greedy(client: httpx.AsyncClient, model: str | None, prompt: str) -> tuple[str, list]:
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    if model is not None:
        body["model"] = model
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


async def test_each_model_answers_as_it_does_alone(nursery, tiny_gguf, other_gguf):
    alone = await start_server(nursery, make_settings(tiny_gguf))
    other_alone = await start_server(nursery, attrs.evolve(make_settings(other_gguf), served_model_name=OTHER))
    both = await start_server(nursery, two_models(tiny_gguf, other_gguf))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            for prompt in PROMPTS:
                client.base_url = alone
                a = await greedy(client, None, prompt)
                client.base_url = other_alone
                b = await greedy(client, None, prompt)
                assert a != b, "the two test models must differ for this test to tell them apart"
                client.base_url = both
                assert await greedy(client, MODEL_NAME, prompt) == a
                assert await greedy(client, OTHER, prompt) == b


async def test_the_registry_is_listed_measured_and_named_in_errors(nursery, tiny_gguf, other_gguf):
    url = await start_server(nursery, two_models(tiny_gguf, other_gguf))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["state"]) for m in listed] == [(MODEL_NAME, "ready"), (OTHER, "ready")]
            card = (await client.get(f"/v1/models/{OTHER}")).json()
            assert (card["id"], card["state"], card["max_model_len"]) == (OTHER, "ready", 256)

            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            missing = await client.post("/v1/chat/completions", json=chat)
            assert_error(missing, 400, fragment=f"model: required, this server serves several models ('{MODEL_NAME}', '{OTHER}')", param="model")
            unknown = await client.post("/v1/chat/completions", json={**chat, "model": "nope"})
            assert_error(unknown, 404, fragment="the model 'nope' does not exist (this server serves 'tiny', 'other')", param="model", code="model_not_found")
            ok = await client.post("/v1/chat/completions", json={**chat, "model": OTHER})
            assert ok.status_code == 200 and ok.json()["model"] == OTHER

            metrics = (await client.get("/metrics")).json()
            assert set(metrics["models"]) == {MODEL_NAME, OTHER}
            assert metrics["models"][OTHER]["generated_tokens"] == 2
            assert metrics["models"][MODEL_NAME]["generated_tokens"] == 0
            text = (await client.get("/metrics/prometheus")).text
    generated = {
        s.labels["model"]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "trioserve_generation_tokens_total"
    }
    assert generated == {MODEL_NAME: 0, OTHER: 2}


async def test_sessions_and_embeddings_go_to_their_model(nursery, tiny_gguf, other_gguf):
    """A session keeps the model it was made for; an embedding request
    names its model like any other."""
    url = await start_server(nursery, two_models(tiny_gguf, other_gguf))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            made = await client.post("/v1/sessions", json={"model": OTHER})
            assert made.status_code == 200 and made.json()["model"] == OTHER, made.text
            turn = await client.post(f"/v1/sessions/{made.json()['id']}/turns", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert turn.status_code == 200 and turn.json()["model"] == OTHER, turn.text
            vectors = {}
            for name in (MODEL_NAME, OTHER):
                response = await client.post("/v1/embeddings", json={"model": name, "input": "the same words"})
                assert response.status_code == 200 and response.json()["model"] == name
                vectors[name] = response.json()["data"][0]["embedding"]
            assert vectors[MODEL_NAME] != vectors[OTHER]
            no_model = await client.post("/v1/sessions", json={})
            assert_error(no_model, 400, fragment="model: required", param="model")


def test_model_given_several_times_on_the_command_line():
    args = cli.build_parser().parse_args(["serve", "--model", "chat=/m/a.gguf", "--model", "/m/b.gguf", "--model", "emb=./c"])
    settings = cli.serve_settings(args, {})
    assert [(name, config.model) for name, config in settings.models()] == [("chat", "/m/a.gguf"), ("/m/b.gguf", "/m/b.gguf"), ("emb", "./c")]
    one = cli.serve_settings(cli.build_parser().parse_args(["serve", "--model", "/m/a.gguf", "--served-model-name", "x"]), {})
    assert [(name, config.model) for name, config in one.models()] == [("x", "/m/a.gguf")]
    default = cli.serve_settings(cli.build_parser().parse_args(["serve"]), {})
    assert [(name, config.model) for name, config in default.models()] == [("smollm2", "smollm2")]
    twice = cli.build_parser().parse_args(["serve", "--model", "a=/m/a.gguf", "--model", "a=/m/b.gguf"])
    with pytest.raises(ValueError, match="the model name 'a' is given twice"):
        cli.serve_settings(twice, {})


@pytest.mark.slow
async def test_two_tiny_models_and_the_real_one_under_three_names(nursery, tiny_gguf, other_gguf):
    """SmolLM2 beside the two tiny models: each name answers as its model
    does served alone (greedy, token for token)."""
    from trioserve.config import EngineConfig

    def real(**more) -> ServerSettings:
        engine = EngineConfig(model="smollm2", max_num_seqs=2, kv_cache_bytes=64 << 20)
        return attrs.evolve(ServerSettings(engine=engine, served_model_name="smol"), host="127.0.0.1", port=0, log_level="warning", **more)

    three = real(more_models=[(MODEL_NAME, str(tiny_gguf)), (OTHER, str(other_gguf))])
    with trio.fail_after(600):
        served = await start_server(nursery, three)
        alone = {"smol": await start_server(nursery, real()), MODEL_NAME: await start_server(nursery, make_settings(tiny_gguf))}
        alone[OTHER] = await start_server(nursery, attrs.evolve(make_settings(other_gguf), served_model_name=OTHER))
        async with httpx.AsyncClient(timeout=300) as client:
            answers = {}
            for name, url in alone.items():
                client.base_url = url
                answers[name] = await greedy(client, name, "The capital of France is")
            assert len({text for text, _ in answers.values()}) == 3
            client.base_url = served
            for name, expected in answers.items():
                assert await greedy(client, name, "The capital of France is") == expected, name
