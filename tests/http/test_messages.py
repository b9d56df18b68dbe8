"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages
API, issue #29) through the real server on the tiny model, read by the
Anthropic Python SDK and by a strict reader of the raw events: text
buffered and streamed, the same prompt as the chat it means, stop
sequences, a forced tool call and its tool_result round trip, thinking
blocks, usage and the prefix cache, and every refusal in Anthropic's error
shape naming its field."""

from __future__ import annotations

import functools
import json
import re

import anthropic
import attrs
import httpx
import jsonschema
import pytest
import trio

from tests.http.conftest import LONG_CONTEXT, MAX_MODEL_LEN, MODEL_NAME, eventually, kv_bytes, make_settings, metrics, start_server
from tests.http.test_guided import SCHEMA
from tests.http.test_guided import WEATHER as CHAT_WEATHER
from tests.http.test_server import raw_post

TIMEOUT = httpx.Timeout(30.0)
WEATHER = {"name": "get_weather", "description": CHAT_WEATHER["function"]["description"], "input_schema": CHAT_WEATHER["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
KEY = "sekret"


@pytest.fixture
async def server(nursery, tiny_gguf_long) -> str:
    """A tool list renders to ~500 tiny-tokenizer tokens: the long-context copy."""
    return await start_server(nursery, make_settings(tiny_gguf_long, kv_cache_bytes=kv_bytes(4 * LONG_CONTEXT)))


def sdk(url: str, api_key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=60.0)


async def call(fn, /, *args, **kwargs):
    """A blocking SDK call, in a thread."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


async def post(client: httpx.AsyncClient, path: str, **body) -> dict:
    response = await client.post(path, json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def read_events(response: httpx.Response) -> list[dict]:
    """A Messages stream, strictly: each event is an `event: <type>` line, a
    `data: <json>` line of that type, and a blank line."""
    assert response.status_code == 200, (await response.aread()).decode()[:500]
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line async for line in response.aiter_lines()]
    assert len(lines) % 3 == 0, lines[-3:]
    events = []
    for at in range(0, len(lines), 3):
        head, data, blank = lines[at : at + 3]
        assert head.startswith("event: ") and data.startswith("data: ") and blank == "", lines[at : at + 3]
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == head[len("event: ") :], (head, payload)
        events.append(payload)
    return events


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, fragment: str) -> str:
    """``response`` is Anthropic's error shape with this status, type and message part."""
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text[:500]}"
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert fragment in body["error"]["message"], f"{fragment!r} not in {body['error']['message']!r}"
    return body["error"]["message"]


def text_of(message: dict) -> str:
    return "".join(block["text"] for block in message["content"] if block["type"] == "text")


# --- text


async def test_a_message_is_the_chat_it_means_buffered_and_streamed(server):
    """system + messages render the same prompt as chat's system + user
    messages and give the same greedy text; the stream's events, in
    Anthropic's order with their event lines, build the same message."""
    body = {"system": [{"type": "text", "text": "Be brief."}], "messages": [{"role": "user", "content": "What is two and two?"}], "max_tokens": 24, "temperature": 0}
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            buffered = await post(client, "/v1/messages", **body)
            chat = await post(
                client, "/v1/chat/completions", max_tokens=24, temperature=0,
                messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two and two?"}],
            )  # fmt: skip
            async with client.stream("POST", "/v1/messages", json={"model": MODEL_NAME, **body, "stream": True}) as response:
                events = await read_events(response)
    assert buffered["type"] == "message" and buffered["role"] == "assistant" and buffered["id"].startswith("msg_")
    assert buffered["model"] == MODEL_NAME and buffered["stop_sequence"] is None
    (block,) = buffered["content"]
    assert block == {"type": "text", "text": chat["choices"][0]["message"]["content"]}
    assert buffered["stop_reason"] == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    usage = buffered["usage"]
    assert set(usage) == {"input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"] and usage["cache_creation_input_tokens"] == 0

    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) <= {"content_block_delta"}
    start = events[0]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert events[2] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == block["text"]
    end = events[-2]
    assert end["delta"] == {"stop_reason": buffered["stop_reason"], "stop_sequence": None}
    assert end["usage"]["output_tokens"] == usage["output_tokens"]
    assert end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]


