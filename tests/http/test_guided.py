"""Guided decoding and forced tool calls through the real server with the
tiny random model (whose free output is noise, so everything valid below is
the constraint's doing): JSON schemas at temperature 1, regexes, choices,
json_object, grammars; forced calls, buffered and streamed, in chat and in a
session; a call cut by max_tokens; and the 400s for bad constraints."""

from __future__ import annotations

import json
import re
import time

import attrs
import httpx
import jsonschema
import pytest
import trio

from tests.http.conftest import LONG_CONTEXT, assert_error, kv_bytes, make_settings, read_sse, start_server
from tests.http.test_sessions import TIMEOUT, create

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
            "required": ["city", "tags"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "owner"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
async def server(nursery, tiny_gguf_long) -> str:
    """A tool list renders to ~500 tiny-tokenizer tokens: the long-context copy."""
    return await start_server(nursery, make_settings(tiny_gguf_long, kv_cache_bytes=kv_bytes(4 * LONG_CONTEXT)))


async def chat(client, **body) -> dict:
    response = await client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_twenty_samples_at_temperature_one_all_match_the_schema(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    with trio.fail_after(120):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            bodies = [await chat(client, response_format=fmt, temperature=1.0, max_tokens=150, n=10, seed=s) for s in (1, 2)]
    outputs = [c for b in bodies for c in b["choices"]]
    assert len(outputs) == 20
    for choice in outputs:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert len({c["message"]["content"] for c in outputs}) > 10  # sampled, not one answer repeated


async def test_regex_choice_json_object_and_grammar_are_obeyed_streamed_and_buffered(server):
    with trio.fail_after(120):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            regex = await chat(client, guided_regex=r"[A-Z]{2}-\d{4}", temperature=1.0, seed=3, max_tokens=20)
            assert re.fullmatch(r"[A-Z]{2}-\d{4}", regex["choices"][0]["message"]["content"])
            choice = await chat(client, guided_choice=["sunny", "rainy", "partly cloudy"], temperature=1.0, seed=4, max_tokens=20)
            assert choice["choices"][0]["message"]["content"] in ("sunny", "rainy", "partly cloudy")
            grammar = 'start: "forecast: " day ("," day)*\nday: "mon" | "tue" | "wed"'
            text = (await client.post("/v1/completions", json={"prompt": "Week:", "guided_grammar": grammar, "max_tokens": 30, "temperature": 1.0, "seed": 5})).json()
            assert re.fullmatch(r"forecast: (mon|tue|wed)(,(mon|tue|wed))*", text["choices"][0]["text"]), text
            body = {"messages": ASK, "response_format": {"type": "json_object"}, "max_tokens": 60, "temperature": 0, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                sse = await read_sse(response)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse.chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in sse.chunks if c["choices"]][-1]
    if finish == "stop":  # with greedy noise a JSON object may also run to max_tokens; a finished one must parse
        assert isinstance(json.loads(streamed), dict)
    else:
        assert finish == "length" and streamed.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_call_is_valid_and_parsed(server, stream):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 1.0, "seed": 11, "max_tokens": 200}
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            if not stream:
                choice = (await chat(client, **{k: v for k, v in body.items() if k != "messages"}))["choices"][0]
                calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
                assert choice["message"]["content"] is None
            else:
                async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                    sse = await read_sse(response)
                deltas = [c["choices"][0]["delta"] for c in sse.chunks if c["choices"]]
                calls = [call for d in deltas for call in d.get("tool_calls") or []]
                assert all(not d.get("content") for d in deltas)  # nothing leaks as text
                # OpenAI's shapes: a forced reply's role chunk and each call's chunk carry content null.
                assert deltas[0] == {"role": "assistant", "content": None}
                assert all(d["content"] is None for d in deltas if "tool_calls" in d)
                finish = [c["choices"][0]["finish_reason"] for c in sse.chunks if c["choices"]][-1]
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])


