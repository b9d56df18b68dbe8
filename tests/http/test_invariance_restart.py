"""Batch invariance as a client meets it (issue #11, docs/determinism.md),
with the tiny model served in bfloat16 from its 4-bit GGUF (the served
bf16 + 4-bit path): a seeded temperature-1 request's output -- text,
finish reason, every token's logprob and alternatives, usage -- does not
change when the server restarts with the same settings, nor with what else
runs beside it (alone on one server, among random traffic on the other),
nor with whether it is streamed. Also: `--no-batch-invariant` is reported
as such by /v1/models, /metrics and Prometheus, and a bad
TRIOSERVE_BATCH_INVARIANT is refused with one clear line.

The helpers here (`Outcome`, `send`, `crowd_request`) also serve
tests/http/test_real_invariance.py."""

from __future__ import annotations

import random
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import MODEL_NAME, SSE, eventually, kv_bytes, make_settings, metrics, parse_sse_lines, read_sse, start_server
from tests.test_cli import run_cli
from trioserve import cli
from trioserve.config import EngineConfig, ServerSettings, settings_from_env

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
TIMEOUT = 60.0


# -- one response, whatever its kind, reduced to what must not change --------------------------


@attrs.frozen
class Outcome:
    """What a request said: its text, finish reason, completion tokens and
    per-token logprobs (each token's own, with its alternatives), the same
    for a buffered and a streamed response. Completion ``text_offset`` is
    left out: it says where a token sits in the text, not what was drawn."""

    text: str
    finish_reason: str | None
    completion_tokens: int
    logprobs: tuple

    def differences(self, other: Outcome) -> str:
        """Where ``other`` first differs, in words; "" when identical."""
        out = []
        if self.text != other.text:
            out.append(f"text {self.text!r} vs {other.text!r}")
        if self.finish_reason != other.finish_reason:
            out.append(f"finish_reason {self.finish_reason!r} vs {other.finish_reason!r}")
        if self.completion_tokens != other.completion_tokens:
            out.append(f"completion_tokens {self.completion_tokens} vs {other.completion_tokens}")
        if self.logprobs != other.logprobs:
            if len(self.logprobs) != len(other.logprobs):
                out.append(f"{len(self.logprobs)} vs {len(other.logprobs)} logprob entries")
            for i, (a, b) in enumerate(zip(self.logprobs, other.logprobs)):
                if a != b:
                    out.append(f"first differing token #{i}: {a!r} vs {b!r}")
                    break
        return "; ".join(out)


def _chat_entries(entries: list[dict]) -> tuple:
    return tuple(
        (e["token"], tuple(e["bytes"]), e["logprob"], tuple((t["token"], tuple(t["bytes"]), t["logprob"]) for t in e["top_logprobs"]))
        for e in entries
    )


def _text_entries(lp: dict) -> tuple:
    return tuple((tok, value, tuple(sorted(top.items()))) for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))


def outcome_of_json(path: str, body: dict) -> Outcome:
    assert len(body["choices"]) == 1, body
    choice = body["choices"][0]
    if path == CHAT:
        text = choice["message"]["content"] or ""
        entries = _chat_entries(choice["logprobs"]["content"]) if choice["logprobs"] is not None else ()
    else:
        text = choice["text"]
        entries = _text_entries(choice["logprobs"]) if choice["logprobs"] is not None else ()
    return Outcome(text, choice["finish_reason"], body["usage"]["completion_tokens"], entries)


def outcome_of_sse(path: str, sse) -> Outcome:
    assert sse.payloads and sse.payloads[-1] == "[DONE]", sse.payloads[-3:]
    errors = [c for c in sse.chunks if "error" in c]
    assert not errors, errors
    choices = sse.choice_chunks(0)
    finishes = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    assert len(finishes) == 1, finishes
    entries: list = []
    for c in choices:
        if c.get("logprobs") is None:
            continue
        if path == CHAT:
            entries.extend(_chat_entries(c["logprobs"]["content"]))
        else:
            entries.extend(_text_entries(c["logprobs"]))
    usage = [c["usage"] for c in sse.chunks if c.get("usage")]
    assert len(usage) == 1, f"expected one usage chunk (stream_options.include_usage), got {usage}"
    return Outcome(sse.content(0), finishes[0], usage[0]["completion_tokens"], tuple(entries))