async def test_the_sdk_creates_streams_and_accumulates_the_same_message(server):
    client = sdk(server)
    ask = {"model": MODEL_NAME, "max_tokens": 16, "messages": [{"role": "user", "content": "Hello there"}], "extra_body": {"temperature": 0}}

    def streamed():
        with client.messages.create(**ask, stream=True) as stream:
            raw = list(stream)
        with client.messages.stream(**ask) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        return raw, text, final

    with trio.fail_after(60):
        made = await call(client.messages.create, **ask)
        raw, text, final = await call(streamed)
    assert made.type == "message" and made.content[0].type == "text" and made.stop_reason in ("end_turn", "max_tokens")
    assert [e.type for e in raw][0] == "message_start" and raw[-1].type == "message_stop"
    assert text == made.content[0].text == final.content[0].text
    assert final.stop_reason == made.stop_reason and final.usage.output_tokens == made.usage.output_tokens


async def test_a_stop_sequence_ends_the_reply_and_is_named(server):
    """Greedy text, then the same request stopped at three characters from
    its middle: the reply is the text before them, stop_reason
    stop_sequence, and stop_sequence the one that matched."""
    ask = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40, "temperature": 0}
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            whole = text_of(await post(client, "/v1/messages", **ask))
            at = next(k for k in range(4, len(whole) - 3) if whole.find(whole[k : k + 3]) == k and whole[k : k + 3].strip())
            stop = whole[at : at + 3]
            cut = await post(client, "/v1/messages", **ask, stop_sequences=["never-said", stop])
            async with client.stream("POST", "/v1/messages", json={"model": MODEL_NAME, **ask, "stop_sequences": [stop], "stream": True}) as response:
                events = await read_events(response)
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    assert text_of(cut) == whole[:at]
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


# --- tokens and the prefix cache


async def test_count_tokens_is_the_prompt_input_tokens_reports(server):
    """count_tokens gives the prompt's length; the first message of a new
    conversation reports it all as input_tokens, the same again finds most
    of it in the prefix cache (cache_read_input_tokens), the sum unchanged."""
    body = {"system": "You answer in French.", "messages": [{"role": "user", "content": "Count the sheep in the field, slowly."}], "tools": [WEATHER]}
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            counted = await post(client, "/v1/messages/count_tokens", **body)
            first = await post(client, "/v1/messages", **body, max_tokens=4, temperature=0)
            again = await post(client, "/v1/messages", **body, max_tokens=4, temperature=0)
            forced = {**body, "tool_choice": {"type": "tool", "name": "get_weather"}}
            counted_forced = await post(client, "/v1/messages/count_tokens", **forced)
            made_forced = await post(client, "/v1/messages", **forced, max_tokens=60, temperature=0)
    assert set(counted) == {"input_tokens"} and counted["input_tokens"] > 100
    assert first["usage"]["input_tokens"] == counted["input_tokens"] and first["usage"]["cache_read_input_tokens"] == 0
    assert again["usage"]["cache_read_input_tokens"] > 0
    assert again["usage"]["input_tokens"] + again["usage"]["cache_read_input_tokens"] == counted["input_tokens"]
    # A forced call says so in the prompt: a different count, the one the message reports.
    assert counted_forced["input_tokens"] != counted["input_tokens"]
    used = made_forced["usage"]
    assert used["input_tokens"] + used["cache_read_input_tokens"] == counted_forced["input_tokens"]


# --- tools


