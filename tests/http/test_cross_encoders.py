"""Cross-encoder rerankers (a BERT or XLM-RoBERTa sequence classifier with
one relevance output, as ms-marco MiniLM and bge-reranker are): /v1/rerank
and /v1/score give each (query, document) pair, joined as the model's
tokenizer joins a pair, the sigmoid of transformers' logit; the model
serves nothing else, and says so by name."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
import trio

from tests.families import build_cross_encoder
from tests.http.conftest import assert_error, make_settings, start_server

TIMEOUT = 60.0
QUERY = "the quick brown fox"
DOCUMENTS = ["the fox jumps over the lazy dog", "a tokenizer turns text into numbers", "hello, world! how are you today?"]


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def cross(request, tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp(request.param), request.param)


def expected(built, query: str, document: str) -> float:
    enc = built["tokenizer"].encode(query, document)
    with torch.no_grad():
        kwargs = {"token_type_ids": torch.tensor([enc.type_ids])} if built["model"].config.model_type == "bert" else {}
        logit = float(built["model"](input_ids=torch.tensor([enc.ids]), **kwargs).logits[0, 0])
    return 1.0 / (1.0 + math.exp(-logit))


async def test_scores_are_transformers_relevance_probabilities(nursery, cross):
    url = await start_server(nursery, make_settings(cross["hf"]))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            ranked = await client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
            assert ranked.status_code == 200, ranked.text
            scored = await client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
            assert scored.status_code == 200, scored.text
            card = (await client.get("/v1/models")).json()["data"][0]
    want = [expected(cross, QUERY, d) for d in DOCUMENTS]
    assert max(want) - min(want) > 1e-3  # the random head tells the documents apart: the test can fail
    got = {r["index"]: r["relevance_score"] for r in ranked.json()["results"]}
    for i, w in enumerate(want):
        assert abs(got[i] - w) < 1e-5, (i, got[i], w)
    order = [r["index"] for r in ranked.json()["results"]]
    assert all(want[a] >= want[b] - 1e-5 for a, b in zip(order, order[1:]))  # best first
    assert [round(d["score"], 5) for d in scored.json()["data"]] == [round(w, 5) for w in want]
    assert card["routes"] == ["/v1/rerank", "/v1/score"]


async def test_a_cross_encoder_serves_nothing_else(nursery, cross):
    url = await start_server(nursery, make_settings(cross["hf"]))
    family = cross["model"].config.model_type
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            embedded = await client.post("/v1/embeddings", json={"input": QUERY})
            chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    says = f"this model is a cross-encoder ({family}): it scores pairs (/v1/rerank and /v1/score)"
    assert_error(embedded, 400, param="model", fragment=f"{says}, not embeddings")
    assert_error(chat, 400, param="model", fragment=f"{says}, not generation")
