"""The OpenAI-compatible HTTP server end to end: a real hypercorn server on
127.0.0.1 inside the test's trio run, serving the tiny random Llama (fp32).

What is checked: the official `openai` client (sync, in a thread) against
chat, completions and models, with greedy output equal to the in-process
engine's for the same templated prompt and exact usage; streamed deltas equal
buffered content; `stream_options.include_usage`; `n` with a seed; eight
interleaved SSE streams, strictly well formed, each equal to its solo run;
client disconnects (streamed and buffered) cancel the request and free its
KV blocks; a table of bad requests, each with its status and OpenAI error
body; the API key; 429 with Retry-After when the queue is full; /health and
/metrics."""

from __future__ import annotations

import functools
import json
from contextlib import aclosing

import attrs
import httpx
import openai
import pytest
import torch
import trio

from tests.http.conftest import (
    EOS_ID,
    MAX_MODEL_LEN,
    MODEL_NAME,
    SSE,
    assert_error,
    eventually,
    kv_bytes,
    make_settings,
    metrics,
    parse_sse_lines,
    read_sse,
    start_server,
    usage_tokens,
)
from trioserve.types import FinalEvent, GenerateRequest, TokenEvent
from trioserve.config import EngineConfig
from trioserve.engine import Engine, open_engine
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import load_checkpoint
from trioserve.types import SamplingParams

TIMEOUT = httpx.Timeout(60.0)  # a hang guard: the tiny model answers in well under a second


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat_body(text: str, **fields: object) -> dict:
    return {"model": MODEL_NAME, "messages": user(text), **fields}


async def call(fn, /, *args, **kwargs):
    """Run a blocking (sync openai client) call in a thread."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


def sync_client(url: str, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60.0)


# -- the in-process reference ---------------------------------------------------


class Reference:
    """The engine API run in-process on the same checkpoint, with the prompt
    rendered and tokenized exactly as app.py does."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        tok = engine.tokenizer
        self.template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.engine.tokenizer.encode(self.template.render(messages, add_generation_prompt=True))

    async def run(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[TokenEvent], FinalEvent]:
        async with aclosing(self.engine.generate(GenerateRequest(prompt_ids, params))) as events:
            out = [event async for event in events]
        *tokens, final = out
        assert isinstance(final, FinalEvent) and all(isinstance(t, TokenEvent) for t in tokens)
        return tokens, final


@pytest.fixture
async def reference(tiny_gguf):
    checkpoint = load_checkpoint(tiny_gguf, dtype=torch.float32)
    config = EngineConfig(model=str(tiny_gguf), dtype="float32", block_size=4, kv_cache_bytes=kv_bytes(2 * MAX_MODEL_LEN), max_num_seqs=2, prefill_budget=64)
    async with open_engine(config, checkpoint=checkpoint) as engine:
        yield Reference(engine)


def text_of(tokens: list[TokenEvent], final: FinalEvent) -> str:
    return "".join(t.text for t in tokens) + final.text


# -- 1. the openai client -----------------------------------------------------------