async def test_a_forced_tool_call_then_its_result(server):
    """tool_choice tool: a tool_use block whose input is valid against the
    schema, buffered, streamed (input_json_delta) and through the SDK's
    accumulating stream alike; then the tool_result round trip renders the
    prompt chat renders for the same conversation, an error result marked."""
    client = sdk(server)
    ask = {"model": MODEL_NAME, "max_tokens": 200, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}, "extra_body": {"temperature": 0}}

    def conversation():
        made = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        return made, final

    with trio.fail_after(120):
        made, final = await call(conversation)
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as raw:
            body = {key: value for key, value in ask.items() if key != "extra_body"}
            async with raw.stream("POST", "/v1/messages", json={**body, "temperature": 0, "stream": True}) as response:
                events = await read_events(response)
            (use,) = made.content
            history = [*ASK, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]}]
            result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": '{"sky": "sunny"}'}]}
            answer = await post(raw, "/v1/messages", messages=[*history, {"role": "user", "content": [result]}], tools=[WEATHER], max_tokens=8, temperature=0)
            failed = await post(raw, "/v1/messages", messages=[*history, {"role": "user", "content": [{**result, "is_error": True}]}], tools=[WEATHER], max_tokens=8, temperature=0)
            call_message = {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]}
            chat = await post(
                raw, "/v1/chat/completions", max_tokens=8, temperature=0, tools=[CHAT_WEATHER],
                messages=[*ASK, call_message, {"role": "tool", "tool_call_id": use.id, "content": '{"sky": "sunny"}'}],
            )  # fmt: skip
            chat_failed = await post(
                raw, "/v1/chat/completions", max_tokens=8, temperature=0, tools=[CHAT_WEATHER],
                messages=[*ASK, call_message, {"role": "tool", "tool_call_id": use.id, "content": 'Error: {"sky": "sunny"}'}],
            )  # fmt: skip

    assert made.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert final.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", use.input)]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use"] and starts[0]["content_block"]["input"] == {}
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == use.input
    assert events[-2]["delta"]["stop_reason"] == "tool_use"

    for reply, same in ((answer, chat), (failed, chat_failed)):
        assert reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"] == same["usage"]["prompt_tokens"]
        assert text_of(reply) == (same["choices"][0]["message"]["content"] or "")
    assert failed["usage"]["input_tokens"] + failed["usage"]["cache_read_input_tokens"] > answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"]


async def test_tool_choice_any_none_and_one_call_at_a_time(server):
    """any forces some call; none shows no tools (the prompt of no tools);
    disable_parallel_tool_use leaves one call at most."""
    base = {"messages": ASK, "tools": [WEATHER], "max_tokens": 200, "temperature": 0}
    with trio.fail_after(120):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            anyone = await post(client, "/v1/messages", **base, tool_choice={"type": "any", "disable_parallel_tool_use": True})
            none = await post(client, "/v1/messages/count_tokens", **{**base, "tool_choice": {"type": "none"}})
            bare = await post(client, "/v1/messages/count_tokens", messages=ASK)
    assert anyone["stop_reason"] == "tool_use" and [b["type"] for b in anyone["content"]] == ["tool_use"]
    jsonschema.validate(anyone["content"][0]["input"], WEATHER["input_schema"])
    assert none == bare


async def test_output_config_format_constrains_the_reply(server):
    """output_config.format json_schema is chat's response_format: the
    noise model's reply is JSON valid against the schema. metadata.user_id,
    cache_control and service_tier are accepted."""
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            made = await post(
                client, "/v1/messages", messages=ASK, max_tokens=150, temperature=0,
                output_config={"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "low"},
                metadata={"user_id": "u-1"}, cache_control={"type": "ephemeral"}, service_tier="auto",
            )  # fmt: skip
    (block,) = made["content"]
    jsonschema.validate(json.loads(block["text"]), SCHEMA)
    assert made["stop_reason"] == "end_turn"


# --- thinking


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_comes_back_as_a_thinking_block(nursery, tiny_gguf, stream):
    """With the reasoning channel on, <think> text is a thinking block (in
    thinking_delta events, closed by an empty signature), the answer a text
    block after it. A regex (this server's extension) makes the noise model
    write both."""
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), reasoning_parser="on"))
    body = {
        "model": MODEL_NAME, "messages": ASK, "max_tokens": 60, "temperature": 1.0, "seed": 8,
        "thinking": {"type": "enabled", "budget_tokens": 40}, "guided_regex": r"<think>[a-z ]{3,12}</think>(sunny|rainy)",
    }  # fmt: skip
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            if stream:
                async with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
                    events = await read_events(response)
                starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
                assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
                deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
                thought = "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta")
                said = "".join(d["text"] for d in deltas if d["type"] == "text_delta")
                assert {"type": "signature_delta", "signature": ""} in deltas
            else:
                message = await post(client, "/v1/messages", **body)
                thinking, text = message["content"]
                assert thinking["type"] == "thinking" and thinking["signature"] == "" and text["type"] == "text"
                thought, said = thinking["thinking"], text["text"]
    assert re.fullmatch(r"[a-z ]{3,12}", thought), thought
    assert said in ("sunny", "rainy")


