"""`POST /v1/rerank` and `POST /v1/score` end to end (issue #27): a real
server on the tiny random Llama (fp32), and one slow test on SmolLM2.

What is checked, with the default `embedding` method: each score is the
exactly rounded dot product of the two texts' /v1/embeddings vectors;
results best first (equal scores by index), `top_n`, `return_documents`,
usage; /v1/score one-to-one and one-to-many giving the same numbers;
bit-identical scores alone, beside other documents and beside concurrent
requests; with two models served, each request scored by the one it names;
every bad body a 400 (404 for another model) naming its field.
With `yes-no`: the tiny tokenizer has no single token for "yes" or "no",
which is a 400 naming `model`; a copy of the tiny model whose tokenizer
has both scores each pair as P(yes) / (P(yes) + P(no)) of the top
logprobs that /v1/chat/completions gives for the same prompt, in [0, 1],
the same alone and batched; a client that leaves cancels the judgements
still to come. `yes_probability`'s rule for answers missing
from the top logprobs, and the judge prompt for a template that refuses a
system message, are checked directly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import httpx
import numpy as np
import pytest
import torch
import trio

from tests.http.conftest import MAX_MODEL_LEN, MODEL_NAME, assert_error, eventually, make_settings, metrics, start_server
from tests.http.test_registry import OTHER, two_models
from tests.tiny_model import tiny_weights, write_gguf, write_hf_dir
from tests.tiny_tokenizer import train_tiny_tokenizer
from trioserve.config import EngineConfig, ServerSettings, settings_from_env
from trioserve.http.rerank import JUDGE_INSTRUCTION, MAX_DOCUMENTS, AnswerIds, judge_prompt_ids, yes_probability
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import load_checkpoint

TIMEOUT = httpx.Timeout(30.0)
QUERY = "the cat sat on the mat"
DOCS = [
    "the dog sleeps in the sun",
    "def add(a, b): return a + b",
    "the cat sat on the mat and looked at the door",
    "numbers like 2024 and 3.14159",
    "hello world",
]


async def post(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def dot(a: list[float], b: list[float]) -> float:
    """The route's cosine, written again: exact float64 products, one rounding."""
    return max(-1.0, min(1.0, math.fsum((np.asarray(a, np.float64) * np.asarray(b, np.float64)).tolist())))


def scores_by_index(reply: dict) -> dict[int, float]:
    return {r["index"]: r["relevance_score"] for r in reply["results"]}


# --- the embedding method


async def test_rerank_orders_documents_by_the_cosine_of_their_embeddings(server):
    documents = [DOCS[0], {"text": DOCS[1], "title": "ignored"}, DOCS[2], DOCS[0], DOCS[3]]  # a repeated one ties
    texts = [DOCS[0], DOCS[1], DOCS[2], DOCS[0], DOCS[3]]
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            reply = await post(client, "/v1/rerank", {"query": QUERY, "documents": documents})
            top2 = await post(client, "/v1/rerank", {"model": MODEL_NAME, "query": QUERY, "documents": documents, "top_n": 2})
            many = await post(client, "/v1/rerank", {"query": QUERY, "documents": documents, "top_n": 100})
            bare = await post(client, "/v1/rerank", {"query": QUERY, "documents": documents, "return_documents": False})
            embedded = await post(client, "/v1/embeddings", {"input": [QUERY, *texts]})
    assert set(reply) == {"id", "model", "results", "usage"} and reply["id"].startswith("rerank-")
    assert reply["model"] == MODEL_NAME
    vectors = [d["embedding"] for d in embedded["data"]]
    expected = [dot(vectors[0], v) for v in vectors[1:]]
    assert len(reply["results"]) == len(documents)
    for result in reply["results"]:
        assert set(result) == {"index", "relevance_score", "document"}
        assert result["relevance_score"] == expected[result["index"]]  # exactly
        assert result["document"] == {"text": texts[result["index"]]}
    order = [r["index"] for r in reply["results"]]
    assert order == sorted(range(len(texts)), key=lambda i: (-expected[i], i))
    assert order.index(0) < order.index(3)  # equal scores: the lower index first
    assert expected[2] == max(expected)  # the document that repeats the query wins
    assert reply["usage"] == {"total_tokens": embedded["usage"]["total_tokens"]}
    assert top2["results"] == reply["results"][:2]
    assert many["results"] == reply["results"]
    assert [set(r) for r in bare["results"]] == [{"index", "relevance_score"}] * len(documents)
    assert [(r["index"], r["relevance_score"]) for r in bare["results"]] == [(r["index"], r["relevance_score"]) for r in reply["results"]]