async def test_required_picks_one_of_the_tools_and_a_cut_call_stays_length(server):
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            body = await chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=2, max_tokens=200)
            call = body["choices"][0]["message"]["tool_calls"][0]["function"]
            schema = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]["function"]["parameters"]
            jsonschema.validate(json.loads(call["arguments"]), schema)
            cut = await chat(client, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=20)
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"] and choice["message"]["content"].startswith("<tool_call>")


async def test_a_session_keeps_a_forced_call_and_the_tool_result(server):
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            sid = await create(client, tools=[WEATHER], temperature=0, max_tokens=200)
            first = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": ASK, "tool_choice": "required"})
            assert first.status_code == 200, first.text
            call = first.json()["choices"][0]["message"]["tool_calls"][0]
            result = {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'}
            second = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [result], "max_tokens": 5, "tool_choice": "none"})
            assert second.status_code == 200, second.text
            history = (await client.get(f"/v1/sessions/{sid}")).json()["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    assert history[1]["tool_calls"] == [call] and history[2] == result
    assert second.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("extra", "status", "fragment", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, 400, "invalid JSON schema", "response_format.json_schema.schema"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, 400, "Unimplemented keys", "guided_json"),
        ({"guided_regex": "(unclosed"}, 400, "invalid regular expression", "guided_regex"),
        ({"guided_grammar": "start: missing_rule"}, 400, "invalid grammar", "guided_grammar"),
        ({"guided_choice": ["a", ""]}, 400, "expected a non-empty string", "guided_choice[1]"),
    ],
)
async def test_bad_constraints_are_400_naming_the_field(server, extra, status, fragment, param):
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        response = await client.post("/v1/chat/completions", json={"messages": ASK, **extra})
        assert_error(response, status, fragment=fragment, param=param)
        sid = await create(client)
        turn = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": ASK, **extra})
        assert_error(turn, status, fragment=fragment, param=param)
        assert (await client.get(f"/v1/sessions/{sid}")).json()["busy"] is False


BLOWN = "(a{1000}){1000}"  # compiles, then llguidance's lexer gives up on the first token (issue #49: was a 500 with its state dump)


async def test_a_constraint_that_breaks_down_while_generating_is_400_naming_the_field(server):
    want = "guided_regex: the output constraint failed while generating: lexer error: too many expressions constructed"
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Say a:"})):
            response = await client.post(path, json={**body, "guided_regex": BLOWN, "max_tokens": 4})
            error = assert_error(response, 400, fragment=want, param="guided_regex")
            assert "<state>" not in error["message"] and "\n" not in error["message"]
            async with client.stream("POST", path, json={**body, "guided_regex": BLOWN, "max_tokens": 4, "stream": True}) as streamed:
                sse = await read_sse(streamed)
            (event,) = [c for c in sse.chunks if "error" in c]
            assert event["error"]["message"] == want and event["error"]["param"] == "guided_regex", event
        # The server is fine afterwards.
        assert (await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_goes_to_its_own_field_even_with_markers_split_across_tokens(nursery, tiny_gguf, stream):
    """The tiny tokenizer spells <think> in several tokens; a regex makes the
    noise model write reasoning, then an answer. Usage counts the reasoning's
    tokens: some, and fewer than all (the answer's are not)."""
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), reasoning_parser="on"))
    body = {"messages": ASK, "guided_regex": r"<think>[a-z ]{3,12}</think>(sunny|rainy)", "temperature": 1.0, "seed": 8, "max_tokens": 60}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        if stream:
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
                sse = await read_sse(response)
            usage = sse.chunks[-1]["usage"]
            deltas = [c["choices"][0]["delta"] for c in sse.chunks if c["choices"]]
            reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
            content = "".join(d.get("content") or "" for d in deltas)
            assert not any("reasoning_content" in d and "content" in d for d in deltas)
        else:
            reply = await chat(client, **{k: v for k, v in body.items() if k != "messages"})
            message, usage = reply["choices"][0]["message"], reply["usage"]
            reasoning, content = message["reasoning_content"], message["content"]
    assert re.fullmatch(r"[a-z ]{3,12}", reasoning), reasoning
    assert content in ("sunny", "rainy")
    thought = usage["completion_tokens_details"]["reasoning_tokens"]
    # "<think>" + 3-12 letters + "</think>": at least 3 tokens; the answer's 1-5 letters take 1-5 tokens.
    assert thought >= 3 and 1 <= usage["completion_tokens"] - thought <= len(content), usage


