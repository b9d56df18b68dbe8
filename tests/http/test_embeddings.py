"""`POST /v1/embeddings` end to end (issue #13): a real server on the tiny
random Llama (fp32), and one slow test on the real SmolLM2.

What is checked: OpenAI's response shape, unit vectors of the model's
hidden size, usage; both poolings against a float64 forward of the same
weights written here (mean over the final-normed hidden states, or the last
token's); token ids giving the text's vector; bit-identical vectors alone,
inside a batch of other inputs and while a chat completion streams;
base64 decoding to exactly the float list; the openai SDK's
`embeddings.create`; every bad body a 400 (or 404 for another model) naming
its field; a client that leaves mid-request leaving no request, no KV block
and no prefix-cache entry behind. On SmolLM2: vectors of 576 values, and
two paraphrases closer than an unrelated sentence."""

from __future__ import annotations

import base64
import functools
import json
import math

import attrs
import httpx
import numpy as np
import openai
import pytest
import torch
import trio

from tests.http.conftest import MAX_MODEL_LEN, MODEL_NAME, assert_error, eventually, make_settings, metrics, start_server
from trioserve.config import EngineConfig, ServerSettings
from trioserve.models.checkpoint import Checkpoint, load_checkpoint

TIMEOUT = httpx.Timeout(20.0)
HIDDEN = 64  # the tiny model's hidden size
TEXTS = [
    "the cat sat on the mat and looked at the door",
    "def add(a, b): return a + b",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
    "hi",
]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Checkpoint:
    return load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32)


def ids_of(checkpoint: Checkpoint, text: str) -> list[int]:
    return checkpoint.tokenizer.encode(text, special=False)  # as the route tokenizes input text


