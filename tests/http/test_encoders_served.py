"""BERT encoders served for embeddings: a random BertModel (transformers) in
an HF directory with a WordPiece tokenizer; its /v1/embeddings vectors are
transformers' final hidden states of the input wrapped as its tokenizer
wraps it ([CLS] ... [SEP]), pooled as its sentence-transformers module says
(CLS, or the mean where it says nothing), scaled to length 1; inputs batched
together give what each gives alone; generation on it is a 400 naming the
model; /v1/rerank scores by the cosine of those vectors."""

from __future__ import annotations

import attrs
import httpx
import numpy as np
import pytest
import torch
import trio

from tests.families import build_bert
from tests.http.conftest import assert_error, make_settings, start_server

TIMEOUT = 60.0
TEXTS = ["the quick brown fox", "a tokenizer turns text into numbers", "hello, world! how are you today?"]


@pytest.fixture(scope="module", params=["cls", None], ids=["cls-pooling", "no-pooling-module"])
def bert(request, tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert"), pooling=request.param), request.param


def reference(built, pooling: str | None, text: str) -> np.ndarray:
    ids = built["tokenizer"].encode(text).ids  # with [CLS] and [SEP]
    with torch.no_grad():
        states = built["model"](torch.tensor([ids])).last_hidden_state[0].double().numpy()
    vector = states[0] if pooling == "cls" else states.mean(0)
    return vector / np.linalg.norm(vector)


async def test_embeddings_are_transformers_pooled_states(nursery, bert):
    built, pooling = bert
    url = await start_server(nursery, make_settings(built["hf"]))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            together = await client.post("/v1/embeddings", json={"input": TEXTS})
            assert together.status_code == 200, together.text
            alone = [(await client.post("/v1/embeddings", json={"input": t})).json()["data"][0]["embedding"] for t in TEXTS]
            card = (await client.get("/v1/models")).json()["data"][0]
    vectors = [item["embedding"] for item in together.json()["data"]]
    assert vectors == alone  # an input's vector does not depend on what shares its step
    for text, vector in zip(TEXTS, vectors):
        np.testing.assert_allclose(np.array(vector), reference(built, pooling, text), atol=1e-5)
    assert together.json()["usage"]["prompt_tokens"] == sum(len(built["tokenizer"].encode(t).ids) for t in TEXTS)
    assert card["id"] == "tiny" and card["family"] == "bert"
    assert card["routes"] == ["/v1/embeddings", "/v1/rerank", "/v1/score"]


async def test_generation_on_an_encoder_is_a_400_naming_the_model(nursery, bert):
    built, _ = bert
    url = await start_server(nursery, make_settings(built["hf"]))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            for path, body in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
                ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
            ):
                response = await client.post(path, json=body)
                error = assert_error(
                    response, 400, param="model",
                    fragment="this model is an encoder (bert): it serves embeddings (/v1/embeddings, and /v1/rerank and /v1/score "
                    "by their cosine), not generation",
                )  # fmt: skip
                assert error["message"].startswith("model: ") or error["message"].startswith("this model"), error


async def test_rerank_on_an_encoder_is_the_cosine_of_its_embeddings(nursery, bert):
    built, pooling = bert
    url = await start_server(nursery, make_settings(built["hf"]))
    query, documents = TEXTS[0], TEXTS[1:]
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            got = await client.post("/v1/rerank", json={"query": query, "documents": documents})
            assert got.status_code == 200, got.text
    scores = {r["index"]: r["relevance_score"] for r in got.json()["results"]}
    q = reference(built, pooling, query)
    for i, doc in enumerate(documents):
        assert abs(scores[i] - float(q @ reference(built, pooling, doc))) < 1e-5


async def test_an_input_longer_than_a_step_is_refused(nursery, bert):
    built, _ = bert
    url = await start_server(nursery, make_settings(built["hf"], prefill_budget=16))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            long = " ".join(["fox"] * 40)
            response = await client.post("/v1/embeddings", json={"input": long})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "input"
    assert "more than the 16 this server embeds in one input" in response.json()["error"]["message"]


async def test_what_an_encoder_refuses_by_name_and_what_tokenize_counts(nursery, bert, tmp_path):
    built, _ = bert
    url = await start_server(nursery, make_settings(built["hf"]))
    says = "this model is an encoder (bert): it serves embeddings (/v1/embeddings, and /v1/rerank and /v1/score by their cosine)"
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            session = await client.post("/v1/sessions", json={})
            assert_error(session, 400, param="model", fragment=f"{says}, not sessions")
            adapter = await client.post("/v1/lora_adapters", json={"name": "a", "path": str(tmp_path)})
            assert_error(adapter, 400, param="base_model", fragment=f"{says}; it takes no LoRA adapters")
            counted = (await client.post("/tokenize", json={"prompt": TEXTS[1]})).json()
            embedded = (await client.post("/v1/embeddings", json={"input": TEXTS[1]})).json()
    assert counted["tokens"] == built["tokenizer"].encode(TEXTS[1]).ids  # [CLS] ... [SEP], as the embedding is made
    assert counted["count"] == embedded["usage"]["prompt_tokens"]


async def test_an_encoder_keeps_float32_weights_whatever_the_dtype(nursery, bert):
    """--dtype bfloat16 (what auto is on a CPU with bf16) rounds a decoder's
    weights; an encoder computes in float32, from its file's own values."""
    built, pooling = bert
    url = await start_server(nursery, attrs.evolve(make_settings(built["hf"]), engine=attrs.evolve(make_settings(built["hf"]).engine, dtype="bfloat16")))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            vector = (await client.post("/v1/embeddings", json={"input": TEXTS[0]})).json()["data"][0]["embedding"]
    np.testing.assert_allclose(np.array(vector), reference(built, pooling, TEXTS[0]), atol=1e-5)