async def send(client: httpx.AsyncClient, path: str, body: dict, stream: bool, started: trio.Event | None = None) -> Outcome:
    """POST ``body`` buffered or streamed (with usage); its Outcome.
    ``started`` is set once a streamed response's first chunk arrives (or
    a buffered one's answer)."""
    if not stream:
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text[:500]
        if started is not None:
            started.set()
        return outcome_of_json(path, response.json())
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, (await response.aread()).decode()[:500]
        if started is None:
            return outcome_of_sse(path, await read_sse(response))
        # read_sse's strict parsing, but note the first data line as it comes.
        lines: list[str] = []
        async for line in response.aiter_lines():
            lines.append(line)
            if line.startswith("data: "):
                started.set()
        return outcome_of_sse(path, SSE(parse_sse_lines(lines)))


WORDS = (
    "the quick brown fox jumps over lazy dog server model token river mountain city number seven "
    "green blue cloud rain sun moon star tree house code data table chair window music story"
).split()


def crowd_request(rng: random.Random, *, max_words: int, max_tokens: tuple[int, int], long_share: float = 0.3, long: bool = False) -> tuple[str, dict, bool]:
    """A random request for the traffic around the targets: (path, body,
    stream). Random prompt length, route, temperature (greedy, seeded or
    unseeded sampling), max_tokens, logprobs; some (all when ``long``,
    which are also streamed) ignore EOS so that they run their whole
    length."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
    lo, hi = max_tokens
    body: dict[str, Any] = {"max_tokens": rng.randint(lo, hi)}
    if long or rng.random() < long_share:
        body |= {"max_tokens": hi, "ignore_eos": True}
    kind = rng.random()
    if kind < 0.3:
        body["temperature"] = 0
    elif kind < 0.7:
        body |= {"temperature": rng.choice([0.7, 1.0, 1.3]), "seed": rng.randint(0, 2**31)}
    else:
        body["temperature"] = 1.0  # unseeded: the server draws a seed
    if rng.random() < 0.3:
        body["logprobs"] = True
    if rng.random() < 0.25:
        path = TEXT
        body["prompt"] = words
        if body.pop("logprobs", False):
            body["logprobs"] = 2
    else:
        path = CHAT
        body["messages"] = [{"role": "user", "content": words}]
    return path, body, long or rng.random() < 0.5


async def idle(client: httpx.AsyncClient) -> str | None:
    """None when nothing runs or waits in the engine (for `eventually`)."""
    m = await metrics(client)
    return None if m["running"] == 0 and m["waiting"] == 0 else f"running {m['running']}, waiting {m['waiting']}"


async def running_at_least(client: httpx.AsyncClient, n: int) -> str | None:
    m = await metrics(client)
    return None if m["running"] >= n else f"running {m['running']}, waiting {m['waiting']}"


async def models_card(client: httpx.AsyncClient) -> dict:
    response = await client.get("/v1/models")
    assert response.status_code == 200, response.text
    (card,) = response.json()["data"]
    return card


async def prometheus_gauge(client: httpx.AsyncClient, name: str) -> float:
    response = await client.get("/metrics/prometheus")
    assert response.status_code == 200, response.text
    # One model served: one sample, labelled with it (`name{model="..."} value`).
    values = [line.rsplit(" ", 1)[1] for line in response.text.splitlines() if line.startswith(f"{name}{{model=")]
    assert len(values) == 1, f"{name}: {values} in\n{response.text}"
    return float(values[0])


async def assert_mode(client: httpx.AsyncClient, invariant: bool) -> None:
    """/v1/models, /metrics and /metrics/prometheus all say ``invariant``."""
    card = await models_card(client)
    assert card["batch_invariant"] is invariant, card
    assert (await metrics(client))["batch_invariant"] is invariant
    assert await prometheus_gauge(client, "trioserve_batch_invariant") == (1.0 if invariant else 0.0)


# -- restart: same settings, same outputs -------------------------------------------------------

MAX_NUM_SEQS = 8
LONG_NOTE = (
    "A small museum keeps maps, ropes and a bell from a ship that sank long ago; "
    "the road winds through fields of barley and wild flowers to the next town."
)


def _target(path: str, **body: Any) -> tuple[str, dict]:
    """A request whose output must not change: seeded, temperature 1, with
    logprobs and three alternatives per token."""
    body |= {"temperature": 1.0, "model": MODEL_NAME}
    body |= {"logprobs": True, "top_logprobs": 3} if path == CHAT else {"logprobs": 3}
    return path, body


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# Most ignore EOS so that every token of the length is compared.
TARGETS: list[tuple[str, dict]] = [
    _target(CHAT, messages=_user("Tell me about the quick brown fox."), seed=11, max_tokens=24, ignore_eos=True),
    _target(CHAT, messages=_user("hi"), seed=12, max_tokens=20),
    _target(CHAT, messages=[{"role": "system", "content": "Be brief."}, *_user("What does a server do?")], seed=13, max_tokens=24, ignore_eos=True),
    _target(CHAT, messages=_user("Numbers like 2024 and 3.14159"), seed=-14, max_tokens=16, ignore_eos=True),
    _target(CHAT, messages=_user("def add(a, b): " * 6), seed=15, max_tokens=24, ignore_eos=True),
    _target(CHAT, messages=_user("The café serves crème brûlée."), seed=16, max_tokens=24, ignore_eos=True),
    _target(TEXT, prompt="In the morning the server starts, reads its model", seed=17, max_tokens=24, ignore_eos=True),
    _target(TEXT, prompt="A tokenizer turns text into numbers", seed=18, max_tokens=20, ignore_eos=True),
    # ~100 prompt tokens: cut into chunks at other places alone and among the crowd.
    _target(CHAT, messages=_user(LONG_NOTE), seed=19, max_tokens=24, ignore_eos=True),
]


def restart_settings(tiny_checkpoints) -> ServerSettings:
    settings = make_settings(
        tiny_checkpoints["gguf_q4_1"], max_num_seqs=MAX_NUM_SEQS, prefill_budget=40, kv_cache_bytes=kv_bytes(2 * MAX_NUM_SEQS * 256)
    )
    settings = attrs.evolve(settings, engine=attrs.evolve(settings.engine, dtype="bfloat16"))
    assert settings.engine.batch_invariant is True  # the default under test
    return settings


async def serve_targets(settings: ServerSettings, *, crowded: set[int], streamed: set[int], crowd_seed: int) -> tuple[dict[int, Outcome], int]:
    """Start a server with ``settings``; send the targets not in
    ``crowded`` one at a time on an idle server, then those in ``crowded``
    while random traffic (from ``crowd_seed``) runs; stop the server.
    Returns the outcomes by target index and the most requests /metrics
    saw running while the crowded targets ran."""
    rng = random.Random(crowd_seed)
    outcomes: dict[int, Outcome] = {}
    busiest = 0
    async with trio.open_nursery() as server:
        url = await start_server(server, settings)
        with trio.fail_after(120):
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
                await assert_mode(client, True)
                for k, (path, body) in enumerate(TARGETS):
                    if k in crowded:
                        continue
                    await eventually(lambda: idle(client), timeout=10, what="an idle engine")
                    outcomes[k] = await send(client, path, body, k in streamed)

                # The crowd: a few that last (ignore EOS, long) and random others.
                crowd = [crowd_request(rng, max_words=25, max_tokens=(4, 100), long=i < 2) for i in range(MAX_NUM_SEQS - 2)]
                crowd_started = [trio.Event() for _ in crowd]
                crowd_ended: list[float] = []
                spans: dict[int, tuple[float, float]] = {}

                async def run_crowd(i: int) -> None:
                    path, body, stream = crowd[i]
                    await send(client, path, body, stream, crowd_started[i])
                    crowd_ended.append(trio.current_time())

                async def run_target(k: int, delay: float) -> None:
                    await trio.sleep(delay)
                    begin = trio.current_time()
                    path, body = TARGETS[k]
                    outcomes[k] = await send(client, path, body, k in streamed)
                    spans[k] = (begin, trio.current_time())

                async def watch(done: trio.Event) -> None:
                    nonlocal busiest
                    while not done.is_set():
                        busiest = max(busiest, (await metrics(client))["running"])
                        await trio.sleep(0.005)

                async with trio.open_nursery() as traffic:
                    for i in range(len(crowd)):
                        traffic.start_soon(run_crowd, i)
                    # The long ones stream, and the engine runs several, before any target goes.
                    for event in crowd_started[:2]:
                        await event.wait()
                    await eventually(lambda: running_at_least(client, 3), timeout=10, what="3 crowd requests running")
                    targets_done = trio.Event()
                    traffic.start_soon(watch, targets_done)
                    async with trio.open_nursery() as targets:
                        for k in sorted(crowded):
                            targets.start_soon(run_target, k, rng.uniform(0, 0.05))
                    targets_done.set()
                    last_target = max(end for _, end in spans.values())
                    # Traffic was still going when the last target finished.
                    still_running = len(crowd) - sum(1 for t in crowd_ended if t <= last_target)
                    assert still_running >= 1, "the crowd was over before the crowded targets finished"
        server.cancel_scope.cancel()
    return outcomes, busiest


async def test_outputs_survive_a_restart_and_any_company(tiny_checkpoints, slow_steps):
    """The same seeded temperature-1 requests on two fresh servers with the
    same settings: on the first, half go alone and half among random
    traffic; on the second, the other way round, among other traffic, with
    streamed and buffered swapped. Every output is identical, to the last
    logprob."""
    slow_steps(0.004)  # the crowd outlasts the targets; the steps are the real ones
    settings = restart_settings(tiny_checkpoints)
    n = len(TARGETS)
    half = set(range(0, n, 2))
    first, busy_first = await serve_targets(settings, crowded=half, streamed=set(range(n // 2)), crowd_seed=1)
    second, busy_second = await serve_targets(settings, crowded=set(range(n)) - half, streamed=set(range(n // 2, n)), crowd_seed=2)
    assert busy_first >= 3 and busy_second >= 3, (busy_first, busy_second)

    assert set(first) == set(second) == set(range(n))
    differ = {k: first[k].differences(second[k]) for k in range(n) if first[k] != second[k]}
    assert not differ, "outputs changed across the restart:\n" + "\n".join(f"target {k} {TARGETS[k]}: {why}" for k, why in differ.items())
    for k, outcome in first.items():  # each compared something
        # Every completion token has its logprob entry, an EOS that stopped the text too (issue #48).
        assert outcome.completion_tokens > 0 and len(outcome.logprobs) == outcome.completion_tokens, (k, outcome)
        if TARGETS[k][1].get("ignore_eos"):
            assert outcome.completion_tokens == TARGETS[k][1]["max_tokens"] and outcome.finish_reason == "length", (k, outcome)
    # Sampling at temperature 1 really sampled: the seeds gave different draws.
    assert len({o.text for o in first.values()}) == n


# -- the mode is reported; a bad setting is refused ----------------------------------------------


async def test_no_batch_invariant_is_reported_everywhere(nursery, tiny_checkpoints):
    url = await start_server(nursery, make_settings(tiny_checkpoints["gguf_f32"], batch_invariant=False))
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            await assert_mode(client, False)
            # Still serves.
            response = await client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True})
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4, response.text


async def test_default_is_reported_batch_invariant(nursery, tiny_checkpoints):
    url = await start_server(nursery, make_settings(tiny_checkpoints["gguf_f32"]))
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            await assert_mode(client, True)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_bad_env_value_is_one_error_line_and_exit_2(command, tiny_checkpoints):
    """TRIOSERVE_BATCH_INVARIANT=maybe: `trioserve serve` / `generate` say
    so in one line naming the variable and the value, exit 2, and load and
    bind nothing."""
    args = ["--model", str(tiny_checkpoints["gguf_f32"])]
    args += ["--port", "0"] if command == "serve" else ["--prompt", "hi", "--max-tokens", "2"]
    proc = run_cli(command, *args, env={"TRIOSERVE_BATCH_INVARIANT": "maybe"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr  # nothing loaded first (no progress bar)
    line = lines[0]
    assert line.startswith("trioserve: error: "), line
    for fragment in ("TRIOSERVE_BATCH_INVARIANT", "'maybe'", "true or false"):
        assert fragment in line, (fragment, line)
    assert proc.stdout == ""


def test_bad_env_value_for_hypercorn_names_the_variable(monkeypatch):
    """The `hypercorn 'trioserve.http.app:create_app()'` path reads the same
    variable through settings_from_env: a ValueError naming it."""
    with pytest.raises(ValueError, match=r"TRIOSERVE_BATCH_INVARIANT.*true or false.*'maybe'"):
        settings_from_env({"TRIOSERVE_BATCH_INVARIANT": "maybe"})
    from trioserve.http.app import create_app

    monkeypatch.setenv("TRIOSERVE_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="TRIOSERVE_BATCH_INVARIANT"):
        create_app()
    assert settings_from_env({"TRIOSERVE_BATCH_INVARIANT": "off"}).engine.batch_invariant is False
    assert settings_from_env({}).engine.batch_invariant is True


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ([], None, True),
        ([], "0", False),
        ([], "off", False),
        ([], "yes", True),
        (["--no-batch-invariant"], None, False),
        (["--no-batch-invariant"], "1", False),  # the flag wins over the variable
        (["--batch-invariant"], "0", True),
    ],
)
def test_serve_mode_from_flag_and_env(flags, env, expected, monkeypatch):
    """What `trioserve serve` would run with (run_server is caught before it binds)."""
    seen: list[ServerSettings] = []
    monkeypatch.setattr("trioserve.http.serve.run_server", lambda settings: seen.append(settings) or 0)
    if env is None:
        monkeypatch.delenv("TRIOSERVE_BATCH_INVARIANT", raising=False)
    else:
        monkeypatch.setenv("TRIOSERVE_BATCH_INVARIANT", env)
    assert cli.main(["serve", "--port", "0", *flags]) == 0
    (settings,) = seen
    assert settings.engine.batch_invariant is expected
    assert isinstance(settings.engine, EngineConfig)
