"""The Responses API and openai-agents with the real default model
(SmolLM2 through the real HTTP server), as issue #13 asks: the openai SDK's
responses.create buffered and streamed, a function tool round trip,
text.format json_schema, previous_response_id; and an openai-agents Agent
with one function tool and an output_type, through OpenAIResponsesModel and
OpenAIChatCompletionsModel, run and streamed. Slow: loads the model."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import trio

from tests.http.test_real_tools import smollm2_server  # noqa: F401 - the fixture
from tests.http.test_real_tools import QUESTION

pytestmark = pytest.mark.slow

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
}
REPORT = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "summary": {"type": "string"}},
    "required": ["city", "summary"],
    "additionalProperties": False,
}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120.0)


async def test_real_responses_buffered_streamed_tool_round_trip_and_format(smollm2_server):  # noqa: F811
    client = _client(smollm2_server)

    def conversation():
        said = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=24)
        with client.responses.create(
            model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=24, stream=True
        ) as stream:
            events = list(stream)
        first = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required", temperature=0, max_output_tokens=64)
        (called,) = first.output
        answer = client.responses.create(
            model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=48,
            input=[{"type": "function_call_output", "call_id": called.call_id, "output": json.dumps({"temperature": 21, "sky": "sunny"})}],
        )  # fmt: skip
        # (the same conversation sent whole, below, must give the same prompt and answer)
        result = {"type": "function_call_output", "call_id": called.call_id, "output": json.dumps({"temperature": 21, "sky": "sunny"})}
        call_item = {"type": "function_call", "call_id": called.call_id, "name": called.name, "arguments": called.arguments}
        whole = client.responses.create(
            model=MODEL, input=[*QUESTION, call_item, result], tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=48
        )
        report = client.responses.create(
            model=MODEL, input="Describe Paris in one sentence.", temperature=0, max_output_tokens=96,
            text={"format": {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}},
        )  # fmt: skip
        return said, events, first, called, answer, whole, report

    with trio.fail_after(300):
        said, events, first, called, answer, whole, report = await trio.to_thread.run_sync(conversation)
    assert "paris" in said.output_text.lower(), said.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == said.output_text
    assert events[-1].response.output_text == said.output_text and events[-1].response.usage.output_tokens == said.usage.output_tokens

    assert first.status == "completed" and called.type == "function_call" and called.name == "get_weather"
    assert "paris" in json.loads(called.arguments)["city"].lower()
    assert answer.previous_response_id == first.id and answer.output[0].type == "message" and answer.output_text.strip()
    assert answer.usage.input_tokens == whole.usage.input_tokens and answer.output_text == whole.output_text
    assert answer.usage.input_tokens_details.cached_tokens > 0

    jsonschema.validate(json.loads(report.output_text), REPORT)


async def test_real_openai_agents_run_a_tool_and_validate_the_output_type(smollm2_server):  # noqa: F811
    """An Agent with one function tool and an output_type: the tool runs
    once (the first turn forces it, as agents' tool_choice "required"
    does; it is then switched off, an agents feature, since this small
    model would call it forever), and the final output is a validated
    Report built from the tool's result; through both model classes, run
    and streamed."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    set_tracing_disabled(True)  # nothing may leave this machine

    class Report(BaseModel):
        city: str
        summary: str

    async def run(kind: str, streamed: bool) -> tuple[list[str], object]:
        calls: list[str] = []

        @function_tool(is_enabled=lambda ctx, agent: not calls)
        def get_weather(city: str) -> str:
            """The weather in a city."""
            calls.append(city)
            return f"It is sunny and 21 C in {city}."

        client = openai.AsyncOpenAI(base_url=smollm2_server + "/v1", api_key="x", max_retries=0, timeout=120.0)
        model = OpenAIResponsesModel(MODEL, client) if kind == "responses" else OpenAIChatCompletionsModel(MODEL, client)
        agent = Agent(
            name="weather", instructions="Use the get_weather tool, then report.", tools=[get_weather], output_type=Report, model=model,
            model_settings=ModelSettings(temperature=0, max_tokens=128, tool_choice="required"),
        )  # fmt: skip
        try:
            if streamed:
                result = Runner.run_streamed(agent, "What's the weather in Paris?", max_turns=3)
                async for _ in result.stream_events():
                    pass
            else:
                result = await Runner.run(agent, "What's the weather in Paris?", max_turns=3)
        finally:
            await client.close()
        return calls, result.final_output

    with trio.fail_after(400):
        for kind in ("responses", "chat"):
            for streamed in (False, True):
                calls, final = await trio.to_thread.run_sync(asyncio.run, run(kind, streamed))
                assert calls == ["Paris"], (kind, streamed, calls)
                assert isinstance(final, Report) and final.city == "Paris" and final.summary.strip(), (kind, streamed, final)
