"""POST /v1/responses (issue #13) through the real server on the tiny model:
the response object and its stream of events, the openai SDK reading both,
a function tool round trip, text.format, stored responses continued by
previous_response_id (and what is not stored), and every refusal naming
the field in the Responses request's own terms."""

from __future__ import annotations

import json

import attrs
import httpx
import jsonschema
import pytest
import trio

from tests.http.conftest import MODEL_NAME, assert_error, kv_bytes, LONG_CONTEXT, make_settings, start_server
from tests.http.raw_client import RawClient
from tests.http.test_guided import ASK, SCHEMA, WEATHER
from tests.http.test_server import call, sync_client
from trioserve.http.responses import OutputItems, as_history
from trioserve.models.output_parser import Delta, ToolCall

TIMEOUT = httpx.Timeout(30.0)
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
SMALL = {"type": "json_schema", "name": "small", "schema": {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"], "additionalProperties": False}}


@pytest.fixture
async def server(nursery, tiny_gguf_long) -> str:
    """A tool list renders to ~500 tiny-tokenizer tokens: the long-context copy."""
    return await start_server(nursery, make_settings(tiny_gguf_long, kv_cache_bytes=kv_bytes(4 * LONG_CONTEXT)))


async def respond(client: httpx.AsyncClient, **body) -> dict:
    response = await client.post("/v1/responses", json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def chat(client: httpx.AsyncClient, **body) -> dict:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


async def read_events(response: httpx.Response) -> list[dict]:
    """A Responses stream, strictly: each event is an `event: <type>` line,
    a `data: <json>` line whose type is the same, and a blank line; the
    sequence numbers count from 0 with no gap."""
    assert response.status_code == 200, (await response.aread()).decode()[:500]
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line async for line in response.aiter_lines()]
    events = []
    while lines and lines[-1] == "":
        lines.pop()
    for at in range(0, len(lines), 3):
        head, data, *blank = lines[at : at + 3]
        assert head.startswith("event: ") and data.startswith("data: "), lines[at : at + 3]
        assert blank in ([], [""]), blank
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == head[len("event: ") :], (head, payload)
        events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def test_a_response_answers_as_the_chat_it_means(server):
    """Instructions are the system message, input the user's: the same
    prompt tokens and the same greedy text as the chat completion; a cut
    reply is incomplete and says why."""
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            body = await respond(client, instructions="Be brief.", input="What is two and two?", max_output_tokens=24, temperature=0)
            plain = await chat(
                client, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two and two?"}],
                max_tokens=24, temperature=0,
            )  # fmt: skip
            cut = await respond(client, input="What is two and two?", max_output_tokens=2, temperature=0)
    reply = plain["choices"][0]
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["model"] == MODEL_NAME
    assert body["instructions"] == "Be brief." and body["max_output_tokens"] == 24 and body["store"] is True
    assert body["error"] is None and body["previous_response_id"] is None
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert message["content"][0]["type"] == "output_text" and message["content"][0]["text"] == reply["message"]["content"]
    expected_status = "incomplete" if reply["finish_reason"] == "length" else "completed"
    assert body["status"] == message["status"] == expected_status
    usage = body["usage"]
    assert usage["input_tokens"] == plain["usage"]["prompt_tokens"] and usage["output_tokens"] == plain["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    details = usage["input_tokens_details"]
    assert details["cached_tokens"] + details["cache_write_tokens"] == usage["input_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["usage"]["output_tokens"] == 2 and cut["output"][0]["status"] == "incomplete"


async def test_a_stream_tells_the_same_response_event_by_event(server):
    """created, in_progress, the message item announced, its text in
    deltas, closed, then completed with the very object a buffered request
    and GET /v1/responses/{id} give (ids aside)."""
    request = {"model": MODEL_NAME, "input": "Tell me a story.", "max_output_tokens": 20, "temperature": 0}
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            async with client.stream("POST", "/v1/responses", json={**request, "stream": True}) as response:
                events = await read_events(response)
            buffered = await respond(client, **request)
            final = events[-1]["response"]
            kept = (await client.get(f"/v1/responses/{final['id']}")).json()
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", f"response.{final['status']}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 and e["content_index"] == 0 for e in deltas)
    text = "".join(e["delta"] for e in deltas)
    assert text == events[-4]["text"] == text_of(final) == text_of(buffered)
    assert final["output"][0]["id"] == item_id and final["status"] == buffered["status"]
    counts = ("input_tokens", "output_tokens", "total_tokens")  # the cached share differs: the second request finds the first's prompt
    assert [final["usage"][k] for k in counts] == [buffered["usage"][k] for k in counts]
    assert kept == final


async def test_the_openai_client_creates_streams_and_accumulates_responses(server):
    """responses.create buffered and with stream=True, and the SDK's own
    accumulating responses.stream(), all read the same text."""
    client = sync_client(server)
    with trio.fail_after(60):
        made = await call(client.responses.create, model=MODEL_NAME, input="Hello there", max_output_tokens=16, temperature=0)

        def streamed():
            with client.responses.create(model=MODEL_NAME, input="Hello there", max_output_tokens=16, temperature=0, stream=True) as stream:
                return list(stream)

        def accumulated():  # the SDK's accumulator needs a response that completes: a short constrained one does
            with client.responses.stream(model=MODEL_NAME, input="Hello there", text={"format": SMALL}, max_output_tokens=16, temperature=0) as stream:
                for _ in stream:
                    pass
                return stream.get_final_response()

        events = await call(streamed)
        whole = await call(accumulated)
    assert made.output_text and made.usage.input_tokens > 0
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == made.output_text
    assert events[-1].type in ("response.completed", "response.incomplete") and events[-1].response.output_text == made.output_text
    assert whole.status == "completed" and json.loads(whole.output_text) == {"a": 1}


async def test_a_function_tool_round_trip_continued_by_previous_response_id(server):
    """A forced call comes back as a function_call item; its output, sent
    with previous_response_id, gets an answer from the very prompt that
    sending the whole conversation again renders (the same input tokens,
    the same greedy text). Streamed, the call is announced, its arguments
    given, and closed."""
    with trio.fail_after(90):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            first = await respond(client, input=ASK, tools=[TOOL], tool_choice="required", temperature=0, max_output_tokens=200)
            (called,) = first["output"]
            assert called["type"] == "function_call" and called["name"] == "get_weather" and called["status"] == "completed"
            jsonschema.validate(json.loads(called["arguments"]), WEATHER["function"]["parameters"])
            assert first["status"] == "completed" and called["call_id"].startswith("call_")
            result = {"type": "function_call_output", "call_id": called["call_id"], "output": json.dumps({"sky": "sunny"})}
            chained = await respond(client, previous_response_id=first["id"], input=[result], tools=[TOOL], temperature=0, max_output_tokens=12)
            call_item = {k: called[k] for k in ("type", "call_id", "name", "arguments")}
            whole = await respond(client, input=[*ASK, call_item, result], tools=[TOOL], temperature=0, max_output_tokens=12)
            async with client.stream(
                "POST", "/v1/responses",
                json={"model": MODEL_NAME, "input": ASK, "tools": [TOOL], "tool_choice": "required", "temperature": 0, "max_output_tokens": 200, "stream": True},
            ) as response:  # fmt: skip
                events = await read_events(response)
    assert chained["previous_response_id"] == first["id"]
    assert chained["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert text_of(chained) == text_of(whole)
    assert chained["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the first response's prompt was cached
    kinds = [e["type"] for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done"]
    assert events[2]["item"]["arguments"] == "" and events[3]["delta"] == events[4]["arguments"] == called["arguments"]
    assert events[5]["item"]["call_id"] == events[2]["item"]["call_id"] == events[-1]["response"]["output"][0]["call_id"]


async def test_the_openai_client_runs_a_tool_round_trip(server):
    """The SDK's own types: a function_call output item, then its result
    sent back as a function_call_output item with previous_response_id."""
    client = sync_client(server)
    with trio.fail_after(60):
        first = await call(client.responses.create, model=MODEL_NAME, input=ASK, tools=[TOOL], tool_choice="required", temperature=0, max_output_tokens=200)
        (item,) = first.output
        assert item.type == "function_call" and item.name == "get_weather"
        answer = await call(
            client.responses.create, model=MODEL_NAME, previous_response_id=first.id, tools=[TOOL], tool_choice="none",
            input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny, 21 C"}], max_output_tokens=8,
        )  # fmt: skip
    assert answer.output[0].type == "message" and answer.output_text


async def test_text_format_json_schema_constrains_the_reply(server):
    """text.format json_schema: the text is JSON valid against the schema,
    buffered and through the SDK; json_object gives a JSON object."""
    fmt = {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}
    client = sync_client(server)
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as http:
            body = await respond(http, input=ASK, text={"format": fmt}, temperature=1.0, seed=4, max_output_tokens=150)
            loose = await respond(http, input=ASK, text={"format": {"type": "json_object"}}, temperature=0, max_output_tokens=100)
        made = await call(client.responses.create, model=MODEL_NAME, input=ASK, text={"format": fmt}, temperature=0, max_output_tokens=150)
    jsonschema.validate(json.loads(text_of(body)), SCHEMA)
    assert body["text"] == {"format": fmt}
    if loose["status"] == "completed":
        assert isinstance(json.loads(text_of(loose)), dict)
    else:  # cut off inside the object
        assert loose["status"] == "incomplete" and text_of(loose).startswith("{")
    jsonschema.validate(json.loads(made.output_text), SCHEMA)


async def test_stored_responses_are_kept_read_and_deleted_and_store_false_keeps_none(server):
    """A stored response can be read back and continued; deleted, or
    answered with store false, it is a 404 naming previous_response_id."""
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            kept = await respond(client, input="one", max_output_tokens=4)
            unkept = await respond(client, input="one", max_output_tokens=4, store=False)
            assert unkept["store"] is False
            read = await client.get(f"/v1/responses/{kept['id']}")
            assert read.status_code == 200 and read.json() == kept
            assert (await client.get(f"/v1/responses/{unkept['id']}")).status_code == 404
            after_unkept = await client.post("/v1/responses", json={"input": "two", "previous_response_id": unkept["id"]})
            deleted = await client.delete(f"/v1/responses/{kept['id']}")
            assert deleted.json() == {"id": kept["id"], "object": "response.deleted", "deleted": True}
            after_delete = await client.post("/v1/responses", json={"input": "two", "previous_response_id": kept["id"]})
            unknown = await client.get("/v1/responses/resp_nothing")
            stored = (await client.get("/metrics")).json()["responses"]
    assert stored == {"active": 0, "evicted": 0}, stored  # one deleted, one never kept
    for response in (after_unkept, after_delete):
        assert_error(response, 404, fragment="no response 'resp_", param="previous_response_id", code="response_not_found")
    assert_error(unknown, 404, fragment="no response 'resp_nothing'", param=None, code="response_not_found")


async def test_a_client_leaving_mid_stream_stores_nothing(server, slow_steps):
    """The commit point is the response's end: a stream cut off before it
    (the client closes its socket after the first text delta) leaves no
    stored response, and the engine drops the request."""
    slow_steps(0.05)
    body = json.dumps({"model": MODEL_NAME, "input": "Tell me a long story.", "max_output_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    with trio.fail_after(30):
        async with await RawClient.connect(server) as raw:
            await raw.send_head("POST", "/v1/responses", {"Content-Type": "application/json"}, body_length=len(body))
            await raw.send_body(body)
            received = b""
            while b"response.output_text.delta" not in received:
                received += await raw.stream.receive_some(65536)
        created = json.loads(received.split(b"data: ", 1)[1].split(b"\n", 1)[0])
        assert created["type"] == "response.created"
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            while (stats := (await client.get("/metrics")).json())["running"] or stats["waiting"]:
                await trio.sleep(0.05)
            gone = await client.get(f"/v1/responses/{created['response']['id']}")
    assert stats["finished"].get("cancelled") == 1, stats["finished"]
    assert_error(gone, 404, fragment="no response", param=None, code="response_not_found")


BAD = [
    ({}, "input: this field is required", "input"),
    ({"input": 5}, "input: expected a string or a list of input items, got 5", "input"),
    ({"input": []}, "input: must hold at least one message", "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type: the string 'web_search_call' items are not supported", "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type: only text parts are supported", "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": [], "text": "hi"}]}]}, "input[0].content[0].type: only text parts are supported", "input[0].content[0].type"),
    ({"input": "x", "max_tokens": 3}, "max_tokens: not a field of the Responses API; send max_output_tokens", "max_tokens"),
    ({"input": "x", "max_completion_tokens": 3}, "max_completion_tokens: not a field of the Responses API; send max_output_tokens", "max_completion_tokens"),
    ({"input": "x", "response_format": {"type": "json_object"}}, "response_format: not a field of the Responses API; send text.format", "response_format"),
    ({"input": "x", "n": 2}, "n: not a field of the Responses API; a response has one output", "n"),
    ({"input": "x", "frobnicate": 1}, "frobnicate: unknown field", "frobnicate"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include: log probabilities are not supported", "include"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role: must be one of 'user', 'assistant', 'system', 'developer'", "input[0].role"),
    ({"input": ["hi", {"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0]: expected an input item", "input[0]"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[1].call_id: expected a string", "input[1].call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type: item references are not supported", "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools[0].type: only function tools are supported", "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name: a function name is 1 to 64 letters", "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters: must be a JSON schema of an object", "tools[0].parameters"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type: only function tools can be chosen", "tool_choice.type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice: 'required' needs tools", "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens: must be at least 1, got 0", "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 100000}, "+ max_output_tokens (100000) = 100017 tokens exceeds the maximum model length", "max_output_tokens"),
    ({"input": "x", "temperature": 9}, "temperature: must be", "temperature"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type: must be one of 'text', 'json_object', 'json_schema'", "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema: expected a JSON schema", "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "foo"}}}}, "text.format.schema: invalid JSON schema", "text.format.schema"),
    ({"input": "x", "background": True}, "background: background responses are not supported", "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation: conversations are not supported", "conversation"),
    ({"input": "x", "truncation": "auto"}, "truncation: only 'disabled' is supported", "truncation"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs: log probabilities are not supported", "top_logprobs"),
    ({"input": "x", "store": "yes"}, "store: expected true or false", "store"),
    ({"input": "x", "instructions": ["a"]}, "instructions: expected a string", "instructions"),
    ({"input": "x", "metadata": {"k": 5}}, "metadata.k: expected a string", "metadata.k"),
    ({"input": "x", "model": "gpt-5"}, "the model 'gpt-5' does not exist", "model"),
    ({"input": "x " * 1200}, "the maximum model length is 1024", "input"),
]


@pytest.mark.parametrize(("body", "fragment", "param"), BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
async def test_bad_requests_are_refused_naming_the_field(server, body, fragment, param):
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        response = await client.post("/v1/responses", json=body)
    status = 404 if param == "model" else 400
    assert_error(response, status, fragment=fragment, param=param)


def test_output_items_follow_the_parsers_pieces_in_order():
    """Reasoning, then text, then a call, then more text: four items, each
    closed before the next opens; whitespace alone opens no message, but a
    reply of nothing at all is one empty message."""
    items = OutputItems()
    events = []
    for delta in (
        Delta(reasoning="let me "), Delta(reasoning="think"), Delta(content="\n"), Delta(content="Sure."),
        Delta(tool_call=ToolCall(0, "call_1", "f", "{}")), Delta(content="\n\n"), Delta(content="Done"),
    ):  # fmt: skip
        events += items.feed(delta)
    events += items.finish("completed")
    assert [item["type"] for item in items.items] == ["reasoning", "message", "function_call", "message"]
    assert items.items[0]["content"] == [{"type": "reasoning_text", "text": "let me think"}]
    assert items.items[1]["content"][0]["text"] == "\nSure." and items.items[3]["content"][0]["text"] == "\n\nDone"
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.delta"]
    assert kinds[4:7] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    # Kept as the conversation sending these items back would make: the
    # call joins the text before it; the text after it is its own message.
    assert as_history(items.as_input()) == [
        {"role": "assistant", "content": "\nSure.", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": "\n\nDone"},
    ]

    only_call = OutputItems()
    only_call.feed(Delta(content=" "))
    only_call.feed(Delta(tool_call=ToolCall(0, "call_2", "f", "{}")))
    only_call.feed(Delta(content="x"))
    only_call.finish("completed")
    assert [item["type"] for item in only_call.items] == ["function_call", "message"]
    assert only_call.items[1]["content"][0]["text"] == "x"  # the space before the call went nowhere
    empty = OutputItems()
    empty.finish("completed")
    assert [(i["type"], i["content"][0]["text"]) for i in empty.items] == [("message", "")]


async def test_the_load_generator_reads_responses_streams_as_chat_ones(server):
    """bench/serve.py --route responses counts the same tokens, from the
    Responses events, as the chat route does (bench/responses.py compares
    the two)."""
    from types import SimpleNamespace

    from bench.serve import run_level

    levels = {}
    with trio.fail_after(60):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            for route in ("chat", "responses"):
                load = SimpleNamespace(api=server + "/v1", seed=0, prompt_tokens=16, max_tokens=6, requests=3, timeout=30.0, route=route)
                levels[route] = await run_level(client, load, MODEL_NAME, "t", 2)
    for route, level in levels.items():
        assert level.errors == 0, (route, [r.error for r in level.results])
        assert [r.output_tokens for r in level.ok] == [6, 6, 6] and all(r.ttft is not None and len(r.gaps) >= 1 for r in level.ok), route
    assert sorted(r.prompt_tokens for r in levels["responses"].ok) == sorted(r.prompt_tokens for r in levels["chat"].ok)  # done in any order


async def test_nulls_pass_and_a_read_response_is_kept_longest(nursery, tiny_gguf):
    """Fields sent as null ask for nothing (newer SDKs send many); reading
    or continuing a stored response counts as using it: past the store's
    count, the least recently used goes, not the oldest."""
    settings = make_settings(tiny_gguf)
    url = await start_server(nursery, attrs.evolve(settings, max_sessions=3))
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            nulls = {"context_management": None, "moderation": None, "max_tokens": None, "include": None, "reasoning": None}
            a, b, c = [await respond(client, input=f"turn {i}", max_output_tokens=2, **nulls) for i in range(3)]
            assert (await client.get(f"/v1/responses/{a['id']}")).status_code == 200  # a is now the most recently used
            await respond(client, input="next", max_output_tokens=2, previous_response_id=a["id"])
            kept = {r["id"]: (await client.get(f"/v1/responses/{r['id']}")).status_code for r in (a, b, c)}
    assert kept == {a["id"]: 200, b["id"]: 404, c["id"]: 200}


async def test_a_fault_mid_stream_ends_in_response_failed_and_keeps_nothing(server, monkeypatch):
    """The model faults (here: its forward pass raises on the fourth step,
    as a device error would): the stream ends with a well-formed
    response.failed whose error says why, and nothing is stored."""
    from trioserve.models.decoder import DecoderModel

    real, calls = DecoderModel.forward, []

    def faulty(self, batch, cache):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("the device fell over")
        return real(self, batch, cache)

    monkeypatch.setattr(DecoderModel, "forward", faulty)
    body = {"model": MODEL_NAME, "input": "Tell me a story.", "max_output_tokens": 50, "ignore_eos": True, "stream": True}
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            async with client.stream("POST", "/v1/responses", json=body) as response:
                events = await read_events(response)
            gone = await client.get(f"/v1/responses/{events[0]['response']['id']}")
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed", last
    assert "the device fell over" in last["response"]["error"]["message"], last["response"]["error"]
    assert [e["type"] for e in events].count("response.output_text.delta") >= 1  # it failed mid-reply
    assert_error(gone, 404, fragment="no response", param=None, code="response_not_found")