async def test_earlier_thinking_and_a_prefill(server):
    """Thinking blocks sent back are dropped (as chat drops earlier
    reasoning); a final assistant message is a prefill, continued: its text
    ends the prompt, where chat would close that turn and open another."""
    said = [{"type": "thinking", "thinking": "hmm", "signature": "x"}, {"type": "text", "text": "Hello!"}]
    turns = [*ASK, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And?"}]
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            kept = await post(client, "/v1/messages/count_tokens", messages=[*ASK, {"role": "assistant", "content": said}, {"role": "user", "content": "And?"}])
            plain = await post(client, "/v1/messages/count_tokens", messages=turns)
            chat = await post(client, "/v1/chat/completions", max_tokens=1, messages=turns)
            prefill = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
            counted = await post(client, "/v1/messages/count_tokens", messages=prefill)
            prefilled = await post(client, "/v1/messages", messages=prefill, max_tokens=6, temperature=0)
            alone = await post(client, "/v1/messages/count_tokens", messages=ASK)
            closed = await post(client, "/v1/chat/completions", max_tokens=1, messages=[*ASK, {"role": "assistant", "content": "It is"}])
    assert kept == plain and plain["input_tokens"] == chat["usage"]["prompt_tokens"]
    usage = prefilled["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted["input_tokens"]
    assert alone["input_tokens"] < counted["input_tokens"] < closed["usage"]["prompt_tokens"]


# --- refusals


BAD_BODIES = [
    ({"messages": ASK}, "max_tokens: this field is required"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": {}}]}]}, "messages[0].content[1].type: 'image' blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type: 'document' blocks are not supported"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role: must be 'user' or 'assistant', got the string 'system' (send a system prompt"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]}, "messages[0].content[0].type: tool_use blocks belong in assistant messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}]}]}, "messages[0].content[0].content[0].type: only text blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "is_error": "yes"}]}]}, "messages[0].content[0].is_error: expected true or false"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "required"}}, "tool_choice.type: must be one of 'auto', 'any', 'tool', 'none'"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}}, "tool_choice.name: no tool named 'get_time' (tools: get_weather)"),
    ({"messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice: 'any' needs tools"),
    ({"messages": ASK, "tools": [{"name": "get_weather"}]}, "tools[0].input_schema: this field is required"),
    ({"messages": ASK, "tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools[0].input_schema: must be a JSON schema of an object"),
    ({"messages": ASK, "tools": [{**WEATHER, "name": "get weather"}]}, "tools[0].name: a function name is 1 to 64"),
    ({"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type: only custom tools"),
    ({"messages": ASK, "system": [{"type": "image"}]}, "system[0].type: only text blocks"),
    ({"messages": ASK, "temperature": 5}, "temperature: must be"),
    ({"messages": ASK, "stop_sequences": ["ok", ""]}, "stop_sequences[1]: stop strings must not be empty"),
    ({"messages": ASK, "metadata": {"user": "me"}}, "metadata.user: unknown field (metadata takes user_id)"),
    ({"messages": ASK, "thinking": {"type": "on"}}, "thinking.type: must be one of"),
    ({"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 99}}, "thinking.budget_tokens: must be less than max_tokens (8)"),
    ({"messages": ASK, "output_config": {"format": {"type": "json_object"}}}, "output_config.format.type: must be 'json_schema'"),
    ({"messages": ASK, "output_config": {"format": {"type": "json_schema", "schema": 3}}}, "output_config.format.schema: expected a JSON schema"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: expected a string or a list of content blocks, got 5"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": []}]}]}, "messages[1].content[0].input: expected an object"),
    ({"messages": ASK, "mcp_servers": [{"url": "x"}]}, "mcp_servers: MCP servers are not supported"),
    ({"messages": ASK, "messsages": []}, "messsages: unknown field"),
    ({"messages": []}, "messages: must hold at least one message"),
    ({"messages": ASK, "max_tokens": 0}, "max_tokens: must be at least 1"),
    ({"messages": ASK, "max_tokens": 100000}, "max_tokens (100000)"),
]


