"""`--max-step-ms` through the real server: a long prompt that arrives while
another request decodes gets the same greedy reply as with the option off
(chunking never changes a request's bits: batch invariance), the option
reaches the engine core (the trace's header says so), and the recorded run
replays with no difference, step plans included."""

from __future__ import annotations

import json

import time

import httpx
import pytest
import trio

from tests.http.conftest import make_settings, start_server
from trioserve.models.step_runner import StepRunner
from trioserve.core.replay import replay_trace

LONG = [5 + (7 * i) % 200 for i in range(180)]
BUDGET = 64  # the test servers' prefill budget


@pytest.fixture
def dear_prompts(monkeypatch):
    """A slow machine: every step takes 5 ms more, and 1 ms more for each
    prompt token it carries (a sleep in the worker thread before the real
    step). The tiny model alone is too fast to have steps worth limiting."""
    real = StepRunner.forward

    def slow(self, plan):
        time.sleep(0.005 + 0.001 * sum(len(r.token_ids) for r in plan.rows if not r.decode))
        return real(self, plan)

    monkeypatch.setattr(StepRunner, "forward", slow)


async def reply_beside_a_decoding_stream(url: str) -> str:
    """Start a streaming request, and once its tokens flow, send the long
    prompt; the long prompt's completion text."""
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        flowing = trio.Event()

        async def decoder() -> None:
            body = {"prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        flowing.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(decoder)
            with trio.fail_after(60):
                await flowing.wait()
            response = await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 12, "temperature": 0})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]


def long_prompt_rows(trace) -> tuple[list[int], int]:
    """From a trace: the long prompt's chunk sizes, and its decode rows."""
    records = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    ((long_id, prompt_len),) = {
        (r["id"], len(r["request"]["prompt_ids"])) for r in records if r.get("in") == "submit" and r["request"]["prompt_ids"][-len(LONG) :] == LONG
    }
    rows = [row for r in records if r.get("in") == "plan" and r["out"]["plan"] for row in r["out"]["plan"]["rows"] if row[0] == long_id]
    chunks = [n for _, start, n, _ in rows if start < prompt_len]
    assert sum(chunks) == prompt_len
    return chunks, sum(1 for _, start, _, _ in rows if start >= prompt_len)


async def test_max_step_ms_changes_when_tokens_come_not_which(nursery, tiny_gguf, dear_prompts, tmp_path):
    runs = {}
    for name, ms in (("off", 0.0), ("on", 30.0)):
        record = tmp_path / name
        record.mkdir()
        url = await start_server(nursery, make_settings(tiny_gguf, max_step_ms=ms, record_dir=str(record)))
        runs[name] = await reply_beside_a_decoding_stream(url), long_prompt_rows(next(record.iterdir()))
    (off_text, (off_chunks, _)), (on_text, (on_chunks, decode_rows)) = runs["off"], runs["on"]
    assert on_text == off_text
    assert decode_rows == 11  # 12 tokens: the first from the prompt's last chunk
    # Off: chunks of the budget less the decoding row. On: the first step
    # beside the decoding row is priced from nothing, so it is the same;
    # after it, about 30 ms less the decode part's ~5 ms, at >= 1 ms a token.
    assert off_chunks[0] == on_chunks[0] == BUDGET - 1
    assert all(n < BUDGET - 1 for n in on_chunks[1:-1]) and len(on_chunks) > len(off_chunks), (off_chunks, on_chunks)


async def test_the_recorded_run_with_max_step_ms_replays(nursery, tiny_gguf, dear_prompts, tmp_path):
    record = tmp_path / "traces"
    record.mkdir()
    url = await start_server(nursery, make_settings(tiny_gguf, max_step_ms=30.0, record_dir=str(record)))
    await reply_beside_a_decoding_stream(url)
    (trace,) = record.iterdir()
    head = json.loads(trace.read_text().splitlines()[0])
    assert head["core"]["max_step_s"] == 0.03
    assert long_prompt_rows(trace)[1] == 11
    summary = await trio.to_thread.run_sync(replay_trace, trace)
    assert summary.difference is None, summary.difference