async def test_the_openai_client_reads_tool_calls_and_constrained_output(server):
    """The official client parses our tool calls (buffered and streamed) and
    sends response_format and the guided_* extensions (extra_body)."""
    from tests.http.test_server import call, sync_client

    client = sync_client(server)
    with trio.fail_after(60):
        forced = await call(
            client.chat.completions.create, model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=200
        )
        (tool_call,) = forced.choices[0].message.tool_calls
        assert forced.choices[0].finish_reason == "tool_calls" and tool_call.function.name == "get_weather"
        jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER["function"]["parameters"])

        def streamed():
            with client.chat.completions.create(
                model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=200, stream=True
            ) as stream:
                return list(stream)

        chunks = await call(streamed)
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert [(d.index, d.id, d.function.name, d.function.arguments) for d in deltas] == [
            (0, deltas[0].id, "get_weather", tool_call.function.arguments)
        ]
        fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
        pet = await call(client.chat.completions.create, model="tiny", messages=ASK, response_format=fmt, temperature=0, max_tokens=150)
        jsonschema.validate(json.loads(pet.choices[0].message.content), SCHEMA)
        picked = await call(client.chat.completions.create, model="tiny", messages=ASK, extra_body={"guided_choice": ["left", "right"]}, max_tokens=10)
        assert picked.choices[0].message.content in ("left", "right")


@pytest.mark.parametrize(("parallel", "names"), [(True, ["get_time", "get_weather"]), (False, ["get_time"])])
async def test_calls_the_model_writes_by_itself_are_parsed_and_parallel_false_keeps_one(server, parallel, names):
    """tool_choice auto: a regex stands in for a model that writes two calls."""
    two = r'<tool_call>\{"name":"get_time","arguments":\{"zone":"utc"\}\}</tool_call>\n<tool_call>\{"name":"get_weather","arguments":\{"city":"Oslo","unit":"celsius"\}\}</tool_call>'
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        body = await chat(client, tools=[WEATHER, TIME], guided_regex=two, parallel_tool_calls=parallel, max_tokens=300, temperature=0)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"zone": "utc"}
    assert choice["message"]["content"] is None


async def test_a_client_leaving_while_a_turn_is_set_up_leaves_the_session_free(server, monkeypatch):
    """Compiling a constraint takes a while (here: a second); the client
    leaves meanwhile. The turn never started, so the session is not busy."""
    from trioserve.models import guided

    real = guided.GuideCompiler.guides

    def slow(self, spec, count):
        time.sleep(1.0)
        return real(self, spec, count)

    monkeypatch.setattr(guided.GuideCompiler, "guides", slow)
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        sid = await create(client, max_tokens=5)
        with trio.move_on_after(0.3):
            async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as leaving:
                await leaving.post(f"/v1/sessions/{sid}/turns", json={"messages": ASK, "stream": True, "guided_choice": ["a", "b"]})
        with trio.fail_after(10):
            while (await client.get(f"/v1/sessions/{sid}")).json()["busy"]:
                await trio.sleep(0.05)
        monkeypatch.setattr(guided.GuideCompiler, "guides", real)
        after = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": ASK})
        assert after.status_code == 200, after.text
        sessions = (await client.get("/metrics")).json()["sessions"]
    assert (sessions["turns_cancelled"], sessions["turns_committed"]) == (1, 1)


