"""Tools in the prompt: the documented fallback for templates that do not
know tools (system paragraph, earlier calls written back, tool results
wrapped), and a template that does know them getting them its own way."""

from __future__ import annotations

import json

from trioserve.http.schemas import parse_chat_request
from trioserve.http.tools import CALL_OPEN, FALLBACK_INTRO, FORCED, FORCED_NAMED, message_dict, render_prompt
from trioserve.models.chat_template import ChatTemplate

CHATML = ChatTemplate(None)
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Forecast.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
BARE = {"type": "function", "function": {"name": "ping"}}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
]


def prompt(template: ChatTemplate, messages, **fields) -> str:
    req = parse_chat_request({"messages": messages, **fields})
    return render_prompt(template, [message_dict(m) for m in req.messages], req.tools, req.tool_choice)


def test_fallback_lists_tools_in_a_new_system_message_and_writes_history_back():
    text = prompt(CHATML, HISTORY, tools=[TOOL, BARE])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n" + FALLBACK_INTRO)
    lines = system.splitlines()
    assert json.loads(lines[2]) == {"name": "get_weather", "description": "Forecast.", "parameters": TOOL["function"]["parameters"]}
    assert json.loads(lines[3]) == {"name": "ping", "parameters": {"type": "object", "properties": {}}}
    assert '<|im_start|>assistant\n<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call><|im_end|>' in text
    assert '<|im_start|>tool\n<tool_response>{"temp": 3}</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_fallback_extends_an_existing_system_message_and_says_when_a_call_is_forced():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = prompt(CHATML, messages, tools=[TOOL], tool_choice="required")
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + FALLBACK_INTRO)
    assert FORCED in text and text.count("<|im_start|>system") == 1
    named = prompt(CHATML, messages, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert FORCED_NAMED.format(name="get_weather") in named


def test_tool_choice_none_shows_no_tools_but_keeps_the_history():
    text = prompt(CHATML, HISTORY, tools=[TOOL], tool_choice="none")
    assert FALLBACK_INTRO not in text and CALL_OPEN in text


def test_a_template_that_knows_tools_gets_them_itself():
    source = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.tool_calls %}[{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}]{% endif %}|{% endfor %}"
    )
    text = prompt(ChatTemplate(source), HISTORY, tools=[TOOL, BARE])
    assert text.startswith("TOOLS:get_weather;ping;|")
    # The template gets the arguments as an object and serializes them itself.
    assert 'assistant:[get_weather({"city": "Oslo"})]' in text and 'tool:{"temp": 3}' in text
    assert FALLBACK_INTRO not in text
