"""Record and replay with the real default model (SmolLM2, through the real
HTTP server): a concurrent mix of requests -- greedy and seeded sampling,
stop strings, n=2, a JSON schema, a forced tool call, streamed and buffered,
two clients that leave mid-stream, and a session with a cut turn -- is
recorded with ``record_dir``; ``trioserve replay`` then finds the trace
identical, fast and on the model, and finds one edited sampled token in
both modes, naming its request and step. Slow: loads the model, runs about
fifty requests and re-runs every step of them."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import attrs
import httpx
import jsonschema
import pytest
import torch
import trio

from tests.http.conftest import SSE, metrics, read_sse, start_server
from tests.http.test_guided import WEATHER
from tests.http.test_server import raw_post
from tests.http.test_sessions import create
from trioserve.cli import main
from trioserve.config import EngineConfig, ServerSettings
from trioserve.core.trace import TraceWriter

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
THREADS = 1
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
    "required": ["color", "bright"],
    "additionalProperties": False,
}
QUESTIONS = (
    "What is the capital of France?",
    "Name a primary color.",
    "What animal says moo?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Write one word about the sea.",
    "What is 2 + 2?",
    "Say hello to a friend.",
)
SYSTEM = "You are a brief assistant."
SESSION_QUESTIONS = ("Tell me about Paris.", "And about Rome?", "Which one is older?")


def ask(k: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]


def requests() -> list[tuple[str, str, dict, str]]:
    """(label, path, body, how): how is "json" (buffered), "sse" (streamed
    to its end) or "cut" (streamed; the client leaves after a few chunks)."""
    out: list[tuple[str, str, dict, str]] = []
    for k in range(10):  # greedy
        out.append((f"greedy-{k}", CHAT, {"messages": ask(k), "temperature": 0, "max_tokens": 12}, "json" if k < 6 else "sse"))
    for k in range(10):  # seeded sampling
        body = {"messages": ask(k + 3), "temperature": 1, "seed": 100 + k, "max_tokens": 12}
        out.append((f"sampled-{k}", CHAT, body, "json" if k % 2 else "sse"))
    for k, stop in enumerate(([". "], [" the", "\n"], [","], ["a"])):
        body = {"messages": ask(k + 1), "stop": stop, "max_tokens": 16, **({"temperature": 1, "seed": 7 + k} if k % 2 else {"temperature": 0})}
        out.append((f"stop-{k}", CHAT, body, "json" if k < 2 else "sse"))
    for k in range(3):  # two choices each
        body = {"messages": ask(k + 5), "n": 2, "temperature": 1, "seed": 40 + k, "max_tokens": 10}
        out.append((f"n2-{k}", CHAT, body, "json" if k < 2 else "sse"))
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR, "strict": True}}
    for k in range(3):
        body = {"messages": [{"role": "user", "content": "Pick a color, as JSON."}], "response_format": fmt, "max_tokens": 24}
        body |= {"temperature": 0} if k == 0 else {"temperature": 1, "seed": 60 + k}
        out.append((f"schema-{k}", CHAT, body, "sse" if k == 2 else "json"))
    forced = {"type": "function", "function": {"name": "get_weather"}}
    weather = [{"role": "user", "content": "What's the weather like in Paris today, in celsius?"}]
    for k in range(2):
        body = {"messages": weather, "tools": [WEATHER], "tool_choice": forced, "max_tokens": 40}
        body |= {"temperature": 0} if k == 0 else {"temperature": 1, "seed": 80}
        out.append((f"tool-{k}", CHAT, body, "json" if k == 0 else "sse"))
    for k in range(3):  # the legacy completions route
        body = {"prompt": f"Once upon a time, in a land number {k},", "max_tokens": 12, "temperature": k % 2, "seed": 90 + k}
        out.append((f"text-{k}", "/v1/completions", body, "sse" if k == 2 else "json"))
    for k in range(2):  # clients that leave mid-stream
        body = {"messages": ask(k), "max_tokens": 400, "ignore_eos": True, "temperature": k, "seed": 5}
        out.append((f"cut-{k}", CHAT, body, "cut"))
    return out


async def cut_stream(url: str, path: str, body: dict, chunks: int = 3) -> bytes:
    """Stream ``body`` on a bare connection and close it after ``chunks``
    SSE events: a client disconnecting mid-stream."""
    stream = await raw_post(url, path, {**body, "stream": True})
    async with stream:
        received = b""
        while received.count(b"data: ") < chunks:
            data = await stream.receive_some()
            assert data, f"the server closed the stream early: {received[-300:]!r}"
            received += data
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received, received[:300]
    return received


async def one(client: httpx.AsyncClient, url: str, path: str, body: dict, how: str) -> Any:
    if how == "json":
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        return response.json()
    if how == "sse":
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            return await read_sse(response)
    return await cut_stream(url, path, body)


async def session(client: httpx.AsyncClient, url: str) -> dict:
    """Four turns: two answered, one cut mid-stream, then its retry."""
    sid = await create(client, system=SYSTEM, temperature=1, seed=3, max_tokens=12)
    path = f"/v1/sessions/{sid}/turns"
    turns: list[Any] = []
    for question in SESSION_QUESTIONS[:2]:
        response = await client.post(path, json={"messages": [{"role": "user", "content": question}]})
        assert response.status_code == 200, response.text
        turns.append(response.json())
    before = (await client.get(f"/v1/sessions/{sid}")).json()
    third = {"messages": [{"role": "user", "content": SESSION_QUESTIONS[2]}]}
    turns.append(await cut_stream(url, path, {**third, "max_tokens": 300, "ignore_eos": True}))
    with trio.fail_after(60):
        while (state := (await client.get(f"/v1/sessions/{sid}")).json())["busy"]:
            await trio.sleep(0.02)
    assert {k: state[k] for k in ("turns", "draw_index", "messages")} == {k: before[k] for k in ("turns", "draw_index", "messages")}
    async with client.stream("POST", path, json={**third, "stream": True}) as response:
        turns.append(await read_sse(response))
    return {"id": sid, "turns": turns, "state": (await client.get(f"/v1/sessions/{sid}")).json()}


async def record(directory: Path) -> tuple[dict[str, Any], dict]:
    """Serve SmolLM2 recording into ``directory``, send the whole mix at
    once, then stop the server. The replies by label, and /metrics."""
    engine = EngineConfig(model="smollm2", record_dir=str(directory))
    settings = attrs.evolve(ServerSettings(engine=engine), host="127.0.0.1", port=0, log_level="warning")
    replies: dict[str, Any] = {}
    async with trio.open_nursery() as server:
        url = await start_server(server, settings)
        with trio.fail_after(300):
            async with httpx.AsyncClient(base_url=url, timeout=240.0, limits=httpx.Limits(max_connections=200)) as client:

                async def run(label: str, coro) -> None:
                    replies[label] = await coro

                async with trio.open_nursery() as traffic:
                    for label, path, body, how in requests():
                        traffic.start_soon(run, label, one(client, url, path, body, how))
                    traffic.start_soon(run, "session", session(client, url))
                stats = await metrics(client)
        server.cancel_scope.cancel()
    return replies, stats


@attrs.frozen
class Recorded:
    trace: Path
    replies: dict[str, Any]
    metrics: dict
    closed: bool  # whether the server closed its trace file when it stopped


class TrackedWriter(TraceWriter):
    made: list[TraceWriter] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.made.append(self)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for the recording and every replay. On a small
    machine shared with other work, two OpenMP threads that spin-wait for
    each other make every model step several times slower (the model
    replay took 100 s instead of 30 s on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, one_thread) -> Recorded:
    directory = tmp_path_factory.mktemp("record")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("trioserve.engine.TraceWriter", TrackedWriter)
        TrackedWriter.made.clear()
        replies, stats = trio.run(record, directory)
    (writer,) = TrackedWriter.made
    closed = writer._file.closed
    traces = list(directory.iterdir())
    assert len(traces) == 1 and traces[0].suffix == ".jsonl" and traces[0] == writer.path, traces
    return Recorded(traces[0], replies, stats, closed)


def run_replay(monkeypatch, *argv: str) -> tuple[int, str, str]:
    """``trioserve.cli.main(["replay", *argv])``: its exit status, stdout and
    stderr (replay reads sys.stdout and sys.stderr when it runs)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["replay", *argv, "--threads", str(THREADS)])
    return code, out.getvalue(), err.getvalue()