@pytest.mark.parametrize(
    ("bias", "expected_finish"),
    [(None, "length"), ({str(EOS_ID): 2}, "stop")],
    ids=["runs-to-length", "stops-at-eos"],
)
async def test_openai_chat_equals_engine(server, reference, bias, expected_finish):
    """Greedy chat through the openai client: buffered content and usage equal
    the in-process engine's; streamed deltas concatenate to the same content,
    one delta per generated token (EOS has none but counts in usage); the
    include_usage chunk comes last with no choices."""
    with trio.fail_after(20):
        client = sync_client(server)
        messages = user("Hello there")
        extra = {"logit_bias": bias} if bias else {}
        tokens, final = await reference.run(
            reference.chat_ids(messages),
            SamplingParams(max_tokens=40, temperature=0.0, logit_bias=tuple((int(k), float(v)) for k, v in (bias or {}).items())),
        )
        assert final.finish_reason == expected_finish, "the reference itself should finish as the test expects"
        expected_text = text_of(tokens, final)
        eos = 1 if expected_finish == "stop" else 0
        assert final.usage.completion_tokens == len(tokens) + eos
        assert final.usage.prompt_tokens == len(reference.chat_ids(messages))

        buffered = await call(client.chat.completions.create, model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0, **extra)
        assert buffered.object == "chat.completion" and buffered.model == MODEL_NAME
        assert len(buffered.choices) == 1
        choice = buffered.choices[0]
        assert choice.index == 0 and choice.message.role == "assistant"
        assert choice.message.content == expected_text, "buffered greedy content differs from the in-process engine's"
        assert choice.finish_reason == expected_finish
        assert buffered.usage.prompt_tokens == final.usage.prompt_tokens
        assert buffered.usage.completion_tokens == final.usage.completion_tokens
        assert buffered.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens

        def stream_all():
            stream = client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True}, **extra
            )
            with stream:
                return list(stream)

        chunks = await call(stream_all)
        assert chunks[0].choices[0].delta.role == "assistant"
        *body, usage_chunk = chunks
        assert usage_chunk.choices == [], "the include_usage chunk must have no choices"
        assert usage_chunk.usage is not None
        assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens, usage_chunk.usage.total_tokens) == (
            buffered.usage.prompt_tokens,
            buffered.usage.completion_tokens,
            buffered.usage.total_tokens,
        )
        assert all(c.usage is None for c in body), "only the last chunk carries usage"
        assert all(len(c.choices) == 1 and c.choices[0].index == 0 for c in body)
        assert len({c.id for c in chunks}) == 1, "every chunk carries the same id"
        streamed = "".join(c.choices[0].delta.content or "" for c in body)
        assert streamed == choice.message.content, "streamed deltas differ from the buffered content"
        finishes = [c.choices[0].finish_reason for c in body]
        assert finishes[-1] == expected_finish and all(f is None for f in finishes[:-1]), finishes
        # role chunk, one chunk per TokenEvent, the held-back tail if any, the finish chunk
        content_chunks = body[1:-1]
        assert len(content_chunks) == len(tokens) + (1 if final.text else 0), "one content chunk per streamed token"
        assert body[-1].choices[0].delta.content is None


async def test_openai_completions_equal_engine(server, reference):
    """Greedy /v1/completions: the text equals the engine's on the raw
    prompt's ids, buffered and streamed; usage is exact; echo prepends."""
    with trio.fail_after(20):
        client = sync_client(server)
        prompt = "def add(a, b):"
        ids = reference.engine.tokenizer.encode(prompt)
        tokens, final = await reference.run(ids, SamplingParams(max_tokens=24, temperature=0.0))
        expected = text_of(tokens, final)

        buffered = await call(client.completions.create, model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert buffered.object == "text_completion"
        assert [c.index for c in buffered.choices] == [0]
        assert buffered.choices[0].text == expected
        assert buffered.choices[0].finish_reason == final.finish_reason
        assert (buffered.usage.prompt_tokens, buffered.usage.completion_tokens) == (len(ids), final.usage.completion_tokens)

        def stream_all():
            with client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
            ) as stream:
                return list(stream)

        chunks = await call(stream_all)
        *body, usage_chunk = chunks
        assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == final.usage.completion_tokens
        assert "".join(c.choices[0].text for c in body) == expected
        assert [c.choices[0].finish_reason for c in body][-1] == final.finish_reason
        assert len(body) == len(tokens) + 1, "one chunk per token, then the finish chunk"

        echoed = await call(client.completions.create, model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, echo=True)
        assert echoed.choices[0].text == prompt + expected


