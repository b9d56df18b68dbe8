"""A real trioserve HTTP server on 127.0.0.1, started inside the test's own
trio run (`nursery.start(serve_app, settings)`), serving the tiny random
Llama of tests/tiny_model.py in float32. The server stops when the test
ends (pytest-trio cancels the `nursery` fixture).

Helpers here read what the server says: SSE bodies split into their
`data:` payloads, the JSON metrics, and polling with a deadline."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.tiny_model import set_gguf_u32
from trioserve.models.step_runner import StepRunner
from trioserve.config import EngineConfig, ServerSettings
from trioserve.http.serve import serve_app

BLOCK_SIZE = 4
KV_BYTES_PER_TOKEN = 512  # tiny model in fp32: 2 (K, V) * 2 layers * 2 KV heads * 16 dims * 4 bytes
MAX_MODEL_LEN = 256  # the tiny model's context
LONG_CONTEXT = 1024  # tiny_gguf_long's
MODEL_NAME = "tiny"
EOS_ID = 2


def kv_bytes(tokens: int) -> int:
    """A KV budget holding exactly ``tokens`` tokens (a whole number of blocks)."""
    assert tokens % BLOCK_SIZE == 0
    return tokens * KV_BYTES_PER_TOKEN


def make_settings(model: Path, *, api_key: str | None = None, max_body_bytes: int = 1 << 20, **engine: object) -> ServerSettings:
    """Settings for a test server: port 0 (a free one), the tiny model in
    float32, blocks of 4 tokens, room for four full-context requests."""
    engine.setdefault("max_num_seqs", 4)
    engine.setdefault("prefill_budget", 64)
    engine.setdefault("kv_cache_bytes", kv_bytes(4 * MAX_MODEL_LEN))
    config = EngineConfig(model=str(model), dtype="float32", block_size=BLOCK_SIZE, **engine)
    return ServerSettings(
        engine=config,
        host="127.0.0.1",
        port=0,
        served_model_name=MODEL_NAME,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        log_level="warning",
    )


async def wait_healthy(url: str, *, timeout: float = 20.0) -> None:
    """Poll GET /health until it answers 200 {"status": "ok"}."""
    last = "no answer"
    with trio.move_on_after(timeout):
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            while True:
                try:
                    response = await client.get("/health")
                    if response.status_code == 200:
                        assert response.json() == {"status": "ok"}, response.text
                        return
                    last = f"{response.status_code} {response.text}"
                except httpx.TransportError as exc:
                    last = repr(exc)
                await trio.sleep(0.02)
    raise AssertionError(f"{url}/health did not answer 200 within {timeout} s (last: {last})")


async def start_server(nursery: trio.Nursery, settings: ServerSettings) -> str:
    """Start serve_app in ``nursery``; its base URL once /health says ok.
    A server left on --state-dir auto keeps its state in a directory of its
    own under the test's data directory (tests/conftest.py): a state file is
    one running server's alone (state/durable.py), and a test may run
    several servers at once."""
    if settings.state_dir == "auto":
        settings = attrs.evolve(settings, state_dir=tempfile.mkdtemp(prefix="state-", dir=os.environ.get("XDG_DATA_HOME")))
    with trio.fail_after(30):
        urls = await nursery.start(serve_app, settings)
        assert urls, "serve_app reported no bound address"
        url = next(u for u in urls if u.startswith("http://127.0.0.1:"))
        await wait_healthy(url)
    return url


@pytest.fixture
def tiny_gguf(tiny_checkpoints) -> Path:
    return tiny_checkpoints["gguf_f32"]


@pytest.fixture(scope="session")
def tiny_gguf_long(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny model with a 1024-token context (its metadata says so; RoPE
    works at any position), for prompts as long as a tool list renders in
    the tiny tokenizer (about one token per character)."""
    path = tmp_path_factory.mktemp("tiny-long") / "tiny-long.gguf"
    shutil.copyfile(tiny_checkpoints["gguf_f32"], path)
    return set_gguf_u32(path, "llama.context_length", LONG_CONTEXT)


@pytest.fixture
async def server(nursery, tiny_gguf) -> str:
    """The base URL of a server with the default test settings."""
    return await start_server(nursery, make_settings(tiny_gguf))