# -- the recorded run ----------------------------------------------------------


def content(reply: Any, index: int = 0) -> str:
    if isinstance(reply, SSE):
        return reply.content(index)
    choice = reply["choices"][index]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def finish(reply: Any, index: int = 0) -> str:
    if isinstance(reply, SSE):
        return [c["finish_reason"] for c in reply.choice_chunks(index) if c.get("finish_reason")][-1]
    return reply["choices"][index]["finish_reason"]


def test_the_recorded_replies_are_sane(recorded):
    replies = recorded.replies
    assert len(replies) == len(requests()) + 1 and len(requests()) + 4 >= 40  # the session sends four turns
    for label, path, body, how in requests():
        reply = replies[label]
        if how == "cut":
            assert isinstance(reply, bytes)
            continue
        if how == "sse":
            assert reply.payloads[-1] == "[DONE]", label
        n = body.get("n", 1)
        for index in range(n):
            assert finish(reply, index) in ("stop", "length", "tool_calls"), (label, index)
        if label.startswith(("greedy", "text-0")):  # greedy answers to plain questions are never empty
            assert content(reply), (label, reply)
        if label.startswith("stop"):
            assert not any(s in content(reply) for s in body["stop"]), (label, content(reply))
        if label.startswith("schema"):
            assert finish(reply) == "stop", (label, content(reply))
            jsonschema.validate(json.loads(content(reply)), COLOR)
        if label.startswith("tool"):
            if isinstance(reply, SSE):
                deltas = [c["delta"] for c in reply.choice_chunks()]
                calls = [call for d in deltas for call in d.get("tool_calls") or []]
            else:
                calls = reply["choices"][0]["message"]["tool_calls"]
            assert finish(reply) == "tool_calls" and len(calls) == 1, (label, reply)
            assert calls[0]["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])
    sampled = [content(replies[label], i) for label, _, body, how in requests() if label.startswith(("sampled", "n2")) for i in range(body.get("n", 1))]
    assert sum(bool(text) for text in sampled) >= len(sampled) - 2, sampled
    # seeded n=2 choices differ from each other (their seeds do)
    assert any(content(replies[f"n2-{k}"], 0) != content(replies[f"n2-{k}"], 1) for k in range(3))

    session = replies["session"]
    assert isinstance(session["turns"][2], bytes) and session["turns"][3].payloads[-1] == "[DONE]"
    state = session["state"]
    assert state["turns"] == 3 and not state["busy"]
    assert [m["role"] for m in state["messages"]] == ["user", "assistant"] * 3
    assert [m["content"] for m in state["messages"][::2]] == list(SESSION_QUESTIONS)
    assert state["messages"][-1]["content"] == session["turns"][3].content()
    sessions = recorded.metrics["sessions"]
    assert sessions["turns_committed"] == 3 and sessions["turns_cancelled"] == 1, sessions


def test_the_trace_records_every_request_and_both_cuts(recorded):
    lines = recorded.trace.read_text().splitlines()
    records = [json.loads(line) for line in lines[1:]]
    submitted = [r["id"] for r in records if r["in"] == "submit"]
    n2 = sum(body.get("n", 1) - 1 for _, _, body, _ in requests())
    assert len(submitted) == len(set(submitted)) == len(requests()) + n2 + 4, len(submitted)
    finals = {e["final"]: e for r in records for e in (r.get("out") or {}).get("events", []) if "final" in e}
    assert set(finals) == set(submitted)
    assert sum(f["reason"] == "cancelled" for f in finals.values()) == 3  # two clients and the cut turn
    assert any(r["in"] == "cancel" for r in records)
    assert any(r["in"] == "settle" and r["order"] == "commit" for r in records)
    assert any(r["in"] == "settle" and r["order"] == "cancel" for r in records)
    assert not any(r["in"] == "die" for r in records)
    greedy = recorded.replies["greedy-0"]["id"] + "-0"  # choice 0's engine request
    text = "".join(e["text"] for r in records for e in (r.get("out") or {}).get("events", []) if e.get("token") == greedy)
    assert text + finals[greedy]["text"] == recorded.replies["greedy-0"]["choices"][0]["message"]["content"]


def test_the_server_closes_its_trace_when_it_stops(recorded):
    assert recorded.closed


# -- replaying it --------------------------------------------------------------


def test_fast_replay_is_identical(recorded, monkeypatch):
    code, out, err = run_replay(monkeypatch, str(recorded.trace))
    assert (code, err) == (0, ""), out + err
    assert "identical" in out and "DIFFERENT" not in out, out


def test_model_replay_is_identical(recorded, monkeypatch):
    code, out, err = run_replay(monkeypatch, str(recorded.trace), "--model")
    assert (code, err) == (0, ""), out + err
    assert "identical" in out and "DIFFERENT" not in out, out
    assert "re-run on the model" in out, out


def edit_one_token(trace: Path, request_id: str, copy: Path) -> tuple[int, int]:
    """Copy ``trace`` to ``copy`` with one sampled token of ``request_id``
    changed: in the first result that gave that request a token event past
    its first. Returns the edited line's number and its step."""
    lines = trace.read_text().splitlines(keepends=True)
    rows: dict[int, list[list]] = {}  # step -> its plan's rows
    seen = 0
    for number, line in enumerate(lines[1:], start=2):
        record = json.loads(line)
        if record["in"] == "plan" and record["out"]["plan"] is not None:
            rows[record["out"]["plan"]["step"]] = record["out"]["plan"]["rows"]
        if record["in"] != "result":
            continue
        tokens = [e for e in record["out"]["events"] if e.get("token") == request_id]
        if not tokens:
            continue
        seen += 1
        if seen < 2:
            continue
        step = record["result"]["step"]
        sampling = [r[0] for r in rows[step] if r[3]]
        row = record["result"]["sampled"][sampling.index(request_id)]
        original = row[0][0]
        assert tokens[0]["id"] == original
        row[0][0] = original + 1 if original >= 1000 else original + 1000  # an ordinary token, not a special one
        lines[number - 1] = json.dumps(record, separators=(",", ":")) + "\n"
        copy.write_text("".join(lines))
        return number, step
    raise AssertionError(f"no result gave {request_id} a second token")


@pytest.mark.parametrize("mode", ["fast", "model"])
def test_an_edited_token_is_found_with_its_request_and_step(recorded, monkeypatch, tmp_path, mode):
    request_id = recorded.replies["greedy-1"]["id"] + "-0"
    edited = tmp_path / "edited.jsonl"
    line, step = edit_one_token(recorded.trace, request_id, edited)
    code, out, err = run_replay(monkeypatch, str(edited), *(["--model"] if mode == "model" else []))
    assert (code, err) == (1, ""), out + err
    report = out.splitlines()[0]
    assert report.startswith("DIFFERENT "), out
    assert f"line {line}," in report and f"step {step}," in report and f"request {request_id}" in report, out
    assert "stopped at the first difference" in out, out


def test_model_replay_is_identical_at_a_narrower_cpu_class(recorded):
    """The default path gives the same bits on every CPU class (#47): the
    trace replays identically in a child process pinned to the C kernels'
    avx2 level and torch's DEFAULT capability, with no fallback to the
    recorded level (TRIOSERVE_REPLAY_PINNED)."""
    import os
    import subprocess
    import sys

    from trioserve.core.replay import PINNED_ENV
    from trioserve.kernels.cpu import level_fits

    if level_fits("avx2"):
        pytest.skip(f"the avx2 level: {level_fits('avx2')}")
    head = json.loads(Path(recorded.trace).read_text().splitlines()[0])
    assert head["sampler"] == "fixed" and head["cpu"]["activations"] == "int8", head["cpu"]
    env = {**os.environ, "TRIOSERVE_CPU_FEATURES": "avx2", "ATEN_CPU_CAPABILITY": "default", PINNED_ENV: "1"}
    done = subprocess.run(
        [sys.executable, "-m", "trioserve", "replay", str(recorded.trace), "--model", "--threads", str(THREADS)],
        env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical" in done.stdout and "DIFFERENT" not in done.stdout, done.stdout