async def test_a_turn_replaces_the_sessions_constraint_and_bad_messages_are_400(server):
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        sid = await create(client, guided_choice=["red", "blue"], max_tokens=10)
        first = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": ASK})
        assert first.json()["choices"][0]["message"]["content"] in ("red", "blue")
        other = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": ASK, "guided_regex": "[0-9]{3}"})
        assert other.status_code == 200, other.text
        assert re.fullmatch("[0-9]{3}", other.json()["choices"][0]["message"]["content"])
        for bad in (5, True, "hello"):
            response = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": bad})
            assert_error(response, 400, fragment="messages", param="messages")


async def test_forced_calls_keep_each_tools_definitions_and_bad_parameters_name_the_tool(server):
    """Parameters with $defs (what openai.pydantic_function_tool makes for a
    nested model) still compile when the call is forced; a parameters schema
    that cannot is a 400 naming that tool; a non-object one is refused."""
    located = {
        "type": "function",
        "function": {
            "name": "place",
            "parameters": {
                "$defs": {"Loc": {"type": "object", "properties": {"lat": {"type": "integer"}, "lon": {"type": "integer"}}, "required": ["lat", "lon"], "additionalProperties": False}},
                "type": "object",
                "properties": {"where": {"$ref": "#/$defs/Loc"}},
                "required": ["where"],
                "additionalProperties": False,
            },
        },
    }
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object", "properties": {"x": {"type": "foo"}}}}}
    stringly = {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        body = await chat(client, tools=[WEATHER, located], tool_choice={"type": "function", "function": {"name": "place"}}, temperature=1.0, seed=6, max_tokens=200)
        call = body["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "place"
        jsonschema.validate(json.loads(call["arguments"]), located["function"]["parameters"])
        bad = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER, broken], "tool_choice": "required"})
        assert_error(bad, 400, fragment="tools[1].function.parameters: invalid parameters schema", param="tools[1].function.parameters")
        wrong = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [stringly]})
        assert_error(wrong, 400, fragment="must be a JSON schema of an object (type 'object'), got type the string 'string'", param="tools[0].function.parameters")


OPEN = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}}}
BARE = {"type": "function", "function": {"name": "ping"}}


def _pushing_to_more_keys() -> dict[str, int]:
    """logit_bias toward every token holding a comma or a quote: under an
    open object schema the call then keeps adding keys until max_tokens."""
    from tests.tiny_tokenizer import train_tiny_tokenizer

    vocab = train_tiny_tokenizer().get_vocab(with_added_tokens=True)
    return {str(i): 10 for piece, i in vocab.items() if "," in piece or '"' in piece}