async def test_score_pairs_one_to_one_and_one_to_many(server):
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            ranked = scores_by_index(await post(client, "/v1/rerank", {"query": QUERY, "documents": DOCS}))
            many = await post(client, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
            listed_one = await post(client, "/v1/score", {"model": MODEL_NAME, "text_1": [QUERY], "text_2": DOCS})
            single = await post(client, "/v1/score", {"text_1": QUERY, "text_2": DOCS[2]})
            paired = await post(client, "/v1/score", {"text_1": [QUERY, DOCS[1], DOCS[3]], "text_2": [DOCS[2], DOCS[1], DOCS[4]]})
            embedded = await post(client, "/v1/embeddings", {"input": [QUERY, DOCS[1], DOCS[3], DOCS[2], DOCS[1], DOCS[4]]})
    assert set(many) == {"id", "object", "created", "model", "data", "usage"} and many["id"].startswith("score-")
    assert many["object"] == "list" and many["model"] == MODEL_NAME
    assert [set(d) for d in many["data"]] == [{"index", "object", "score"}] * len(DOCS)
    assert [d["object"] for d in many["data"]] == ["score"] * len(DOCS)
    assert [d["index"] for d in many["data"]] == list(range(len(DOCS)))
    scores = [d["score"] for d in many["data"]]
    assert scores == [ranked[i] for i in range(len(DOCS))]
    assert [d["score"] for d in listed_one["data"]] == scores
    assert [d["score"] for d in single["data"]] == [ranked[2]]
    v = [d["embedding"] for d in embedded["data"]]  # text_1's, then text_2's
    assert [d["score"] for d in paired["data"]] == [dot(v[0], v[3]), dot(v[1], v[4]), dot(v[2], v[5])]
    assert paired["data"][1]["score"] == pytest.approx(1.0, abs=1e-6)  # a text against itself
    assert paired["usage"] == {"prompt_tokens": embedded["usage"]["prompt_tokens"], "total_tokens": embedded["usage"]["total_tokens"]}


async def test_scores_are_the_same_alone_in_a_batch_and_beside_other_requests(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf, max_num_seqs=4, prefill_budget=16))
    others = ["the quick brown fox jumps over the lazy dog " * 3, "print(add(1, 2))", "I am fine, thank you."]
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            alone = []
            for doc in DOCS:
                alone.append(scores_by_index(await post(client, "/v1/rerank", {"query": QUERY, "documents": [doc]}))[0])
            batched = scores_by_index(await post(client, "/v1/rerank", {"query": QUERY, "documents": others + DOCS + others}))
            together: dict[int, dict] = {}

            async def one(i: int, body: dict) -> None:
                together[i] = await post(client, "/v1/rerank" if "query" in body else "/v1/score", body)

            async with trio.open_nursery() as inner:
                inner.start_soon(one, 0, {"query": QUERY, "documents": DOCS})
                inner.start_soon(one, 1, {"query": others[0], "documents": others + DOCS})
                inner.start_soon(one, 2, {"text_1": QUERY, "text_2": list(reversed(DOCS))})
                inner.start_soon(one, 3, {"text_1": others, "text_2": DOCS[:3]})
    assert [batched[len(others) + i] for i in range(len(DOCS))] == alone
    assert [scores_by_index(together[0])[i] for i in range(len(DOCS))] == alone
    assert [d["score"] for d in together[2]["data"]] == list(reversed(alone))


@pytest.fixture(scope="module")
def second_gguf(tmp_path_factory) -> Path:
    """The tiny model's shape and tokenizer with other weights."""
    tokenizer = train_tiny_tokenizer()
    return write_gguf(tmp_path_factory.mktemp("second") / "second.gguf", tiny_weights(tokenizer.get_vocab_size(), seed=11), tokenizer)


