"""chat_template_kwargs (vLLM's and llama.cpp's request field): template
variables a request sets, as Qwen3's {"enable_thinking": false} closes the
thinking block before the reply. Over a real server with a template that
reads them; the prompt's count on /tokenize and on the chat completion
agree; a value's special-token text stays text; the errors a client can
cause name the field."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio

from tests.http.conftest import assert_error, make_settings, start_server
from tests.tiny_model import tiny_weights, train_tiny_tokenizer, write_gguf

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if note is defined %}<|im_start|>system\n{{ note }}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    tok = train_tiny_tokenizer()
    path = tmp_path_factory.mktemp("thinking") / "thinking.gguf"
    return write_gguf(path, tiny_weights(tok.get_vocab_size()), tok, chat_template=TEMPLATE)


async def test_template_variables_reach_the_template(nursery, thinking_model):
    url = await start_server(nursery, make_settings(thinking_model))
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def rendered(kwargs):
                body = {"messages": MESSAGES, "return_token_strs": True, **({"chat_template_kwargs": kwargs} if kwargs is not None else {})}
                got = await client.post("/tokenize", json=body)
                assert got.status_code == 200, got.text
                return got.json()

            plain, thinking_off, thinking_on = await rendered(None), await rendered({"enable_thinking": False}), await rendered({"enable_thinking": True})
            text_off = (await client.post("/detokenize", json={"tokens": thinking_off["tokens"]})).json()["prompt"]
            assert text_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
            assert thinking_on["tokens"] == plain["tokens"] != thinking_off["tokens"]
            chat = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["prompt_tokens"] == thinking_off["count"]

            # A variable's special-token text is the request's: text, never the token.
            noted = await rendered({"note": "<|im_end|>"})
            im_end = plain["tokens"][plain["token_strs"].index("<|im_end|>")]
            # One more <|im_end|> token than without the note: the template's closing one, not the note's text.
            assert noted["tokens"].count(im_end) == plain["tokens"].count(im_end) + 1
            assert noted["count"] > plain["count"] + 4  # the note's own text is there, as several tokens


async def test_bad_template_variables_are_400s_naming_the_field(nursery, thinking_model):
    url = await start_server(nursery, make_settings(thinking_model))
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for kwargs, param, fragment in [
                ([1, 2], "chat_template_kwargs", "expected a JSON object of template variables, got a list"),
                ({"messages": []}, "chat_template_kwargs.messages", "'messages' is set by the server and cannot be given"),
                ({"not a name": 1}, "chat_template_kwargs", "'not a name' is not a template variable name"),
                ({f"v{i}": i for i in range(33)}, "chat_template_kwargs", "at most 32 template variables, got 33"),
            ]:
                response = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": kwargs})
                assert_error(response, 400, param=param, fragment=fragment)
            response = await client.post("/tokenize", json={"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}})
            assert_error(response, 400, param="chat_template_kwargs", fragment="chat_template_kwargs go with messages")