SDK_FIELDS = ("model", "max_tokens", "messages", "system", "tools", "tool_choice", "metadata", "thinking", "stop_sequences")  # its create()'s keywords


@pytest.mark.parametrize(("fields", "fragment"), BAD_BODIES, ids=[f[1].split(":")[0] for f in BAD_BODIES])
async def test_bad_fields_are_refused_naming_them(server, fields, fragment):
    """Each a 400 in Anthropic's shape whose message names the field; the
    SDK raises BadRequestError with that message."""
    required = fragment.startswith("max_tokens: this field is required")
    body = {"model": MODEL_NAME, **({} if required else {"max_tokens": 8}), **fields}
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            assert_anthropic_error(await client.post("/v1/messages", json=body), 400, "invalid_request_error", fragment)
        if required:
            return  # the SDK itself insists on max_tokens
        known = {key: value for key, value in body.items() if key in SDK_FIELDS}
        extra = {key: value for key, value in body.items() if key not in SDK_FIELDS}
        with pytest.raises(anthropic.BadRequestError) as raised:
            await call(sdk(server).messages.create, **known, extra_body=extra)
    assert fragment in str(raised.value) and "invalid_request_error" in str(raised.value)


async def test_errors_made_before_the_route_are_anthropic_shaped_too(server):
    """JSON syntax, a form content type, an unknown model, an unknown route
    under /v1/messages, a wrong method, a bad count_tokens body: each in
    Anthropic's shape with the status the OpenAI routes give."""
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            syntax = await client.post("/v1/messages", content=b'{"max_tokens": 8,', headers={"Content-Type": "application/json"})
            form = await client.post("/v1/messages", content=b"{}", headers={"Content-Type": "text/plain"})
            model = await client.post("/v1/messages", json={"model": "claude-x", "max_tokens": 8, "messages": ASK})
            route = await client.post("/v1/messages/batches", json={})
            method = await client.get("/v1/messages")
            counted = await client.post("/v1/messages/count_tokens", json={"model": MODEL_NAME, "messages": [{"role": "tool", "content": "x"}]})
            chat = await client.post("/v1/chat/completions", json={"model": "claude-x", "messages": ASK})
    assert_anthropic_error(syntax, 400, "invalid_request_error", "the request body is not valid JSON")
    assert_anthropic_error(form, 415, "invalid_request_error", "request bodies must be JSON")
    assert_anthropic_error(model, 404, "not_found_error", "model: the model 'claude-x' does not exist")
    assert_anthropic_error(route, 404, "not_found_error", "no route POST /v1/messages/batches")
    assert_anthropic_error(method, 405, "invalid_request_error", "GET is not allowed on /v1/messages")
    assert_anthropic_error(counted, 400, "invalid_request_error", "messages[0].role: must be 'user' or 'assistant'")
    assert chat.status_code == 404 and set(chat.json()) == {"error"}  # the OpenAI routes keep OpenAI's shape