async def test_each_request_is_scored_by_the_model_it_names(nursery, tiny_gguf, second_gguf):
    url = await start_server(nursery, two_models(tiny_gguf, second_gguf))
    alone = await start_server(nursery, make_settings(tiny_gguf))
    body = {"query": QUERY, "documents": DOCS}
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            first = await post(client, "/v1/rerank", {**body, "model": MODEL_NAME})
            other = await post(client, "/v1/rerank", {**body, "model": OTHER})
            scored = await post(client, "/v1/score", {"text_1": QUERY, "text_2": DOCS, "model": OTHER})
            unnamed = await client.post("/v1/rerank", json=body)
        async with httpx.AsyncClient(base_url=alone, timeout=TIMEOUT) as client:
            single = await post(client, "/v1/rerank", body)
    assert first["model"] == MODEL_NAME and other["model"] == scored["model"] == OTHER
    assert scores_by_index(first) == scores_by_index(single) != scores_by_index(other)
    assert [d["score"] for d in scored["data"]] == [scores_by_index(other)[i] for i in range(len(DOCS))]
    assert_error(unnamed, 400, fragment="model: required, this server serves several models", param="model")


# --- bad bodies

TOO_LONG = "x" * (MAX_MODEL_LEN + 10)  # one token per character in the tiny tokenizer
BAD = [
    # (route, body, status, message fragment, param)
    ("rerank", [1, 2], 400, "the request body must be a JSON object", None),
    ("rerank", {"documents": ["a"]}, 400, "query: this field is required", "query"),
    ("rerank", {"query": 5, "documents": ["a"]}, 400, "query: expected a string, got 5", "query"),
    ("rerank", {"query": "", "documents": ["a"]}, 400, "query: must not be empty", "query"),
    ("rerank", {"query": "q"}, 400, "documents: this field is required", "documents"),
    ("rerank", {"query": "q", "documents": "a"}, 400, "documents: expected a list of strings or of objects with text, got the string 'a'", "documents"),
    ("rerank", {"query": "q", "documents": []}, 400, "documents: must not be empty", "documents"),
    ("rerank", {"query": "q", "documents": ["a", "b", 5]}, 400, "documents[2]: expected a string or an object with text, got 5", "documents[2]"),
    ("rerank", {"query": "q", "documents": ["a", {"title": "b"}]}, 400, "documents[1]: expected a string or an object with text, got an object", "documents[1]"),
    ("rerank", {"query": "q", "documents": [{"text": ["a"]}]}, 400, "documents[0].text: expected a string, got a list", "documents[0].text"),
    ("rerank", {"query": "q", "documents": ["a", ""]}, 400, "documents[1]: must not be empty", "documents[1]"),
    ("rerank", {"query": "q", "documents": ["a"] * (MAX_DOCUMENTS + 1)}, 400,
     f"documents: at most {MAX_DOCUMENTS} documents are allowed in one request, got {MAX_DOCUMENTS + 1}", "documents"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n: must be at least 1", "top_n"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": -3}, 400, "top_n: must be at least 1", "top_n"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": 1.5}, 400, "top_n: expected an integer, got 1.5", "top_n"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": True}, 400, "top_n: expected an integer, got true", "top_n"),
    ("rerank", {"query": "q", "documents": ["a"], "return_documents": "yes"}, 400, "return_documents: expected true or false, got the string 'yes'", "return_documents"),
    ("rerank", {"query": "q", "documents": ["a"], "model": 7}, 400, "model: expected a string, got 7", "model"),
    ("rerank", {"query": "q", "documents": ["a"], "model": "other"}, 404, "the model 'other' does not exist", "model"),
    ("rerank", {"query": "q", "documents": ["a", "b\ud800"]}, 400, "documents[1]: the text contains a lone UTF-16 surrogate", "documents[1]"),
    ("rerank", {"query": "q", "documents": ["a", TOO_LONG]}, 400, f"documents[1]: {len(TOO_LONG)} tokens, more than the {MAX_MODEL_LEN}", "documents[1]"),
    ("rerank", {"query": TOO_LONG, "documents": ["a"]}, 400, f"query: {len(TOO_LONG)} tokens, more than the {MAX_MODEL_LEN}", "query"),
    ("score", {"text_2": "a"}, 400, "text_1: this field is required", "text_1"),
    ("score", {"text_1": "a"}, 400, "text_2: this field is required", "text_2"),
    ("score", {"text_1": 5, "text_2": "a"}, 400, "text_1: expected a string or a list of strings, got 5", "text_1"),
    ("score", {"text_1": [], "text_2": "a"}, 400, "text_1: must not be empty", "text_1"),
    ("score", {"text_1": "a", "text_2": ["b", 3]}, 400, "text_2[1]: expected a string, got 3", "text_2[1]"),
    ("score", {"text_1": "a", "text_2": [""]}, 400, "text_2[0]: must not be empty", "text_2[0]"),
    ("score", {"text_1": "", "text_2": "b"}, 400, "text_1: must not be empty", "text_1"),
    ("score", {"text_1": "a", "text_2": ["b"] * (MAX_DOCUMENTS + 1)}, 400,
     f"text_2: at most {MAX_DOCUMENTS} texts are allowed in one request, got {MAX_DOCUMENTS + 1}", "text_2"),
    ("score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400,
     "text_2: 3 texts for 2 in text_1; send one text_1 to score against every text_2, or as many of each (paired in order)", "text_2"),
    ("score", {"text_1": ["a", "b"], "text_2": "c"}, 400, "text_2: 1 texts for 2 in text_1", "text_2"),
    ("score", {"text_1": ["a", TOO_LONG], "text_2": ["c", "d"]}, 400, f"text_1[1]: {len(TOO_LONG)} tokens", "text_1[1]"),
    ("score", {"text_1": "a", "text_2": "b", "model": "other"}, 404, "the model 'other' does not exist", "model"),
]  # fmt: skip