def test_call_schemas_close_every_object_that_does_not_say():
    """A missing additionalProperties becomes false (nested objects, array
    items and definitions too); an explicit value is kept; allOf branches
    stay open."""
    from trioserve.http.tools import closed

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "list": {"type": "array", "items": {"type": "object", "properties": {"c": {"type": "integer"}}}},
            "free": {"type": "object", "additionalProperties": True},
            "both": {"allOf": [{"type": "object", "properties": {"x": {}}}, {"properties": {"y": {}}}]},
            "ref": {"$ref": "#/$defs/Thing"},
        },
        "$defs": {"Thing": {"type": "object", "properties": {"t": {"type": "string"}}}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["properties"]["free"]["additionalProperties"] is True
    assert "additionalProperties" not in out["properties"]["both"]["allOf"][0]
    assert out["$defs"]["Thing"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["properties"]["a"]  # a copy


@pytest.mark.parametrize("tool", [OPEN, BARE], ids=["no-additionalProperties", "no-parameters"])
async def test_a_forced_call_to_an_open_schema_closes_with_only_its_keys(server, tool):
    """langchain's default tools (no additionalProperties) and tools with no
    parameters: the forced call ends as a call, with no key the schema does
    not name, well before max_tokens, for several seeds, even with every
    comma and quote pushed up (an open object would take keys forever)."""
    name = tool["function"]["name"]
    bias = _pushing_to_more_keys()
    with trio.fail_after(120):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            for seed in range(4):
                body = await chat(
                    client, tools=[tool], tool_choice={"type": "function", "function": {"name": name}}, temperature=1.0, seed=seed, max_tokens=120, logit_bias=bias
                )
                choice = body["choices"][0]
                assert choice["finish_reason"] == "tool_calls", choice
                assert body["usage"]["completion_tokens"] < 120
                call = choice["message"]["tool_calls"][0]["function"]
                arguments = json.loads(call["arguments"])
                assert call["name"] == name
                if tool is BARE:
                    assert arguments == {}
                else:
                    assert set(arguments) == {"q"}


def _bias_toward(character: str) -> dict[str, int]:
    """logit_bias toward every tiny-tokenizer token that starts with ``character``."""
    from tests.tiny_tokenizer import train_tiny_tokenizer

    vocab = train_tiny_tokenizer().get_vocab(with_added_tokens=True)
    return {str(i): 10 for piece, i in vocab.items() if piece.startswith(character)}


async def test_tools_with_a_response_format_under_auto_may_call_or_answer_in_the_format(server):
    """tool_choice auto with response_format json_schema: the reply is either
    a call with valid arguments or a reply matching the schema. Pushed
    toward '<' the model calls (it could not, when the format constrained
    the whole reply); pushed toward '{' it answers in the format."""
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    with trio.fail_after(120):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            calls = await chat(client, tools=[WEATHER], response_format=fmt, temperature=1.0, seed=3, max_tokens=200, logit_bias=_bias_toward("<"))
            words = await chat(client, tools=[WEATHER], response_format=fmt, temperature=1.0, seed=3, max_tokens=300, logit_bias=_bias_toward("{"))
            either = [await chat(client, tools=[WEATHER], response_format=fmt, temperature=1.0, seed=seed, max_tokens=300) for seed in range(4)]
    call_choice = calls["choices"][0]
    assert call_choice["finish_reason"] == "tool_calls", call_choice
    (call,) = call_choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    for body in [words, *either]:
        choice = body["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), WEATHER["function"]["parameters"])
        elif choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        else:
            assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")
    assert words["choices"][0]["finish_reason"] != "tool_calls" and words["choices"][0]["message"]["content"].startswith("{")


async def test_a_forced_call_with_a_response_format_is_a_call(server):
    """OpenAI allows both: the forced call is this reply; the format is for
    replies in words. The guided_* extensions still cannot join a forced call."""
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            body = await chat(client, tools=[WEATHER], tool_choice=forced, response_format=fmt, temperature=1.0, seed=5, max_tokens=200)
            refused = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": forced, "guided_regex": "a+"})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert_error(refused, 400, fragment="cannot be combined with a tool_choice that forces a call", param="guided_regex")


@pytest.mark.parametrize(
    ("reply", "role_content", "n"),
    [
        (r'<tool_call>\{"name":"get_time","arguments":\{"zone":"utc"\}\}</tool_call>', None, 1),
        (r"Sunny in Oslo\.", "", 1),
        (r'<tool_call>\{"name":"get_time","arguments":\{"zone":"utc"\}\}</tool_call>', None, 2),
    ],
    ids=["call", "text", "call-n2"],
)
async def test_under_auto_each_choice_opens_as_openai_does(server, reply, role_content, n):
    """Tools offered under auto: a choice's first chunk is its role chunk,
    sent with its first output: content null before a call, "" before
    text (issue #13); then the call, or the text, follows."""
    body = {"messages": ASK, "tools": [WEATHER, TIME], "guided_regex": reply, "max_tokens": 100, "temperature": 0, "stream": True, "n": n}
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            sse = await read_sse(response)
    for index in range(n):
        deltas = [c["delta"] for c in sse.choice_chunks(index)]
        assert deltas[0] == {"role": "assistant", "content": role_content}, deltas[:2]
        assert all("role" not in d for d in deltas[1:])
        if role_content is None:
            assert deltas[1]["content"] is None and deltas[1]["tool_calls"][0]["function"]["name"] == "get_time"
        else:
            assert "".join(d.get("content") or "" for d in deltas) == "Sunny in Oslo."
