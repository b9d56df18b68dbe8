"""What newer OpenAI clients send (issue #13, "shapes"), through the real
server on the tiny model: the `developer` role, JSON null for optional
fields, and /v1/completions with a list of prompts (langchain's `batch()`),
each answered as the plain request would be."""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, read_sse, start_server

TIMEOUT = httpx.Timeout(10.0)


async def _post(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_developer_message_is_a_system_message(server):
    """The same prompt (its tokens counted) and the same greedy answer as
    with "system"; an unknown role is refused by name."""
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            usage, answers = {}, {}
            for role in ("system", "developer"):
                body = {"messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}
                reply = await _post(client, "/v1/chat/completions", body)
                usage[role] = reply["usage"]["prompt_tokens"]
                answers[role] = reply["choices"][0]["message"]["content"]
            alone = (await _post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))["usage"]["prompt_tokens"]
            bad = await client.post("/v1/chat/completions", json={"messages": [{"role": "boss", "content": "x"}]})
    assert usage["system"] == usage["developer"] > alone
    assert answers["system"] == answers["developer"]
    assert_error(bad, 400, fragment="messages[0].role: must be one of 'system', 'developer', 'user', 'assistant', 'tool'", param="messages[0].role")


NULLABLE_CHAT = {
    "n": None, "stream": None, "stream_options": None, "logprobs": None, "top_logprobs": None, "parallel_tool_calls": None,
    "temperature": None, "top_p": None, "presence_penalty": None, "frequency_penalty": None, "stop": None, "seed": None,
    "logit_bias": None, "user": None, "tools": None, "tool_choice": None, "response_format": None, "ignore_eos": None,
    "max_completion_tokens": None,
}  # fmt: skip


async def test_null_means_the_default_for_every_optional_field(server):
    """Each optional field sent as null gives the answer of leaving it out,
    in chat and in completions; a required one as null is still refused."""
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            base = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "count"}], "max_tokens": 8, "temperature": 0}
            plain = await _post(client, "/v1/chat/completions", base)
            nulls = await _post(client, "/v1/chat/completions", {**base, **NULLABLE_CHAT, "temperature": 0})
            assert nulls["choices"][0]["message"] == plain["choices"][0]["message"]
            assert len(nulls["choices"]) == 1 and nulls["choices"][0].get("logprobs") is None
            text = {"model": MODEL_NAME, "prompt": "one two", "max_tokens": 8, "temperature": 0}
            plain_text = await _post(client, "/v1/completions", text)
            null_text = await _post(client, "/v1/completions", {**text, "n": None, "echo": None, "logprobs": None, "stream": None, "stop": None, "suffix": None})
            assert null_text["choices"][0]["text"] == plain_text["choices"][0]["text"]
            refused = await client.post("/v1/chat/completions", json={"messages": None})
    assert_error(refused, 400, fragment="messages: expected a list, got null", param="messages")


async def test_a_list_of_prompts_is_independent_prompts_numbered_as_openai_does(server):
    """prompt: [p0, p1] with n = 2 gives four choices; choice i is choice
    i % 2 of prompt i // 2, the same text as that prompt alone with the same
    seed; usage counts each prompt once. Buffered and streamed."""
    with trio.fail_after(40):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            prompts = ["one two three", "the cat"]
            common = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 2}
            alone = [await _post(client, "/v1/completions", {**common, "prompt": p}) for p in prompts]
            both = await _post(client, "/v1/completions", {**common, "prompt": prompts})
            assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
            for i, choice in enumerate(both["choices"]):
                assert choice["text"] == alone[i // 2]["choices"][i % 2]["text"], i
            assert both["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
            assert both["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
            async with client.stream("POST", "/v1/completions", json={**common, "prompt": prompts, "stream": True, "echo": True}) as response:
                sse = await read_sse(response)
            streamed = {i: "" for i in range(4)}
            for payload in sse.payloads[:-1]:
                for choice in payload["choices"]:
                    streamed[choice["index"]] += choice["text"]
            assert sse.payloads[-1] == "[DONE]"
            for i in range(4):
                assert streamed[i] == prompts[i // 2] + alone[i // 2]["choices"][i % 2]["text"], i
            ids = await _post(client, "/v1/completions", {**common, "n": 1, "prompt": [[5, 6, 7], [8, 9]]})
            assert [c["index"] for c in ids["choices"]] == [0, 1] and ids["usage"]["prompt_tokens"] == 5


async def test_more_prompts_than_the_queue_holds_are_refused_by_name(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf, max_queue=3))
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            response = await client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
            assert_error(response, 400, fragment="2 prompts x n (2) = 4 choices, more than this server queues at once (3", param="prompt")
            ok = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
            assert ok.status_code == 200 and [c["index"] for c in ok.json()["choices"]] == [0, 1, 2]


@pytest.mark.parametrize("prompt", [["a", ""], ["a", 5], [[1, 2], []]], ids=["empty-text", "mixed", "empty-ids"])
async def test_a_bad_prompt_in_a_list_is_named(server, prompt):
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    error = assert_error(response, 400, fragment="prompt[1]", param="prompt[1]")
    assert error["message"].startswith("prompt[1]")


async def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(server):
    """prompt_tokens_details.cached_tokens: 0 for a prompt seen first, then
    the whole blocks of it the prefix cache kept (a real count, buffered and
    streamed, chat and completions)."""
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            body = {"messages": [{"role": "user", "content": "tell me about the sea and the sky " * 3}], "max_tokens": 2}
            first = (await _post(client, "/v1/chat/completions", body))["usage"]
            again = (await _post(client, "/v1/chat/completions", body))["usage"]
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
                sse = await read_sse(response)
            streamed = sse.payloads[-2]["usage"]
            text = {"prompt": "one two three four five six seven eight nine ten eleven twelve", "max_tokens": 2}
            text_first = (await _post(client, "/v1/completions", text))["usage"]
            text_again = (await _post(client, "/v1/completions", text))["usage"]
    block = 4  # the test server's block size (tests/http/conftest.py)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["prompt_tokens"] and cached % block == 0
    assert streamed["prompt_tokens_details"]["cached_tokens"] == cached
    assert text_first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < text_again["prompt_tokens_details"]["cached_tokens"] < text_again["prompt_tokens"]


async def test_a_streamed_line_separator_reaches_a_line_reading_client_whole(server):
    """Text with U+2028, U+2029 or U+0085 in it (a model can generate them;
    here the echoed prompt carries them) is streamed as JSON escapes, so a
    client that reads the stream with httpx's `aiter_lines` (which splits
    where str.splitlines does) still gets each event's one `data:` line,
    and the text comes back the same once parsed."""
    prompt = "one\u2028two\u2029three\x85four"
    with trio.fail_after(40):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "stream": True, "echo": True, "temperature": 0}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                sse = await read_sse(response)
    text = "".join(c["text"] for payload in sse.payloads[:-1] for c in payload["choices"])
    assert text.startswith(prompt), text