async def test_the_api_key_may_come_as_x_api_key(nursery, tiny_gguf):
    """With --api-key, x-api-key is the key as Authorization: Bearer is (on
    every /v1 route); a wrong one is a 401 authentication_error, which the
    SDK raises as AuthenticationError; an oversized body a 413
    request_too_large; the CORS preflight allows the header."""
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf, api_key=KEY, max_body_bytes=4096), cors_origins="https://a.example"))
    ask = {"model": MODEL_NAME, "max_tokens": 2, "messages": ASK}
    with trio.fail_after(60):
        made = await call(sdk(url, KEY).messages.create, **ask)
        with pytest.raises(anthropic.AuthenticationError) as wrong:
            await call(sdk(url, "wrong").messages.create, **ask)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            models = await client.get("/v1/models", headers={"x-api-key": KEY})
            missing = await client.post("/v1/messages/count_tokens", json=ask)
            big = await client.post("/v1/messages", json={**ask, "system": "x" * 5000}, headers={"x-api-key": KEY})
            preflight = await client.options("/v1/messages", headers={"Origin": "https://a.example", "Access-Control-Request-Method": "POST"})
    assert made.type == "message" and models.status_code == 200
    assert "missing or wrong API key" in str(wrong.value) and "authentication_error" in str(wrong.value)
    assert_anthropic_error(missing, 401, "authentication_error", "X-Api-Key")
    assert_anthropic_error(big, 413, "request_too_large", "larger than 4096 bytes")
    allowed = preflight.headers["Access-Control-Allow-Headers"].lower()
    assert "x-api-key" in allowed and "anthropic-version" in allowed


async def test_a_full_queue_is_a_429_and_a_client_that_leaves_cancels(nursery, tiny_gguf, slow_steps):
    """One row, one queue place: a streamed message runs, a chat waits, a
    third request is a 429 rate_limit_error with Retry-After (buffered and
    streamed, and the SDK raises RateLimitError); closing the running
    stream's connection cancels its request, and the waiting one then runs."""
    slow_steps(0.004)
    url = await start_server(nursery, make_settings(tiny_gguf, max_num_seqs=1, max_queue=1, kv_cache_bytes=kv_bytes(MAX_MODEL_LEN)))
    ask = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4}
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            waited: dict[str, dict] = {}

            async def wait_in_line():
                waited["chat"] = await post(client, "/v1/chat/completions", messages=ASK, max_tokens=8, ignore_eos=True)

            before = await metrics(client)
            running = await raw_post(url, "/v1/messages", {**ask, "max_tokens": 200, "ignore_eos": True, "stream": True})
            async with trio.open_nursery() as inner:
                async with running:
                    received = b""
                    while b"event: content_block_delta" not in received:
                        data = await running.receive_some()
                        assert data, f"the server closed the stream early: {received[-500:]!r}"
                        received += data
                    assert received.startswith(b"HTTP/1.1 200"), received[:200]
                    inner.start_soon(wait_in_line)

                    async def queued():
                        m = await metrics(client)
                        return None if (m["running"], m["waiting"]) == (1, 1) else f"running {m['running']}, waiting {m['waiting']}"

                    await eventually(queued, timeout=30.0, what="one message running and one chat waiting")
                    for stream in (False, True):
                        refused = await client.post("/v1/messages", json={**ask, "stream": stream})
                        assert_anthropic_error(refused, 429, "rate_limit_error", "at capacity")
                        assert refused.headers.get("Retry-After") == "1"
                    with pytest.raises(anthropic.RateLimitError) as raised:
                        await call(sdk(url).messages.create, **ask)
                # leaving the block closed the connection mid-stream
            after = await metrics(client)
    assert "at capacity" in str(raised.value)
    assert after["finished"].get("cancelled", 0) == before["finished"].get("cancelled", 0) + 1, after["finished"]
    assert after["finished"].get("length", 0) == before["finished"].get("length", 0) + 1  # the chat that waited, not the message
    assert waited["chat"]["choices"][0]["finish_reason"] == "length" and after["running"] == 0
