"""`trioserve replay` of a run with embedding requests in it (tiny Llama,
GGUF, fp32): mean- and last-pooled embeddings sharing steps with two
generations, and an embedding cancelled mid-prefill.

Checked: the trace records each embedding's pooling, its steps' pooled sums
and its vector; it replays as identical in fast mode and with --model; and
a changed pooled sum is a difference in both modes (fast: the request's
final event; model: the step's result)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio

from tests.core.test_replay import lines_of, replay, run, write
from trioserve.config import EngineConfig
from trioserve.engine import Engine, open_engine
from trioserve.models.checkpoint import load_checkpoint
from trioserve.types import FinalEvent, GenerateRequest, SamplingParams

BS = 4
KV_BYTES_PER_TOKEN = 512  # the tiny model in fp32
EMBED = SamplingParams(max_tokens=1, temperature=0.0, seed=0)


async def embed_with(engine: Engine, request: GenerateRequest) -> FinalEvent:
    async with engine.open_generation(request) as events:
        return [event async for event in events][-1]


async def record(path: Path, record_dir: Path) -> dict[str, FinalEvent]:
    config = EngineConfig(
        model=str(path), dtype="float32", kv_cache_bytes=128 * BS * KV_BYTES_PER_TOKEN, block_size=BS,
        max_num_seqs=4, prefill_budget=12, record_dir=str(record_dir),
    )  # fmt: skip
    finals: dict[str, FinalEvent] = {}
    async with open_engine(config, checkpoint=load_checkpoint(path, dtype=torch.float32)) as engine:
        tok = engine.tokenizer
        text = tok.encode("The quick brown fox jumps over the lazy dog", special=False)

        async def mean() -> None:
            finals["mean"] = await engine.embed(text, request_id="mean")

        async def last() -> None:
            finals["last"] = await embed_with(engine, GenerateRequest(text, EMBED, request_id="last", pooling="last"))

        async def generate(name: str, seed: int) -> None:
            request = GenerateRequest(text[:9], SamplingParams(max_tokens=30, temperature=1.0, seed=seed), request_id=name)
            finals[name] = (await run(engine, request))[2]

        cancel_long = trio.CancelScope()

        async def cancelled() -> None:
            with cancel_long:
                finals["cancelled"] = await engine.embed([5 + j % 300 for j in range(200)], request_id="cancelled")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate, "gen-1", 1)
            nursery.start_soon(generate, "gen-2", 2)
            while engine.statistics().generated_tokens < 2:  # both decode: the embeddings share their steps
                await trio.sleep(0)
            async with trio.open_nursery() as embeddings:
                embeddings.start_soon(mean)
                embeddings.start_soon(last)
            nursery.start_soon(cancelled)
            # Leave the long one once 20 of its 200 tokens are in.
            while engine.statistics().prompt_tokens < 2 * 9 + 2 * len(text) + 20:
                await trio.sleep(0)
            cancel_long.cancel()
        with trio.fail_after(10):
            while engine.statistics().running or engine.statistics().waiting:
                await trio.sleep(0.01)
    return finals


@pytest.fixture(scope="module")
def recorded(tiny_checkpoints, tmp_path_factory) -> tuple[Path, dict[str, FinalEvent]]:
    record_dir = tmp_path_factory.mktemp("record-embeddings")
    finals = trio.run(record, tiny_checkpoints["gguf_f32"], record_dir)
    (trace,) = record_dir.iterdir()
    return trace, finals


def test_the_trace_records_embeddings(recorded):
    trace, finals = recorded
    assert "cancelled" not in finals  # its consumer left before the end
    assert finals["mean"].embedding != finals["last"].embedding
    records = [json.loads(line) for line in lines_of(trace)[1:]]
    pooling = {r["id"]: r["request"].get("pooling") for r in records if r["in"] == "submit"}
    assert pooling == {"mean": "mean", "last": "last", "cancelled": "mean", "gen-1": None, "gen-2": None}
    ended = {e["final"]: e for r in records for e in (r.get("out") or {}).get("events", []) if "final" in e}
    assert ended["cancelled"]["reason"] == "cancelled" and "embedding" not in ended["cancelled"]
    for name in ("mean", "last"):
        assert ended[name]["embedding"] == list(finals[name].embedding)
    assert "embedding" not in ended["gen-1"]
    assert any("pooled" in r["result"] and "sampled" in r["result"] for r in records if r["in"] == "result"), "no step shared"


@pytest.mark.parametrize("flags", [(), ("--model",)], ids=["fast", "model"])
def test_a_recording_with_embeddings_replays_identically(recorded, capsys, flags):
    trace, _ = recorded
    status, out, err = replay(capsys, trace, *flags)
    assert (status, err) == (0, ""), out + err
    assert "identical" in out and "5 requests" in out


@pytest.mark.parametrize(("flags", "what"), [((), "output"), (("--model",), "step result")], ids=["fast", "model"])
def test_a_changed_pooled_sum_is_a_difference(recorded, capsys, tmp_path, flags, what):
    trace, _ = recorded
    lines = lines_of(trace)
    for number, line in enumerate(lines[1:], start=1):
        record = json.loads(line)
        if record["in"] == "result" and "pooled" in record["result"]:
            record["result"]["pooled"][0][0] += 1 << 30
            lines[number] = json.dumps(record, separators=(",", ":")) + "\n"
            step = record["result"]["step"]
            break
    status, out, err = replay(capsys, write(tmp_path / "tampered.jsonl", lines), *flags)
    assert (status, err) == (1, ""), out + err
    first = out.splitlines()[0]
    assert first.startswith(f"DIFFERENT {what}"), first
    if flags:
        assert f"step {step}" in first
