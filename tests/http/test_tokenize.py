"""POST /tokenize, POST /detokenize and GET /tokenizer_info (issue #48,
part 2), through the real server with the tiny model: the ids are the ones
generation uses (a completion's prompt_tokens and echoed tokens, a chat's
prompt_tokens), detokenizing gives the text back, the info names the
special tokens, and every refusal names its field. Behind the API key."""

from __future__ import annotations

import httpx
import pytest

from tests.http.conftest import assert_error, make_settings, start_server
from tests.tiny_tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS
from trioserve.models.checkpoint import load_tokenizer

TIMEOUT = 60
TEXT = "The quick brown fox, 2024 times: déjà vu <|im_end|> again."


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    return load_tokenizer(tiny_checkpoints["gguf_f32"])


async def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


async def test_tokenize_gives_the_ids_a_completion_uses(server, tokenizer):
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        made = await ok(await client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}))
        echoed = await ok(await client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 0}))
        bare = await ok(await client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}))
        back = await ok(await client.post("/detokenize", json={"tokens": bare["tokens"]}))
        info = await ok(await client.get("/tokenizer_info"))
    assert made["count"] == len(made["tokens"]) == echoed["usage"]["prompt_tokens"]
    assert made["token_strs"] == echoed["choices"][0]["logprobs"]["tokens"]
    assert made["max_model_len"] == info["model_max_length"] > 0
    # Special-token text in a text prompt is text, as on /v1/completions (the default server).
    assert EOS_ID not in made["tokens"] and "<|im_end|>" not in made["token_strs"]
    assert bare["token_strs"] is None
    want = tokenizer.encode(TEXT, add_bos=False, special=False)
    assert bare["tokens"] == want and bare["count"] == len(want)
    assert made["tokens"] == tokenizer.encode(TEXT, special=False)  # with the BOS when the model's tokenizer adds one
    assert back == {"prompt": TEXT}


async def test_a_chat_counts_as_chat_completions_render_it(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        made = await ok(await client.post("/tokenize", json={"messages": messages}))
        chat = await ok(await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}))
        back = await ok(await client.post("/detokenize", json={"tokens": made["tokens"]}))
    assert made["count"] == chat["usage"]["prompt_tokens"]
    # The template's special tokens are in the ids and their text in the detokenized prompt.
    assert back["prompt"].count("<|im_start|>") == 3 and "Name a colour." in back["prompt"]
    assert back["prompt"].endswith("<|im_start|>assistant\n")


async def test_tokenizer_info_names_the_special_tokens_and_the_template(server, tokenizer):
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        info = await ok(await client.get("/tokenizer_info"))
        named = await ok(await client.get("/tokenizer_info", params={"model": info["model"]}))
        missing = await client.get("/tokenizer_info", params={"model": "nope"})
    assert info == named
    assert (info["eos_token"], info["eos_token_id"]) == (SPECIAL_TOKENS[EOS_ID], EOS_ID)
    assert (info["bos_token"], info["bos_token_id"]) == (SPECIAL_TOKENS[BOS_ID], BOS_ID)
    assert info["add_bos_token"] == tokenizer.add_bos
    assert info["vocab_size"] == tokenizer.vocab_size
    assert EOS_ID in info["stop_token_ids"]
    assert "<|im_start|>" in info["chat_template"]
    assert_error(missing, 404, fragment="the model 'nope' does not exist", param="model", code="model_not_found")


async def test_refusals_name_the_field(server, tokenizer):
    vocab = tokenizer.vocab_size
    cases = [
        ("/tokenize", {}, "send either prompt (text) or messages (a chat), not both and not neither", "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "not both and not neither", "prompt"),
        ("/tokenize", {"prompt": 5}, "expected a string", "prompt"),
        ("/tokenize", {"messages": []}, "must not be empty", "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True}, "the chat template places the special tokens", "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": False}, "only true is supported", "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "expected true or false", "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, "the model 'nope' does not exist", "model"),
        ("/detokenize", {}, "required", "tokens"),
        ("/detokenize", {"tokens": [1, vocab]}, f"token id {vocab} is outside the vocabulary (0..{vocab - 1})", "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "expected", "tokens"),
    ]
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        for path, body, fragment, param in cases:
            response = await client.post(path, json=body)
            status = 404 if "does not exist" in fragment else 400
            code = "model_not_found" if status == 404 else None
            assert_error(response, status, fragment=fragment, param=param, code=code)
        plain = await client.post("/tokenize", content=b"prompt=a", headers={"Content-Type": "text/plain"})
        assert plain.status_code == 415, plain.text
        wrong_method = await client.get("/tokenize")
        assert wrong_method.status_code == 405, wrong_method.text


async def test_the_tokenizer_routes_want_the_api_key(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf, api_key="sesame"))
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        for method, path, body in (("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}), ("GET", "/tokenizer_info", None)):
            refused = await client.request(method, path, json=body)
            assert_error(refused, 401, fragment="missing or wrong API key", param=None, kind="authentication_error", code="invalid_api_key")
            allowed = await client.request(method, path, json=body, headers={"Authorization": "Bearer sesame"})
            assert allowed.status_code == 200, allowed.text