def dense_hidden(checkpoint: Checkpoint, ids: list[int]) -> np.ndarray:
    """The final-normed hidden state at every position of ``ids`` from a
    plain float64 Llama over the checkpoint's weights: full causal
    attention, rotate-half RoPE, grouped KV heads repeated."""
    c = checkpoint.config
    w = {k: v.double().numpy() for k, v in checkpoint.weights.items()}
    n, dim = len(ids), c.head_dim

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_eps) * g

    angles = np.arange(n)[:, None] * (1.0 / c.rope_theta ** (np.arange(0, dim, 2) / dim))[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(x):
        a, b = x[..., : dim // 2], x[..., dim // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["model.embed_tokens.weight"][ids]
    future = ~np.tril(np.ones((n, n), dtype=bool))
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, c.num_heads, dim))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, c.num_kv_heads, dim))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, c.num_kv_heads, dim)
        k, v = (np.repeat(t, c.num_heads // c.num_kv_heads, axis=1) for t in (k, v))
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        scores[:, future] = -np.inf
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"])


def expected_vector(checkpoint: Checkpoint, ids: list[int], pooling: str) -> np.ndarray:
    hidden = dense_hidden(checkpoint, ids)
    pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return pooled / np.linalg.norm(pooled)


async def embed(client: httpx.AsyncClient, body: dict) -> dict:
    response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def vectors(reply: dict) -> list[list[float]]:
    assert [d["index"] for d in reply["data"]] == list(range(len(reply["data"])))
    return [d["embedding"] for d in reply["data"]]


async def test_the_response_has_openai_shape_unit_vectors_and_usage(server, checkpoint):
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            reply = await embed(client, {"model": MODEL_NAME, "input": TEXTS, "user": "someone"})
            one = await embed(client, {"input": TEXTS[0], "dimensions": HIDDEN, "encoding_format": "float"})
            nulls = await embed(client, {"input": TEXTS[0], "model": None, "dimensions": None, "encoding_format": None, "user": None})
    assert set(reply) == {"object", "data", "model", "usage"}
    assert reply["object"] == "list" and reply["model"] == MODEL_NAME
    tokens = sum(len(ids_of(checkpoint, t)) for t in TEXTS)
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    for item in reply["data"]:
        assert set(item) == {"object", "index", "embedding"} and item["object"] == "embedding"
        assert len(item["embedding"]) == HIDDEN and all(isinstance(x, float) for x in item["embedding"])
        assert math.isclose(math.fsum(x * x for x in item["embedding"]), 1.0, abs_tol=1e-6)
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(ids_of(checkpoint, TEXTS[0]))
    assert vectors(one)[0] == vectors(reply)[0] == vectors(nulls)[0]
    assert len({tuple(v) for v in vectors(reply)}) == len(TEXTS)  # different texts, different vectors


@pytest.mark.parametrize("pooling", ["mean", "last"])
async def test_pooling_matches_a_float64_forward_and_is_batch_invariant(nursery, tiny_gguf, checkpoint, pooling):
    """Each vector is the pooled float64 reference within fp32 rounding.
    Then one text's vector, bit for bit: alone; at several places in batches
    of other inputs (its prefill cut elsewhere, beside other prompts);
    as token ids; and while a chat completion streams (sharing its steps
    with decode rows). Budget 64 and 4 rows: the batches really are cut up."""
    url = await start_server(nursery, make_settings(tiny_gguf, embedding_pooling=pooling))
    target = TEXTS[2]
    with trio.fail_after(40):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            alone = vectors(await embed(client, {"input": target}))[0]
            batch = vectors(await embed(client, {"input": TEXTS}))
            for got, text in zip(batch, TEXTS, strict=True):
                want = expected_vector(checkpoint, ids_of(checkpoint, text), pooling)
                np.testing.assert_allclose(got, want, rtol=0, atol=2e-5, err_msg=text)
            others = [t * 3 for t in TEXTS if t != target]  # longer prompts, so chunks fall elsewhere
            crowds = [[target, *others], [*others, target], [others[0], target, *others[1:]]]
            seen = [vectors(await embed(client, {"input": crowd}))[crowd.index(target)] for crowd in crowds]
            as_ids = vectors(await embed(client, {"input": [ids_of(checkpoint, target)]}))[0]
            chat = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=chat) as stream:
                lines = stream.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                during = vectors(await embed(client, {"input": [others[0], target]}))[1]
                still_streaming = await metrics(client)
                rest = [line async for line in lines]
    assert still_streaming["running"] == 1, "the chat completion ended before the embedding did"
    assert rest[-2:] == ["data: [DONE]", ""]
    assert batch[2] == alone
    for i, vector in enumerate(seen):
        assert vector == alone, f"crowd {i}"
    assert as_ids == alone
    assert during == alone


async def test_base64_is_the_float_list_as_little_endian_float32(server):
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            floats = vectors(await embed(client, {"input": TEXTS[:2]}))
            packed = vectors(await embed(client, {"input": TEXTS[:2], "encoding_format": "base64"}))
    for text, vector in zip(packed, floats, strict=True):
        assert isinstance(text, str)
        decoded = np.frombuffer(base64.b64decode(text), dtype="<f4")
        assert decoded.tolist() == vector


async def test_the_openai_sdk_embeds(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=20.0)

    def create(**kwargs):
        return client.embeddings.create(model=MODEL_NAME, input=TEXTS[:3], **kwargs)

    with trio.fail_after(30):
        sent_base64 = await trio.to_thread.run_sync(create)  # the SDK asks for base64 and decodes it
        sent_float = await trio.to_thread.run_sync(functools.partial(create, encoding_format="float"))
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as raw:
            plain = vectors(await embed(raw, {"input": TEXTS[:3]}))
    client.close()
    for reply in (sent_base64, sent_float):
        assert reply.model == MODEL_NAME and reply.object == "list"
        assert [list(d.embedding) for d in reply.data] == plain
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0


TOO_LONG = "x" * (MAX_MODEL_LEN + 10)  # one token per character in the tiny tokenizer
BAD = [
    # (body, status, message fragment, param)
    ([1, 2], 400, "the request body must be a JSON object", None),
    ({}, 400, "input: this field is required", "input"),
    ({"input": None}, 400, "input: expected a string, a list of strings, a list of token ids or a list of lists of token ids, got null", "input"),
    ({"input": 5}, 400, "input: expected a string, a list of strings, a list of token ids or a list of lists of token ids, got 5", "input"),
    ({"input": ""}, 400, "input: must not be empty", "input"),
    ({"input": []}, 400, "input: must not be empty", "input"),
    ({"input": ["a", ""]}, 400, "input[1]: must not be empty", "input[1]"),
    ({"input": ["a", 3]}, 400, "input[1]: expected a string like input[0], got 3", "input[1]"),
    ({"input": [5, "a"]}, 400, "input[1]: expected a token id (a whole number of at least 0), got the string 'a'", "input[1]"),
    ({"input": [5, -1]}, 400, "input[1]: expected a token id (a whole number of at least 0), got -1", "input[1]"),
    ({"input": [5, True]}, 400, "input[1]: expected a token id (a whole number of at least 0), got true", "input[1]"),
    ({"input": [[5], 6]}, 400, "input[1]: expected a list of token ids like input[0], got 6", "input[1]"),
    ({"input": [[5], []]}, 400, "input[1]: must not be empty", "input[1]"),
    ({"input": [[5], [6, 2.5]]}, 400, "input[1][1]: expected a token id (a whole number of at least 0), got 2.5", "input[1][1]"),
    ({"input": [{"text": "a"}]}, 400, "input[0]: expected a string, a token id or a list of token ids, got an object", "input[0]"),
    ({"input": [5, 360]}, 400, "input[1]: token id 360 is outside the vocabulary (0..359)", "input[1]"),
    ({"input": [[5], [6, 7, 99999]]}, 400, "input[1][2]: token id 99999 is outside the vocabulary (0..359)", "input[1][2]"),
    ({"input": TOO_LONG}, 400, f"input: {MAX_MODEL_LEN + 10} tokens, more than the {MAX_MODEL_LEN} this server embeds in one input", "input"),
    ({"input": ["a", TOO_LONG]}, 400, f"input[1]: {MAX_MODEL_LEN + 10} tokens, more than the {MAX_MODEL_LEN}", "input[1]"),
    ({"input": [[5] * (MAX_MODEL_LEN + 1)]}, 400, f"input[0]: {MAX_MODEL_LEN + 1} tokens, more than the {MAX_MODEL_LEN}", "input[0]"),
    ({"input": ["a"] * 2049}, 400, "input: at most 2048 inputs are allowed in one request, got 2049", "input"),
    ({"input": ["a", "b\ud800"]}, 400, "input[1]: the text contains a lone UTF-16 surrogate (\\ud800)", "input[1]"),
    ({"input": "a", "encoding_format": 5}, 400, "encoding_format: must be one of 'float', 'base64', got 5", "encoding_format"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format: must be one of 'float', 'base64', got the string 'int8'", "encoding_format"),
    ({"input": "a", "dimensions": 16}, 400, f"dimensions: this model's embeddings have {HIDDEN} dimensions and cannot be shortened; send {HIDDEN} or leave it out (got 16)", "dimensions"),
    ({"input": "a", "dimensions": "64"}, 400, "dimensions: expected an integer, got the string '64'", "dimensions"),
    ({"input": "a", "user": 7}, 400, "user: expected a string, got 7", "user"),
    ({"input": "a", "model": 7}, 400, "model: expected a string, got 7", "model"),
    ({"input": "a", "model": "other"}, 404, "the model 'other' does not exist", "model"),
]  # fmt: skip


async def test_every_bad_body_is_refused_naming_its_field(server):
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            for body, status, fragment, param in BAD:
                raw = json.dumps(body).encode()  # ASCII: a lone surrogate travels escaped, as JSON allows
                response = await client.post("/v1/embeddings", content=raw, headers={"Content-Type": "application/json"})
                try:
                    assert_error(response, status, fragment=fragment, param=param)
                except AssertionError as exc:
                    raise AssertionError(f"body {json.dumps(body)[:120]}: {exc}") from None
            bad_json = await client.post("/v1/embeddings", content=b"{", headers={"Content-Type": "application/json"})
            after = await metrics(client)
    assert_error(bad_json, 400, fragment="the request body is not valid JSON", param=None)
    assert after["running"] == after["waiting"] == after["kv_blocks_used"] == 0
    assert after["finished"] == {}, "a refused body reached the engine"


async def test_a_request_keeps_no_more_inputs_in_the_engine_than_it_may_queue(nursery, tiny_gguf):
    """--max-queue 1: twelve inputs submitted at once would be a 429; a
    request keeps one in the engine at a time (min(--max-num-seqs, --max-queue))."""
    url = await start_server(nursery, make_settings(tiny_gguf, max_num_seqs=2, max_queue=1))
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            reply = await embed(client, {"input": [f"{t} {i}" for i in range(3) for t in TEXTS]})
            after = await metrics(client)
    assert len(reply["data"]) == 3 * len(TEXTS)
    assert after["finished"] == {"stop": 3 * len(TEXTS)} and after["kv_blocks_used"] == 0


async def test_a_client_that_leaves_cancels_every_input_and_frees_every_block(nursery, tiny_gguf, slow_steps):
    """32 inputs of ~200 tokens at 64 prompt tokens a step take about 100
    slowed steps; the client leaves after the first ones ran."""
    slow_steps(0.03)
    url = await start_server(nursery, make_settings(tiny_gguf))
    inputs = [[3 + (i * 7 + j) % 350 for j in range(200)] for i in range(32)]
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            before = await metrics(client)
            host, port = url.removeprefix("http://").split(":")
            data = json.dumps({"input": inputs}).encode()
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                head = f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                await stream.send_all(head.encode() + data)

                async def started():
                    m = await metrics(client)
                    return None if m["running"] > 0 and m["steps"] >= before["steps"] + 3 else f"running {m['running']}, steps {m['steps']}"

                await eventually(started, timeout=10, what="the embedding inputs running")
                during = await metrics(client)
                assert during["kv_blocks_used"] > 0, during
            # the connection is closed: the handler is cancelled, and with it every input

            async def freed():
                m = await metrics(client)
                if m["running"] or m["waiting"] or m["kv_blocks_used"]:
                    return f"running {m['running']}, waiting {m['waiting']}, kv_blocks_used {m['kv_blocks_used']}"
                return None

            await eventually(freed, timeout=30, what="every input cancelled and its blocks freed")
            after = await metrics(client)
    assert after["finished"].get("cancelled", 0) >= 1, after["finished"]
    assert after["finished"].get("stop", 0) < len(inputs), "every input ran to its end: the client never left mid-request"
    assert after["prefix_cache"]["cached_blocks"] == before["prefix_cache"]["cached_blocks"] == 0


@pytest.fixture
async def smollm2_server(nursery) -> str:
    settings = attrs.evolve(ServerSettings(engine=EngineConfig(model="smollm2", max_num_seqs=4)), host="127.0.0.1", port=0, log_level="warning")
    return await start_server(nursery, settings)


@pytest.mark.slow
async def test_real_model_paraphrases_are_closer_than_an_unrelated_sentence(smollm2_server):
    pairs = [
        ("The cat sat on the mat.", "A cat was sitting on the rug.", "The stock market fell sharply today."),
        ("Paris is the capital of France.", "The capital city of France is Paris.", "I like to play football on weekends."),
    ]
    with trio.fail_after(120):
        async with httpx.AsyncClient(base_url=smollm2_server, timeout=60.0) as client:
            replies = [vectors(await embed(client, {"input": list(triple)})) for triple in pairs]
    for (a, b, c), triple in zip(replies, pairs, strict=True):
        assert len(a) == len(b) == len(c) == 576
        near, far = np.dot(a, b), max(np.dot(a, c), np.dot(b, c))
        assert near > far + 0.05, (triple, near, far)
