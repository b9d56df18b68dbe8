"""Qwen3 and Gemma 3 served through the real HTTP server: the greedy
completion is transformers' greedy continuation of the same prompt ids
(read back from /tokenize), and a Gemma 3 session whose history is far past
its 8-token window continues exactly as a stateless request over the whole
history, with its kept KV hit in the prefix cache."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio

from tests.families import SHAPES, build_family
from tests.http.conftest import BLOCK_SIZE, make_settings, metrics, start_server
from tests.http.test_sessions import create, turn

TIMEOUT = 60.0


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family(request, tmp_path_factory):
    built = build_family(tmp_path_factory.mktemp(request.param), request.param, tie=request.param == "gemma3")
    built["name"] = request.param
    return built


def kv_bytes(family: str, tokens: int) -> int:
    s = SHAPES[family]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * 4 * tokens


async def test_greedy_completion_is_transformers_greedy(nursery, family):
    settings = make_settings(family["gguf_f32"], kv_cache_bytes=kv_bytes(family["name"], 1024))
    url = await start_server(nursery, settings)
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            card = (await client.get("/v1/models")).json()["data"][0]
            prompt = "the quick brown fox jumps over"
            ids = (await client.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
            reply = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            text = reply.json()["choices"][0]["text"]
    with torch.no_grad():
        out = family["model"].generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    new = out[0, len(ids) :].tolist()
    assert len(new) == 12
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        expected = (await client.post("/detokenize", json={"tokens": new})).json()["prompt"]
    assert text == expected
    assert card["id"] == "tiny" and card["family"] == family["name"]
    assert "/v1/chat/completions" in card["routes"] and "/v1/embeddings" in card["routes"]


async def test_sliding_window_session_continues_as_stateless_chat(nursery, family):
    if family["name"] != "gemma3":
        pytest.skip("the sliding-window family is gemma3")
    (dog,) = family["tokenizer"].encode(" dog", add_special_tokens=False).ids
    bias = {str(dog): 100.0}  # text that encodes back to the ids the session keeps
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logit_bias": bias}
    settings = make_settings(family["gguf_f32"], kv_cache_bytes=kv_bytes("gemma3", 1024), prefix_cache_max_blocks=1)
    url = await start_server(nursery, settings)
    with trio.fail_after(TIMEOUT * 2):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            sid = await create(client, system="Answer briefly.", **greedy)
            history = [{"role": "system", "content": "Answer briefly."}]
            previous_prompt = 0
            for k, question in enumerate(("first question", "a second one", "now the third")):
                before = (await metrics(client))["prefix_cache"]["hit_tokens"]
                reply = await turn(client, sid, question)
                hit = (await metrics(client))["prefix_cache"]["hit_tokens"] - before
                assert reply["usage"]["prompt_tokens"] > 8 * (k + 1)  # past the window
                # The last turn's prompt stays in the pool (but its last, partly filled block).
                assert hit >= previous_prompt - BLOCK_SIZE, f"turn {k + 1}: {hit} of the last turn's {previous_prompt} prompt tokens hit"
                previous_prompt = reply["usage"]["prompt_tokens"]
                content = reply["choices"][0]["message"]["content"]
                history.append({"role": "user", "content": question})
                stateless = await client.post("/v1/chat/completions", json={"messages": history, **greedy})
                assert stateless.status_code == 200, stateless.text
                assert stateless.json()["choices"][0]["message"]["content"] == content, f"turn {k + 1}"
                history.append({"role": "assistant", "content": content})