async def test_every_bad_body_is_refused_naming_its_field(server):
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            for route, body, status, fragment, param in BAD:
                raw = json.dumps(body).encode()  # ASCII: a lone surrogate travels escaped, as JSON allows
                response = await client.post(f"/v1/{route}", content=raw, headers={"Content-Type": "application/json"})
                try:
                    error = assert_error(response, status, fragment=fragment, param=param)
                except AssertionError as exc:
                    raise AssertionError(f"/v1/{route} {json.dumps(body)[:120]}: {exc}") from None
                if "tokens, more than" in fragment:
                    assert error["code"] == "context_length_exceeded", error
            for route in ("rerank", "score"):
                bad_json = await client.post(f"/v1/{route}", content=b"{", headers={"Content-Type": "application/json"})
                assert_error(bad_json, 400, fragment="the request body is not valid JSON", param=None)
            health = await client.get("/health")
    assert health.status_code == 200


# --- the yes-no method


def test_the_method_is_a_server_setting_with_its_variable():
    assert ServerSettings().rerank_method == "auto"  # yes-no for a reranker file (tests/http/test_model_purpose.py), else embedding
    assert settings_from_env({"TRIOSERVE_RERANK_METHOD": "yes-no"}).rerank_method == "yes-no"
    with pytest.raises(ValueError, match="TRIOSERVE_RERANK_METHOD"):
        settings_from_env({"TRIOSERVE_RERANK_METHOD": "cross"})
    with pytest.raises(ValueError, match="must be one of auto, embedding, yes-no"):
        ServerSettings(rerank_method="cross")


async def test_yes_no_needs_yes_and_no_as_tokens_of_their_own(nursery, tiny_gguf):
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), rerank_method="yes-no"))
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            refusals = [
                await client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}),
                await client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS[0]}),
            ]
    for response in refusals:
        assert_error(
            response, 400, param="model",
            fragment=f"model: {MODEL_NAME!r} cannot be scored with --rerank-method yes-no: its tokenizer has no single token "
            'for "yes" nor for "no", so the answer\'s probability cannot be read from one token\'s logprobs; '
            "serve it with --rerank-method embedding",
        )  # fmt: skip