@pytest.fixture
def slow_steps(monkeypatch) -> Callable[[float], None]:
    """``slow_steps(s)`` makes every engine step take at least ``s`` seconds
    longer (a sleep in the worker thread before the real step), so that a
    request of ~200 tokens is certainly still running a second later. The
    step itself is the real one. Called again, it changes the delay for the
    steps after (0: none), from any thread."""
    delay: list[float] = []

    def install(seconds: float) -> None:
        if not delay:
            real = StepRunner.forward

            def slow(self, plan):
                import time

                if delay[0]:
                    time.sleep(delay[0])
                return real(self, plan)

            monkeypatch.setattr(StepRunner, "forward", slow)
            delay.append(seconds)
        delay[0] = seconds

    return install


# -- reading responses ----------------------------------------------------------


@attrs.define
class SSE:
    """One SSE response: its data payloads in order (JSON-decoded, "[DONE]"
    kept as the string) and the time each payload arrived."""

    payloads: list[object] = attrs.field(factory=list)
    times: list[float] = attrs.field(factory=list)

    @property
    def chunks(self) -> list[dict]:
        return [p for p in self.payloads if isinstance(p, dict)]

    def content(self, index: int = 0) -> str:
        """Concatenated chat deltas (or completion texts) of choice ``index``."""
        out = []
        for chunk in self.chunks:
            for choice in chunk["choices"]:
                if choice["index"] != index:
                    continue
                if "delta" in choice:  # chat
                    out.append(choice["delta"].get("content") or "")
                else:  # completions
                    out.append(choice["text"])
        return "".join(out)

    def choice_chunks(self, index: int = 0) -> list[dict]:
        return [c for chunk in self.chunks for c in chunk["choices"] if c["index"] == index]


def parse_sse_lines(lines: list[str]) -> list[object]:
    """Strictly parse an SSE body given as lines: every event is exactly one
    `data: <payload>` line followed by a blank line. Returns the payloads."""
    payloads: list[object] = []
    expect_blank = False
    for number, line in enumerate(lines):
        if expect_blank:
            assert line == "", f"line {number}: expected the blank line ending an event, got {line!r}"
            expect_blank = False
            continue
        assert line.startswith("data: "), f"line {number}: not a `data: ` line: {line!r}"
        data = line[len("data: ") :]
        if data == "[DONE]":
            payloads.append(data)
        else:
            try:
                payload = json.loads(data)
            except json.JSONDecodeError as exc:
                raise AssertionError(f"line {number}: the data is not JSON ({exc}): {data[:200]!r}") from None
            assert isinstance(payload, dict), f"line {number}: the data is not a JSON object: {data[:200]!r}"
            payloads.append(payload)
        expect_blank = True
    return payloads


async def read_sse(response: httpx.Response) -> SSE:
    """Read a whole streamed response, strictly (see parse_sse_lines)."""
    assert response.status_code == 200, f"{response.status_code}: {(await response.aread()).decode()[:500]}"
    assert response.headers["content-type"].startswith("text/event-stream"), response.headers["content-type"]
    lines: list[str] = []
    times: list[float] = []
    async for line in response.aiter_lines():
        lines.append(line)
        if line.startswith("data: "):
            times.append(trio.current_time())
    return SSE(parse_sse_lines(lines), times)


async def metrics(client: httpx.AsyncClient) -> dict:
    response = await client.get("/metrics")
    assert response.status_code == 200, response.text
    return response.json()


async def eventually(check: Callable[[], Awaitable[str | None]], *, timeout: float, what: str) -> None:
    """Poll ``check`` (returns None when satisfied, else why not) until it
    passes or ``timeout`` seconds pass."""
    why = "never checked"
    with trio.move_on_after(timeout):
        while True:
            why = await check()
            if why is None:
                return
            await trio.sleep(0.01)
    raise AssertionError(f"{what} not within {timeout} s: {why}")


def usage_tokens(usage: dict) -> dict:
    """Usage without prompt_tokens_details: how many prompt tokens the prefix
    cache held depends on what ran before, not on the request."""
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def assert_error(response: httpx.Response, status: int, *, fragment: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    """``response`` is an OpenAI-shaped error with these values."""
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text[:500]}"
    assert response.headers["content-type"].startswith("application/json"), response.headers["content-type"]
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and fragment in error["message"], f"{fragment!r} not in {error['message']!r}"
    assert error["param"] == param, f"param {error['param']!r}, expected {param!r} ({error['message']})"
    assert error["type"] == kind, error
    if code is not None:
        assert error["code"] == code, error
    return error
