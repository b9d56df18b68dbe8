"""Tool calling with the real default model (SmolLM2 through the real HTTP
server): a forced call is valid against the function's schema, buffered and
streamed alike; a session keeps the call, takes the tool's result and
answers in words. Slow: loads the model."""

from __future__ import annotations

import json

import attrs
import httpx
import jsonschema
import pytest
import trio

from tests.http.conftest import read_sse, start_server
from tests.http.test_guided import WEATHER
from tests.http.test_sessions import create
from trioserve.config import EngineConfig, ServerSettings

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What's the weather like in Paris today, in celsius?"}]


@pytest.fixture
async def smollm2_server(nursery) -> str:
    settings = attrs.evolve(ServerSettings(engine=EngineConfig(model="smollm2", max_num_seqs=2)), host="127.0.0.1", port=0, log_level="warning")
    return await start_server(nursery, settings)


async def test_real_forced_call_buffered_streamed_and_in_a_session(smollm2_server):
    body = {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_tokens": 64}
    params = WEATHER["function"]["parameters"]
    with trio.fail_after(240):
        async with httpx.AsyncClient(base_url=smollm2_server, timeout=120.0) as client:
            buffered = (await client.post("/v1/chat/completions", json=body)).json()
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                sse = await read_sse(response)

            sid = await create(client, tools=[WEATHER], temperature=0, max_tokens=64)
            first = (await client.post(f"/v1/sessions/{sid}/turns", json={"messages": QUESTION, "tool_choice": "required"})).json()
            call = first["choices"][0]["message"]["tool_calls"][0]
            result = {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature": 21, "sky": "sunny"})}
            answer = (await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [result], "tool_choice": "none"})).json()
            history = (await client.get(f"/v1/sessions/{sid}")).json()["messages"]

    choice = buffered["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (called,) = choice["message"]["tool_calls"]
    assert called["function"]["name"] == "get_weather"
    arguments = json.loads(called["function"]["arguments"])
    jsonschema.validate(arguments, params)
    assert "paris" in arguments["city"].lower()

    streamed = [c for chunk in sse.chunks if chunk["choices"] for c in chunk["choices"][0]["delta"].get("tool_calls") or []]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [("get_weather", called["function"]["arguments"])]
    assert [c["choices"][0]["finish_reason"] for c in sse.chunks if c["choices"]][-1] == "tool_calls"

    assert first["choices"][0]["finish_reason"] == "tool_calls"
    reply = answer["choices"][0]
    assert reply["finish_reason"] in ("stop", "length") and reply["message"]["content"].strip()
    assert "tool_calls" not in reply["message"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    assert history[1]["tool_calls"] == [call] and history[2] == result


LANGCHAIN_STYLE = {  # bind_tools' default: no additionalProperties
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}
NO_PARAMETERS = {"type": "function", "function": {"name": "get_time", "description": "The current time."}}


@pytest.mark.parametrize("tool", [LANGCHAIN_STYLE, NO_PARAMETERS], ids=["no-additionalProperties", "no-parameters"])
async def test_real_forced_call_to_an_open_schema_is_a_well_formed_call(smollm2_server, tool):
    """Issue #13: such a call used to add keys until max_tokens (finish
    length, raw <tool_call> text in content); now it is a call."""
    name = tool["function"]["name"]
    body = {"messages": QUESTION, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": name}}, "temperature": 0, "max_tokens": 96}
    with trio.fail_after(240):
        async with httpx.AsyncClient(base_url=smollm2_server, timeout=120.0) as client:
            reply = (await client.post("/v1/chat/completions", json=body)).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == name
    assert set(arguments) == ({"city"} if tool is LANGCHAIN_STYLE else set())
    assert reply["usage"]["completion_tokens"] < 96
