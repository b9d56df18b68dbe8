"""A Llama GGUF with a SentencePiece tokenizer (what Llama 2 and Mistral
files carry: `tokenizer.ggml.model = "llama"`) served through the real
server: its prompts tokenize as llama.cpp's would (models/spm.py), its
chat template's special tokens are ids, a reply streamed token by token is
the buffered reply and the text of its ids (byte-fallback characters
whole), and a completion continuing a prompt keeps its first space."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from tests.http.conftest import make_settings, start_server
from tests.spm_files import llama_like_vocab, spm_metadata
from tests.tiny_model import tiny_weights, write_gguf
from trioserve.models.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    meta = spm_metadata(llama_like_vocab())
    weights = tiny_weights(len(meta["tokenizer.ggml.tokens"]), seed=4)
    path = write_gguf(tmp_path_factory.mktemp("spm") / "llama-spm.gguf", weights, meta, chat_template=TEMPLATE)
    return path, Tokenizer.from_gguf_metadata(meta)


async def stream_text(client, body) -> str:
    text = ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


async def test_a_sentencepiece_llama_serves(nursery, spm_model):
    path, tok = spm_model
    url = await start_server(nursery, make_settings(path))
    prompt = "The café serves crème brûlée 🍮 and"
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            ids = (await client.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
            buffered = (await client.post("/v1/completions", json=body)).json()
            streamed = await stream_text(client, body)
            chat = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi <|im_end|>"}]})
            (the,) = tok.encode("the", add_bos=False)  # "▁the": the prefix space added
            forced = await client.post("/v1/completions", json={**body, "max_tokens": 3, "logit_bias": {str(the): 100}})
    assert ids == tok.encode(prompt)  # llama.cpp's SentencePiece split, BOS first
    assert any(tok.token_bytes(i).startswith(b"\xf0") for i in ids)  # the emoji falls back to bytes
    text = buffered["choices"][0]["text"]
    assert streamed == text and len(text) > 10  # byte-fallback pieces streamed whole, as buffered
    assert forced.json()["choices"][0]["text"] == " the the the"  # a continuation keeps its first space
    rendered = chat.json()["tokens"]
    im_end = tok.encode("<|im_end|>", add_bos=False)
    assert len(im_end) == 1 and rendered.count(im_end[0]) == 1  # the template's, not the user's text