async def test_openai_models(server):
    with trio.fail_after(10):
        client = sync_client(server)
        listed = await call(client.models.list)
        assert [m.id for m in listed.data] == [MODEL_NAME]
        card = await call(client.models.retrieve, MODEL_NAME)
        assert card.id == MODEL_NAME and card.object == "model" and card.owned_by == "trioserve"
        assert card.model_extra["batch_invariant"] is True  # which arithmetic runs (docs/determinism.md)
        assert card.model_extra["activations"] == "bf16"  # auto, resolved: this f32 GGUF has no 4-bit codes to take int8 inputs
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await call(client.models.retrieve, "no-such-model")


async def test_n_choices_with_seed(server):
    """n=2 with a seed: two choices, index 0 and 1; choice i is the n=1
    request with seed + i; streamed per-index deltas equal the buffered
    choices; usage sums both."""
    with trio.fail_after(20):
        client = sync_client(server)
        common = dict(model=MODEL_NAME, messages=user("Tell me a story"), max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
        both = await call(client.chat.completions.create, n=2, seed=1234, **common)
        assert [c.index for c in both.choices] == [0, 1]
        solo = [await call(client.chat.completions.create, n=1, seed=1234 + i, **common) for i in range(2)]
        for i in range(2):
            assert both.choices[i].message.content == solo[i].choices[0].message.content, f"choice {i} is not the solo run with seed {1234 + i}"
            assert both.choices[i].finish_reason == "length"
        assert both.choices[0].message.content != both.choices[1].message.content, "two seeds gave the same 16 sampled tokens"
        assert both.usage.completion_tokens == 32
        assert both.usage.prompt_tokens == solo[0].usage.prompt_tokens

        def stream_all():
            with client.chat.completions.create(n=2, seed=1234, stream=True, stream_options={"include_usage": True}, **common) as stream:
                return list(stream)

        chunks = await call(stream_all)
        by_index: dict[int, list] = {0: [], 1: []}
        for chunk in chunks[:-1]:
            assert len(chunk.choices) == 1
            by_index[chunk.choices[0].index].append(chunk.choices[0])
        for i in range(2):
            assert by_index[i][0].delta.role == "assistant", f"choice {i} has no role chunk first"
            assert "".join(c.delta.content or "" for c in by_index[i]) == both.choices[i].message.content
            assert [c.finish_reason for c in by_index[i]][-1] == "length"
            assert all(c.finish_reason is None for c in by_index[i][:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32


# -- 2. interleaved SSE streams ---------------------------------------------------------------


def check_chat_stream(sse: SSE, *, usage: bool) -> None:
    """Strict shape of one chat SSE stream with n=1."""
    assert sse.payloads and sse.payloads[-1] == "[DONE]", f"the stream does not end with [DONE]: {sse.payloads[-1:]}"
    assert sse.payloads.count("[DONE]") == 1
    chunks = sse.chunks
    assert len({c["id"] for c in chunks}) == 1, "chunk ids differ"
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["model"] == MODEL_NAME, c
    if usage:
        *chunks, last = chunks
        assert last["choices"] == [] and set(last["usage"]) == {
            "prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details"
        }, last  # fmt: skip
        assert last["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}, last  # no reasoning parser here
        cached = last["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert isinstance(cached, int) and 0 <= cached < last["usage"]["prompt_tokens"], last
    choices = [c["choices"] for c in chunks]
    assert all(len(cs) == 1 and cs[0]["index"] == 0 for cs in choices), "n=1 chunks carry exactly choice 0"
    first = choices[0][0]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None, first
    assert all("role" not in cs[0]["delta"] for cs in choices[1:]), "a role in a later chunk"
    finishes = [cs[0]["finish_reason"] for cs in choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1]), finishes
    assert all("usage" not in c or c["usage"] is None for c in chunks), "usage before the last chunk"


PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Hello, world!",
    "Numbers like 2024",
    "In the morning the server starts",
    "class Server:",
    "The café serves crème brûlée",
    "import json",
]


async def test_interleaved_streams_equal_solo(server):
    """Eight greedy SSE streams at once (four decode together, four wait):
    each is well formed and equals its solo buffered run."""
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            solo = []
            for prompt in PROMPTS:
                response = await client.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=48, temperature=0))
                assert response.status_code == 200, response.text
                solo.append(response.json())

            streams: dict[int, SSE] = {}

            async def one(i: int) -> None:
                body = chat_body(PROMPTS[i], max_tokens=48, temperature=0, stream=True, stream_options={"include_usage": True})
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    streams[i] = await read_sse(response)

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)

        for i, sse in streams.items():
            check_chat_stream(sse, usage=True)
            expected = solo[i]["choices"][0]
            assert sse.content() == expected["message"]["content"], f"stream {i} ({PROMPTS[i]!r}) differs from its solo run"
            assert sse.choice_chunks()[-1]["finish_reason"] == expected["finish_reason"]
            assert usage_tokens(sse.chunks[-1]["usage"]) == usage_tokens(solo[i]["usage"]), f"stream {i} usage"
        spans = sorted((s.times[1], s.times[-1]) for s in streams.values())
        overlapping = sum(1 for a, b in zip(spans, spans[1:]) if b[0] < a[1])
        assert overlapping >= 1, f"no two streams were in flight together: {spans}"


