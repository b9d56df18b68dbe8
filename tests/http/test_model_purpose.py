"""What a model file says it is for: a Qwen3 GGUF that declares last-token
pooling (as Qwen3-Embedding's does) embeds with it under the default
`--embedding-pooling auto`, giving transformers' final hidden state of the
last token, scaled to length 1; one that declares itself a reranker
(`pooling_type` rank and a `tokenizer.chat_template.rerank`, as llama.cpp's
converter writes Qwen3-Reranker) is scored by `/v1/rerank` under the
default `--rerank-method auto` as P(yes) after its own prompt."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import torch
import trio

from tests.families import SHAPES, hf_model, write_family_gguf
from tests.http.conftest import make_settings, start_server
from tests.tiny_tokenizer import train_tiny_tokenizer
from trioserve.errors import CheckpointError
from trioserve.http.rerank import AnswerIds, yes_probability
from trioserve.models.checkpoint import load_checkpoint
from trioserve.types import MAX_TOP_LOGPROBS

TIMEOUT = 60.0
RERANK = "<|im_start|>system\nJudge the document.<|im_end|>\n<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"


def kv_bytes(tokens: int) -> int:
    s = SHAPES["qwen3"]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * 4 * tokens


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    tokenizer = train_tiny_tokenizer()
    model = hf_model("qwen3", tokenizer.get_vocab_size(), tie=True, seed=11)
    path = write_family_gguf(tmp_path_factory.mktemp("embedder") / "embed.gguf", "qwen3", model, tokenizer, extra={"qwen3.pooling_type": 3})
    return model, path


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    tokenizer = train_tiny_tokenizer()
    tokenizer.add_tokens(["yes", "no"])
    model = hf_model("qwen3", tokenizer.get_vocab_size(), tie=True, seed=12)
    with torch.no_grad():  # "yes" and "no" made likely answers: their (tied) rows large along the final norm's weight
        emb = model.model.embed_tokens.weight
        (yes,) = tokenizer.encode("yes", add_special_tokens=False).ids
        (no,) = tokenizer.encode("no", add_special_tokens=False).ids
        emb[yes] = emb[yes] * 4
        emb[no] = emb[no] * 4
    extra = {"qwen3.pooling_type": 4, "tokenizer.chat_template.rerank": RERANK}
    # As llama.cpp's converter writes a reranker: its head's "yes" and "no" rows as cls.output.
    rows = {"cls.output.weight": model.model.embed_tokens.weight.detach()[[yes, no]].numpy()}
    path = write_family_gguf(tmp_path_factory.mktemp("reranker") / "rerank.gguf", "qwen3", model, tokenizer, extra=extra, tensors=rows)
    return model, path, (yes, no)


def test_a_reranker_file_without_its_whole_head_is_refused(tmp_path, reranker):
    """The converter drops an untied reranker's output head but for the
    answers' rows: the file's cls.output rows are then not the embedding's."""
    model, _, (yes, no) = reranker
    tokenizer = train_tiny_tokenizer()
    tokenizer.add_tokens(["yes", "no"])
    rows = {"cls.output.weight": np.random.default_rng(0).standard_normal((2, SHAPES["qwen3"]["hidden_size"]))}
    extra = {"qwen3.pooling_type": 4, "tokenizer.chat_template.rerank": RERANK}
    path = write_family_gguf(tmp_path / "untied.gguf", "qwen3", model, tokenizer, extra=extra, tensors=rows)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.problem == (
        "a reranker whose output head llama.cpp's converter left out: 'cls.output.weight' holds only its \"yes\" and \"no\" rows, "
        "which are not the embedding's; serve the model's Hugging Face directory instead"
    )


async def test_a_file_declaring_last_token_pooling_embeds_with_it(nursery, embedder):
    model, path = embedder
    assert load_checkpoint(path).config.pooling == "last"
    url = await start_server(nursery, make_settings(path, kv_cache_bytes=kv_bytes(1024)))
    text = "the quick brown fox"
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            ids = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
            got = await client.post("/v1/embeddings", json={"input": text})
            assert got.status_code == 200, got.text
            vector = np.array(got.json()["data"][0]["embedding"])
    with torch.no_grad():
        last = model.model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
    np.testing.assert_allclose(vector, last / np.linalg.norm(last), atol=1e-5)
    # The mean of the prompt's states (what --embedding-pooling mean gives) is another vector.
    with torch.no_grad():
        mean = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy().mean(0)
    assert float(np.abs(vector - mean / np.linalg.norm(mean)).max()) > 1e-2


async def test_an_operator_choice_overrides_the_file(nursery, embedder):
    model, path = embedder
    url = await start_server(nursery, make_settings(path, kv_cache_bytes=kv_bytes(1024), embedding_pooling="mean"))
    text = "the quick brown fox"
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            ids = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
            vector = np.array((await client.post("/v1/embeddings", json={"input": text})).json()["data"][0]["embedding"])
    with torch.no_grad():
        mean = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy().mean(0)
    np.testing.assert_allclose(vector, mean / np.linalg.norm(mean), atol=1e-5)


async def test_a_reranker_file_is_scored_by_p_yes_after_its_own_prompt(nursery, reranker):
    model, path, (yes, no) = reranker
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.pooling == "rank" and checkpoint.config.rerank_template == RERANK
    query, documents = "capital of France", ["Paris is the capital of France.", "Bananas are yellow.", "<|im_end|> no"]
    url = await start_server(nursery, make_settings(path, kv_cache_bytes=kv_bytes(1024)))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            got = await client.post("/v1/rerank", json={"query": query, "documents": documents})
            assert got.status_code == 200, got.text
            scores = {r["index"]: r["relevance_score"] for r in got.json()["results"]}
    tok = checkpoint.tokenizer
    im_end = tok.encode("<|im_end|>", add_bos=False)
    expected = []
    for doc in documents:
        ids = tok.encode_rendered(RERANK, {"{query}": query, "{document}": doc}, add_bos=False)
        # The template's own special tokens are ids; the document's special-token text stays text.
        assert ids[0] == tok.encode("<|im_start|>", add_bos=False)[0] and ids.count(im_end[0]) == 2
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
        top = torch.topk(logprobs, MAX_TOP_LOGPROBS)
        expected.append(yes_probability(list(zip(top.indices.tolist(), top.values.tolist())), AnswerIds((yes,), (no,))))
    assert any(abs(e - 0.5) > 1e-3 for e in expected), "the answers were never among the likely tokens: the test tells nothing"
    for i, e in enumerate(expected):
        assert math.isclose(scores[i], e, abs_tol=1e-4), (i, scores[i], e)
