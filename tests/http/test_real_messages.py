"""Anthropic's Messages API with the real default model (SmolLM2 through the
real HTTP server), read by the Anthropic Python SDK, as issue #29 asks: a
text answer buffered and streamed, count_tokens, a forced tool call
(buffered and streamed) and its tool_result round trip, the prefix cache
in usage. Slow: loads the model."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
import trio

from tests.http.test_real_tools import smollm2_server  # noqa: F401 - the fixture
from tests.http.test_real_tools import QUESTION

pytestmark = pytest.mark.slow

MODEL = "smollm2"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
}
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK's create() has no temperature keyword


async def test_real_messages_text_stream_count_tool_round_trip(smollm2_server):  # noqa: F811
    client = anthropic.Anthropic(base_url=smollm2_server, api_key="x", max_retries=0, timeout=120.0)
    capital = [{"role": "user", "content": "What is the capital of France?"}]
    forced = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}

    def conversation():
        counted = client.messages.count_tokens(model=MODEL, messages=capital)
        said = client.messages.create(model=MODEL, max_tokens=24, messages=capital, **GREEDY)
        with client.messages.stream(model=MODEL, max_tokens=24, messages=capital, **GREEDY) as stream:
            text = "".join(stream.text_stream)
            streamed = stream.get_final_message()
        first = client.messages.create(model=MODEL, max_tokens=64, messages=QUESTION, **forced, **GREEDY)
        with client.messages.stream(model=MODEL, max_tokens=64, messages=QUESTION, **forced, **GREEDY) as stream:
            streamed_call = stream.get_final_message()
        (use,) = first.content
        result = {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}
        history = [*QUESTION, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
        follow = {"model": MODEL, "messages": history, "tools": [WEATHER], "tool_choice": {"type": "none"}}
        answer = client.messages.create(max_tokens=48, **follow, **GREEDY)
        again = client.messages.create(max_tokens=48, **follow, **GREEDY)
        counted_answer = client.messages.count_tokens(**follow)
        return counted, said, text, streamed, first, streamed_call, answer, again, counted_answer

    with trio.fail_after(300):
        counted, said, text, streamed, first, streamed_call, answer, again, counted_answer = await trio.to_thread.run_sync(conversation)

    assert said.type == "message" and said.stop_reason in ("end_turn", "max_tokens")
    (block,) = said.content
    assert block.type == "text" and "paris" in block.text.lower(), block.text
    assert text == streamed.content[0].text == block.text and streamed.stop_reason == said.stop_reason
    assert streamed.usage.output_tokens == said.usage.output_tokens
    # The first request of a fresh server: nothing cached, the whole prompt is input_tokens.
    assert said.usage.cache_read_input_tokens == 0 and said.usage.input_tokens == counted.input_tokens

    (use,) = first.content
    assert first.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert "paris" in use.input["city"].lower(), use.input
    assert streamed_call.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in streamed_call.content] == [("tool_use", "get_weather", use.input)]

    assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text.strip()
    assert again.content[0].text == answer.content[0].text
    assert again.usage.cache_read_input_tokens > 0
    for reply in (answer, again):
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted_answer.input_tokens