# -- 3. disconnects ---------------------------------------------------------------------------------


def _cancelled(m: dict) -> int:
    return m["finished"].get("cancelled", 0)


async def _assert_cancelled_and_freed(client: httpx.AsyncClient, before: dict) -> None:
    async def check():
        m = await metrics(client)
        if _cancelled(m) != _cancelled(before) + 1 or m["kv_blocks_used"] != before["kv_blocks_used"] or m["running"] != 0:
            return f"cancelled {_cancelled(before)} -> {_cancelled(m)}, kv_blocks_used {before['kv_blocks_used']} -> {m['kv_blocks_used']}, running {m['running']}"
        return None

    await eventually(check, timeout=30.0, what="the disconnected request cancelled and its blocks freed")
    after = await metrics(client)
    assert after["finished"].get("length", 0) == before["finished"].get("length", 0), "the request ran to its end instead"
    assert after["waiting"] == 0


async def raw_post(url: str, path: str, body: dict) -> trio.SocketStream:
    """Send a POST on a bare TCP connection (no client library between the
    test and the socket, so closing it is exactly a client disconnect)."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    await stream.send_all(head.encode() + data)
    return stream


async def test_disconnect_mid_stream_cancels(nursery, tiny_gguf, slow_steps):
    slow_steps(0.004)  # 220 tokens take about a second: still running when the client leaves
    url = await start_server(nursery, make_settings(tiny_gguf))
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            before = await metrics(client)
            stream = await raw_post(url, "/v1/chat/completions", chat_body("Tell me everything", max_tokens=220, ignore_eos=True, stream=True))
            async with stream:
                received = b""
                while received.count(b"data: ") < 3:  # the role chunk and two token chunks
                    data = await stream.receive_some()
                    assert data, f"the server closed the stream early: {received[-500:]!r}"
                    received += data
                assert received.startswith(b"HTTP/1.1 200"), received[:200]
                assert b"[DONE]" not in received
                during = await metrics(client)
                assert during["running"] == 1 and during["kv_blocks_used"] > before["kv_blocks_used"], during
            # leaving the block closed the connection mid-body
            await _assert_cancelled_and_freed(client, before)


async def test_disconnect_mid_buffered_cancels(nursery, tiny_gguf, slow_steps):
    slow_steps(0.004)
    url = await start_server(nursery, make_settings(tiny_gguf))
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            before = await metrics(client)
            outcome: list[object] = []

            async def buffered(task_status=trio.TASK_STATUS_IGNORED):
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as own:
                        outcome.append(await own.post("/v1/chat/completions", json=chat_body("Tell me everything", max_tokens=220, ignore_eos=True)))

            async with trio.open_nursery() as inner:
                scope = await inner.start(buffered)

                async def running():
                    m = await metrics(client)
                    return None if m["running"] == 1 else f"running {m['running']}"

                await eventually(running, timeout=30.0, what="the buffered request running")
                await trio.sleep(0.05)
                scope.cancel()
            assert outcome == [], "the buffered request finished before it was cancelled"
            await _assert_cancelled_and_freed(client, before)


# -- 4. bad requests ----------------------------------------------------------------------------------

BODY_LIMIT = 4096
HI = [{"role": "user", "content": "hi"}]

# (id, method, path, request kwargs, status, message fragment, param, code)
BAD = [
    ("malformed-json", "POST", "/v1/chat/completions", {"content": b'{"messages": ['}, 400, "not valid JSON", None, None),
    ("body-not-object", "POST", "/v1/chat/completions", {"json": [1, 2]}, 400, "must be a JSON object", None, None),
    ("messages-wrong-type", "POST", "/v1/chat/completions", {"json": {"messages": "hi"}}, 400, "messages: expected a list", "messages", None),
    ("content-wrong-type", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": 5}]}}, 400, "expected a string or a list of content parts, got 5", "messages[0].content", None),
    ("messages-missing", "POST", "/v1/chat/completions", {"json": {"model": MODEL_NAME}}, 400, "required", "messages", None),
    ("n-not-integer", "POST", "/v1/chat/completions", {"json": {"messages": HI, "n": 2.5}}, 400, "n: expected an integer, got 2.5", "n", None),
    ("stream-not-bool", "POST", "/v1/chat/completions", {"json": {"messages": HI, "stream": "yes"}}, 400, "expected true or false", "stream", None),
    ("temperature-out-of-range", "POST", "/v1/chat/completions", {"json": {"messages": HI, "temperature": 5}}, 400, "temperature: must be between 0 and 2, got 5", "temperature", None),
    ("top-p-zero", "POST", "/v1/chat/completions", {"json": {"messages": HI, "top_p": 0}}, 400, "must be greater than 0", "top_p", None),
    ("max-tokens-zero", "POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 0}}, 400, "must be at least 1", "max_tokens", None),
    ("logit-bias-token", "POST", "/v1/chat/completions", {"json": {"messages": HI, "logit_bias": {"99999": 1}}}, 400, "99999 is not a token id", "logit_bias", None),
    ("tool-name-bad", "POST", "/v1/chat/completions", {"json": {"messages": HI, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}}, 400, "a function name is 1 to 64", "tools[0].function.name", None),
    ("tool-choice-unknown", "POST", "/v1/chat/completions", {"json": {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}}, 400, "no tool named 'g'", "tool_choice", None),
    ("response-format-unknown", "POST", "/v1/chat/completions", {"json": {"messages": HI, "response_format": {"type": "xml"}}}, 400, "must be one of 'text', 'json_object', 'json_schema'", "response_format.type", None),
    ("suffix-unsupported", "POST", "/v1/completions", {"json": {"prompt": "hi", "suffix": "end"}}, 400, "suffix (insertion) is not supported", "suffix", None),
    ("stream-options-without-stream", "POST", "/v1/chat/completions", {"json": {"messages": HI, "stream_options": {"include_usage": True}}}, 400, "only allowed when stream is true", "stream_options", None),
    ("model-not-served-chat", "POST", "/v1/chat/completions", {"json": {"messages": HI, "model": "gpt-4"}}, 404, "'gpt-4' does not exist", "model", "model_not_found"),
    ("model-not-served-completions", "POST", "/v1/completions", {"json": {"prompt": "hi", "model": "gpt-4"}}, 404, "'gpt-4' does not exist", "model", "model_not_found"),
    ("model-card-not-served", "GET", "/v1/models/gpt-4", {}, 404, "'gpt-4' does not exist", "model", "model_not_found"),
    ("chat-prompt-too-long", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "a " * 400}]}}, 400, f"the maximum model length is {MAX_MODEL_LEN}", "messages", "context_length_exceeded"),
    # A completions prompt is named 'prompt', not 'messages'.
    ("completion-prompt-too-long", "POST", "/v1/completions", {"json": {"prompt": [5] * 300}}, 400, f"the prompt has 300 tokens; the maximum model length is {MAX_MODEL_LEN}", "prompt", "context_length_exceeded"),
    ("max-tokens-over-context", "POST", "/v1/chat/completions", {"json": {"messages": HI, "max_tokens": 1000}}, 400, "max_tokens (1000) = ", "max_tokens", "context_length_exceeded"),
    ("max-tokens-over-context-streamed", "POST", "/v1/chat/completions", {"json": {"messages": HI, "max_tokens": 1000, "stream": True}}, 400, f"exceeds the maximum model length of {MAX_MODEL_LEN}", "max_tokens", "context_length_exceeded"),
    # Token ids are range-checked before decoding (not a TokenizerError 500).
    ("completion-token-id-out-of-vocab", "POST", "/v1/completions", {"json": {"prompt": [5, 99999]}}, 400, "99999", "prompt", None),
    # The framework's too-large error must surface as 413, not be caught as a 500.
    ("body-too-large", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "x" * (2 * BODY_LIMIT)}]}}, 413, f"larger than {BODY_LIMIT} bytes", None, "body_too_large"),
    ("unknown-route", "GET", "/v1/nope", {}, 404, "no route GET /v1/nope", None, "not_found"),
    ("get-on-post-route", "GET", "/v1/chat/completions", {}, 405, "GET is not allowed on /v1/chat/completions", None, "method_not_allowed"),
]


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "fragment", "param", "code"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
async def test_bad_request(nursery, tiny_gguf, method, path, kwargs, status, fragment, param, code):
    url = await start_server(nursery, make_settings(tiny_gguf, max_body_bytes=BODY_LIMIT))
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            response = await client.request(method, path, **kwargs)
            assert_error(response, status, fragment=fragment, param=param, code=code)
            m = await metrics(client)
            assert m["running"] == 0 and m["waiting"] == 0 and m["kv_blocks_used"] == 0, m


async def test_api_key(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf, api_key="sekret"))
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                for method, path, kwargs in (("GET", "/v1/models", {}), ("POST", "/v1/chat/completions", {"json": chat_body("hi", max_tokens=2)})):
                    response = await client.request(method, path, headers=headers, **kwargs)
                    assert_error(response, 401, fragment="missing or wrong API key", param=None, kind="authentication_error", code="invalid_api_key")
            health = await client.get("/health")
            assert health.status_code == 200 and health.json() == {"status": "ok"}, "/health must stay open"
            ok = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer sekret"}, json=chat_body("hi", max_tokens=2))
            assert ok.status_code == 200, ok.text
        with pytest.raises(openai.AuthenticationError, match="API key"):
            await call(sync_client(url, api_key="wrong").models.list)
        models = await call(sync_client(url, api_key="sekret").models.list)
        assert [m.id for m in models.data] == [MODEL_NAME]


# -- 5. a full queue ---------------------------------------------------------------------------------


async def test_queue_full_gets_429(nursery, tiny_gguf, slow_steps):
    """One row, one queue place, a pool for one request: A runs, B waits, C
    is refused with 429 and Retry-After (buffered and streamed); A and B
    then finish normally and the server takes new requests."""
    slow_steps(0.004)
    settings = make_settings(tiny_gguf, max_num_seqs=1, max_queue=1, kv_cache_bytes=kv_bytes(MAX_MODEL_LEN))
    url = await start_server(nursery, settings)
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            results: dict[str, SSE] = {}

            async def stream_b():
                body = chat_body("second", max_tokens=8, ignore_eos=True, stream=True)
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    results["b"] = await read_sse(response)

            body_a = chat_body("first", max_tokens=200, ignore_eos=True, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body_a) as a:
                assert a.status_code == 200
                lines = a.aiter_lines()
                first = await lines.__anext__()
                assert first.startswith("data: "), first
                async with trio.open_nursery() as inner:
                    inner.start_soon(stream_b)

                    async def queued():
                        m = await metrics(client)
                        return None if (m["running"], m["waiting"]) == (1, 1) else f"running {m['running']}, waiting {m['waiting']}"

                    await eventually(queued, timeout=30.0, what="A running and B waiting")
                    refused = await client.post("/v1/chat/completions", json=chat_body("third", max_tokens=4))
                    assert_error(refused, 429, fragment="at capacity", param=None, kind="rate_limit_error", code="queue_full")
                    assert refused.headers.get("Retry-After") == "1", refused.headers
                    refused_stream = await client.post("/v1/chat/completions", json=chat_body("third", max_tokens=4, stream=True))
                    assert_error(refused_stream, 429, fragment="at capacity", param=None, kind="rate_limit_error", code="queue_full")
                    assert refused_stream.headers.get("Retry-After") == "1"
                    rest = [first] + [line async for line in lines]
                    await lines.aclose()
            a_payloads = parse_sse_lines(rest)
            assert a_payloads[-1] == "[DONE]"
            a_sse = SSE(a_payloads)
            assert a_sse.choice_chunks()[-1]["finish_reason"] == "length"
            check_chat_stream(results["b"], usage=False)
            assert results["b"].choice_chunks()[-1]["finish_reason"] == "length"
            later = await client.post("/v1/chat/completions", json=chat_body("fourth", max_tokens=4))
            assert later.status_code == 200, later.text
            m = await metrics(client)
            assert m["running"] == 0 and m["waiting"] == 0 and m["kv_blocks_used"] == 0, m


# -- 7. health and metrics ---------------------------------------------------------------------------

METRIC_KEYS = {
    "running", "waiting", "kv_blocks_used", "kv_blocks_total", "kv_usage", "steps", "prompt_tokens",
    "generated_tokens", "finished", "queue_wait", "ttft", "inter_token", "end_to_end", "dead", "prefix_cache", "sessions", "responses",
    "batch_invariant", "activations", "speculative", "compute",
}


async def test_health_and_metrics(server):
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            health = await client.get("/health")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            assert "Access-Control-Allow-Origin" not in health.headers  # no CORS without --cors-origins (test_tenants.py)
            before = await metrics(client)
            assert set(before) == METRIC_KEYS, set(before) ^ METRIC_KEYS
            assert before["speculative"] == {"draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": 0.0}  # off by default
            assert before["kv_blocks_total"] == 4 * MAX_MODEL_LEN // 4 and before["kv_blocks_used"] == 0 and before["dead"] is None
            assert before["batch_invariant"] is True  # the default
            assert before["activations"] == "bf16"  # auto, for a checkpoint without 4-bit codes (test_session_kv: one with them)
            # How the model computes (also the start-up line and the model card): tests/test_cpu_levels.py checks each field.
            assert set(before["compute"]) == {"device", "dtype", "kv_dtype", "kernels", "cpu_kernels", "activations", "threads", "weights"}
            assert before["compute"]["kv_dtype"] == before["compute"]["dtype"]  # auto: the weights' dtype
            assert set(before["compute"]["weights"]) == {"layers", "head"}
            assert before["compute"]["device"] == "cpu" and before["compute"]["activations"] == before["activations"]
            for key in ("queue_wait", "ttft", "inter_token", "end_to_end"):
                assert set(before[key]) == {"count", "sum_s", "mean_s"}, before[key]

            response = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 7, "ignore_eos": True})
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            assert usage["completion_tokens"] == 7
            after = await metrics(client)
            assert after["generated_tokens"] - before["generated_tokens"] == 7
            assert after["prompt_tokens"] - before["prompt_tokens"] == usage["prompt_tokens"]
            assert after["finished"].get("length", 0) - before["finished"].get("length", 0) == 1
            assert after["steps"] - before["steps"] >= 7
            for key in ("queue_wait", "ttft", "end_to_end"):
                assert after[key]["count"] - before[key]["count"] == 1, key
                assert after[key]["sum_s"] >= before[key]["sum_s"]
            assert after["inter_token"]["count"] - before["inter_token"]["count"] == 6
            assert (after["running"], after["waiting"], after["kv_blocks_used"], after["kv_usage"]) == (0, 0, 0, 0.0)


async def test_requests_without_max_tokens_fit_a_pool_smaller_than_the_context(nursery, tiny_gguf):
    """Without max_tokens a request reserves no more than the pool can hold
    beside its prompt, so a 128-token pool still serves it (it used to ask
    for the whole 256-token context and be refused)."""
    settings = make_settings(tiny_gguf, kv_cache_bytes=kv_bytes(128))
    url = await start_server(nursery, settings)
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            body = {"prompt": "The quick brown fox", "ignore_eos": True, "temperature": 0}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            assert response.json()["choices"][0]["finish_reason"] == "length"
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 128


async def test_default_max_tokens_caps_generation(nursery, tiny_gguf):
    settings = attrs.evolve(make_settings(tiny_gguf), default_max_tokens=9)
    url = await start_server(nursery, settings)
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            response = await client.post("/v1/completions", json={"prompt": "The quick", "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 9


async def test_prometheus_metrics_parse_and_move(server):
    from prometheus_client.parser import text_string_to_metric_families

    def values(text: str) -> dict:
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            first = await client.get("/metrics/prometheus")
            assert first.status_code == 200 and first.headers["content-type"].startswith("text/plain")
            before = values(first.text)
            response = await client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 5, "ignore_eos": True})
            assert response.status_code == 200, response.text
            after = values((await client.get("/metrics/prometheus")).text)
    model = ("model", MODEL_NAME)  # every sample is labelled with the model it is about
    stop = ("trioserve_requests_total", (model, ("outcome", "length")))
    assert after[stop] - before.get(stop, 0) == 1
    gen = ("trioserve_generation_tokens_total", (model,))
    assert after[gen] - before[gen] == 5
    count = ("trioserve_time_to_first_token_seconds_count", (model,))
    assert after[count] - before[count] == 1
    itl = ("trioserve_inter_token_latency_seconds_count", (model,))
    assert after[itl] - before[itl] == 4
    assert after[("trioserve_requests_running", (model,))] == 0
    assert after[("trioserve_model_info", (model,))] == 1


async def test_n_larger_than_the_queue_is_refused_by_name(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf, max_queue=2))
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            response = await client.post("/v1/chat/completions", json={"messages": HI, "n": 3, "max_tokens": 2})
            assert_error(response, 400, fragment="n (3) is more than this server queues at once (2", param="n")
            ok = await client.post("/v1/chat/completions", json={"messages": HI, "n": 2, "max_tokens": 2})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


@pytest.mark.parametrize("echo", [False, True])
async def test_streamed_completion_logprobs_carry_the_buffered_text_offsets(server, echo):
    """Each streamed chunk's text_offset continues from the previous tokens'
    text (and the echoed prompt), exactly as the buffered response counts.
    Echoed, the prompt's tokens come first, from offset 0 (issue #29)."""
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 2, "echo": echo}
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=server, timeout=10) as client:
            buffered = await client.post("/v1/completions", json=body)
            assert buffered.status_code == 200, buffered.text
            want = buffered.json()["choices"][0]["logprobs"]
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                sse = await read_sse(response)
    got = {"tokens": [], "text_offset": []}
    for chunk in sse.choice_chunks(0):
        if chunk.get("logprobs"):
            got["tokens"] += chunk["logprobs"]["tokens"]
            got["text_offset"] += chunk["logprobs"]["text_offset"]
    prompt = buffered.json()["usage"]["prompt_tokens"] if echo else 0
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) == prompt + 8
    assert got["text_offset"] == want["text_offset"]
    assert got["text_offset"][prompt] == (len("The quick brown fox") if echo else 0)
    assert "".join(got["tokens"][:prompt]) == ("The quick brown fox" if echo else "")