@pytest.fixture(scope="module")
def yes_no_model(tmp_path_factory) -> Path:
    """The tiny model (its weights and tokenizer) with "yes" and "no" added
    to the tokenizer as tokens of their own (ids 360 and 361). Their output
    rows copy those of "ts" and "\\n", two tokens the tiny model puts among
    its most likely after any judge prompt, so both answers are always
    among the top logprobs and a score is their real ratio."""
    tokenizer = train_tiny_tokenizer()
    vocab = tokenizer.get_vocab_size()
    tokenizer.add_tokens(["yes", "no"])
    weights = tiny_weights(vocab)
    likely = [tokenizer.encode(text, add_special_tokens=False).ids for text in ("ts", "\n")]
    assert all(len(ids) == 1 for ids in likely), likely
    rows = [ids[0] for ids in likely]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = np.concatenate([weights[name], weights[name][rows]])
    return write_hf_dir(tmp_path_factory.mktemp("yes-no"), weights, tokenizer, shards=1)


def expected_yes_no(top_logprobs: list[dict]) -> float:
    """P(yes) / (P(yes) + P(no)) from a chat completion's top logprobs,
    both of which must be listed."""
    listed = {entry["token"]: entry["logprob"] for entry in top_logprobs}
    assert "yes" in listed and "no" in listed, sorted(listed)
    yes, no = math.exp(listed["yes"]), math.exp(listed["no"])
    return yes / (yes + no)


async def test_yes_no_scores_are_the_answer_probabilities_alone_and_batched(nursery, yes_no_model):
    settings = attrs.evolve(make_settings(yes_no_model), rerank_method="yes-no")
    url = await start_server(nursery, settings)
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            reply = await post(client, "/v1/rerank", {"query": QUERY, "documents": DOCS})
            scored = await post(client, "/v1/score", {"text_1": QUERY, "text_2": list(reversed(DOCS))})
            alone = [scores_by_index(await post(client, "/v1/rerank", {"query": QUERY, "documents": [doc]}))[0] for doc in DOCS]
            chats = []
            for doc in DOCS:
                messages = [{"role": "system", "content": JUDGE_INSTRUCTION}, {"role": "user", "content": f"<Query>: {QUERY}\n<Document>: {doc}"}]
                body = {"messages": messages, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 20, "ignore_eos": True}
                chats.append(await post(client, "/v1/chat/completions", body))
            too_long = await client.post("/v1/rerank", json={"query": QUERY, "documents": ["a", "x" * (MAX_MODEL_LEN - 20)]})
    scores = scores_by_index(reply)
    expected = [expected_yes_no(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) for chat in chats]
    assert [scores[i] for i in range(len(DOCS))] == pytest.approx(expected, rel=1e-12, abs=0)
    assert all(0.0 <= s <= 1.0 for s in scores.values())
    assert len(set(scores.values())) > 1  # the documents are told apart
    assert [r["index"] for r in reply["results"]] == sorted(range(len(DOCS)), key=lambda i: (-scores[i], i))
    assert [scores[i] for i in range(len(DOCS))] == alone
    assert [d["score"] for d in scored["data"]] == list(reversed(alone))
    assert reply["usage"]["total_tokens"] == sum(chat["usage"]["prompt_tokens"] for chat in chats)
    assert_error(too_long, 400, fragment="documents[1]: the relevance prompt for this document and its query has", param="documents[1]")


async def test_a_client_that_leaves_cancels_every_judgement(nursery, yes_no_model, slow_steps):
    """24 documents of ~150 tokens, 64 prompt tokens a step: about 60
    slowed steps; the client leaves after the first ones ran."""
    slow_steps(0.03)
    url = await start_server(nursery, attrs.evolve(make_settings(yes_no_model), rerank_method="yes-no"))
    documents = [f"{i} " + "the quick brown fox jumps over the lazy dog " * 3 for i in range(24)]
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            before = await metrics(client)
            host, port = url.removeprefix("http://").split(":")
            data = json.dumps({"query": QUERY, "documents": documents}).encode()
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                head = f"POST /v1/rerank HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                await stream.send_all(head.encode() + data)

                async def started():
                    m = await metrics(client)
                    return None if m["running"] > 0 and m["steps"] >= before["steps"] + 3 else f"running {m['running']}, steps {m['steps']}"

                await eventually(started, timeout=10, what="the judgements running")
            # the connection is closed: the handler is cancelled, and with it every judgement

            async def over():
                m = await metrics(client)
                return f"running {m['running']}, waiting {m['waiting']}" if m["running"] or m["waiting"] else None

            await eventually(over, timeout=20, what="every judgement cancelled")
            after = await metrics(client)
    assert after["finished"].get("cancelled", 0) >= 1, after["finished"]
    assert after["finished"].get("length", 0) < len(documents), "every judgement ran to its end: the client never left mid-request"


ANSWERS = AnswerIds(yes=(10, 11), no=(20,))


def top(*pairs: tuple[int, float]) -> tuple[tuple[int, float], ...]:
    return tuple(sorted(pairs, key=lambda p: -p[1]))


def test_yes_probability_from_the_listed_answers():
    lp = math.log
    assert yes_probability(top((10, lp(0.6)), (20, lp(0.2)), (5, lp(0.1))), ANSWERS) == pytest.approx(0.75)
    # every spelling of an answer counts
    assert yes_probability(top((10, lp(0.3)), (11, lp(0.3)), (20, lp(0.2)), (5, lp(0.1))), ANSWERS) == pytest.approx(0.75)
    # an answer that is not listed is taken at the last listed logprob, the most it can be
    assert yes_probability(top((10, lp(0.6)), (5, lp(0.2)), (6, lp(0.1))), ANSWERS) == pytest.approx(0.6 / 0.7)
    assert yes_probability(top((20, lp(0.6)), (5, lp(0.2)), (6, lp(0.1))), ANSWERS) == pytest.approx(0.1 / 0.7)
    # neither listed: no evidence either way
    assert yes_probability(top((5, lp(0.6)), (6, lp(0.2))), ANSWERS) == 0.5
    # extremes stay finite and in [0, 1]
    assert yes_probability(top((10, 0.0), (20, -1e6)), ANSWERS) == 1.0
    assert yes_probability(top((20, 0.0), (10, -1e6)), ANSWERS) == 0.0
    assert yes_probability(top((5, 0.0), (10, -math.inf), (20, -math.inf)), ANSWERS) == 0.5


def test_a_template_that_refuses_a_system_message_gets_the_instruction_from_the_user(tiny_checkpoints):
    tokenizer = load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32).tokenizer
    strict = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    )
    ids = judge_prompt_ids(tokenizer, strict, "q?", "d.")
    assert tokenizer.decode(ids) == f"[user] {JUDGE_INSTRUCTION}\n\n<Query>: q?\n<Document>: d.\n[assistant] "
    plain = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    assert tokenizer.decode(judge_prompt_ids(tokenizer, plain, "q?", "d.")) == f"[system] {JUDGE_INSTRUCTION}\n[user] <Query>: q?\n<Document>: d.\n[assistant] "


# --- the real model


def smollm2_settings(method: str) -> ServerSettings:
    settings = ServerSettings(engine=EngineConfig(model="smollm2", max_num_seqs=4))
    return attrs.evolve(settings, host="127.0.0.1", port=0, log_level="warning", rerank_method=method)


@pytest.mark.slow
async def test_real_model_ranks_a_paraphrase_first_and_judges_with_its_own_yes_and_no(nursery):
    query = "Paris is the capital of France."
    documents = ["I like to play football on weekends.", "The capital city of France is Paris.", "The stock market fell sharply today."]
    embedding = await start_server(nursery, smollm2_settings("embedding"))
    yes_no = await start_server(nursery, smollm2_settings("yes-no"))
    with trio.fail_after(240):
        async with httpx.AsyncClient(base_url=embedding, timeout=60.0) as client:
            reply = await post(client, "/v1/rerank", {"query": query, "documents": documents})
        async with httpx.AsyncClient(base_url=yes_no, timeout=60.0) as client:
            judged = await post(client, "/v1/score", {"text_1": query, "text_2": documents})
            alone = await post(client, "/v1/score", {"text_1": query, "text_2": documents[1]})
    assert reply["results"][0]["index"] == 1, reply
    # SmolLM2-135M is no trained judge: only that its tokenizer has both answers, and the numbers are sound
    scores = [d["score"] for d in judged["data"]]
    assert all(0.0 < s < 1.0 for s in scores), scores
    assert alone["data"][0]["score"] == scores[1]
