"""`trioserve replay` on a trace recorded by the real engine (tiny Llama,
GGUF, fp32): a mix of concurrent requests -- greedy and seeded sampling with
logprobs and top logprobs, penalties, a stop string, a shared prefix, an
unseeded request, one guided by a JSON schema, one cancelled early by
leaving its event loop -- then the trace replayed through the CLI.

Checked: the recording replays as identical in fast mode and with --model
(exit 0); a changed recorded token makes both modes exit 1 naming the
request and the step; an unreadable trace (a truncated last line, a corrupt
line, another trace version, another trioserve version, another
checkpoint digest, a missing file) exits 2 with one line naming the line and
no traceback; and --checkpoint finds a checkpoint that moved.

Also: a trace refused after its header was read leaves no file open, and a
renamed copy of the checkpoint (the same bytes) replays."""

from __future__ import annotations

import gc
import json
import shutil
import warnings
from contextlib import aclosing
from pathlib import Path

import pytest
import torch
import trio

from trioserve import cli
from trioserve.config import EngineConfig
from trioserve.core.replay import replay_trace
from trioserve.core.trace import TraceError
from trioserve.engine import Engine, open_engine
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.guided import GuideSpec
from trioserve.types import FinalEvent, GenerateRequest, SamplingParams, TokenEvent

BS = 4
KV_BYTES_PER_TOKEN = 512  # the tiny model in fp32
# read_trace opens the trace and only its records iterator closes it, so a
# trace refused after the header was read (another checkpoint, none where the
# header says) leaves the file to the garbage collector: a ResourceWarning.
# Remove once fixed (test_a_refused_checkpoint_leaves_no_file_open then passes).
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


async def run(engine: Engine, request: GenerateRequest, *, leave_after: int | None = None) -> tuple[list[int], str, FinalEvent | None]:
    """Consume a request; with ``leave_after``, leave its loop after that
    many tokens (which cancels it)."""
    tokens, text, final = [], "", None
    async with aclosing(engine.generate(request)) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
                text += event.text
                if leave_after is not None and len(tokens) >= leave_after:
                    break
            else:
                final = event
                text += event.text
    return tokens, text, final


async def record(path: Path, record_dir: Path) -> dict[str, FinalEvent | None]:
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        kv_cache_bytes=64 * BS * KV_BYTES_PER_TOKEN,
        block_size=BS,
        max_num_seqs=4,
        prefill_budget=12,
        record_dir=str(record_dir),
    )
    ckpt = load_checkpoint(path, dtype=torch.float32)
    finals: dict[str, FinalEvent | None] = {}
    async with open_engine(config, checkpoint=ckpt) as engine:
        tok = engine.tokenizer
        prompt = tok.encode("The quick brown fox")
        other = tok.encode("def add(a, b):")
        # A stop string the seeded request below is sure to meet: part of
        # what it says without one.
        seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=11, logprobs=True, top_logprobs=2)
        _, text, _ = await run(engine, GenerateRequest(prompt, seeded, request_id="probe"))
        stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isprintable())
        (guide,) = engine.guides.guides(GuideSpec("json_schema", SCHEMA), 1)
        requests = [
            (GenerateRequest(prompt, SamplingParams(max_tokens=10, temperature=0.0), request_id="greedy"), None),
            (GenerateRequest(prompt, SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3), request_id="greedy-logprobs"), None),
            (GenerateRequest(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=1, logprobs=True, top_logprobs=2), request_id="seeded"), None),
            (GenerateRequest(other, SamplingParams(max_tokens=9, temperature=1.0, seed=2, top_k=20, top_p=0.9), request_id="top-k-p"), None),
            (GenerateRequest(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=11, logprobs=True, top_logprobs=2, stop=(stop,)), request_id="stop"), None),
            (GenerateRequest(other + prompt, SamplingParams(max_tokens=7, temperature=0.8, seed=3, presence_penalty=0.5, repetition_penalty=1.2), request_id="penalties"), None),
            (GenerateRequest(other, SamplingParams(max_tokens=6, temperature=1.0, min_p=0.05, logit_bias=((35, 5.0),)), request_id="unseeded"), None),
            (GenerateRequest(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=4), request_id="cancelled"), 2),
            (GenerateRequest(prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=5), request_id="guided", guide=guide), None),
            (GenerateRequest(other, SamplingParams(max_tokens=8, temperature=1.0, seed=6, stop_token_ids=(36,), ignore_eos=True), request_id="stop-ids"), None),
        ]

        async def one(request: GenerateRequest, leave_after: int | None) -> None:
            _, _, finals[request.request_id] = await run(engine, request, leave_after=leave_after)

        async with trio.open_nursery() as nursery:
            for request, leave_after in requests:
                nursery.start_soon(one, request, leave_after)
        # The cancelled request ends within a step of being left: wait for it,
        # so the trace holds its end.
        with trio.fail_after(10):
            while engine.statistics().running or engine.statistics().waiting:
                await trio.sleep(0.01)
    return finals


@pytest.fixture(scope="module")
def recorded(tiny_checkpoints, tmp_path_factory) -> tuple[Path, dict[str, FinalEvent | None]]:
    """One trace for the whole module (read-only: tests edit copies)."""
    record_dir = tmp_path_factory.mktemp("record")
    finals = trio.run(record, tiny_checkpoints["gguf_f32"], record_dir)
    (trace,) = record_dir.iterdir()
    return trace, finals


def replay(capsys, trace: Path, *flags: str) -> tuple[int, str, str]:
    status = cli.main(["replay", str(trace), *flags])
    out, err = capsys.readouterr()
    return status, out, err


def lines_of(trace: Path) -> list[str]:
    return trace.read_text().splitlines(keepends=True)


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(lines))
    return path


def test_the_recorded_mix(recorded):
    """The run this module replays has what it is meant to have."""
    trace, finals = recorded
    assert finals["stop"].finish_reason == "stop"
    assert finals["guided"].finish_reason == "stop"
    assert finals["cancelled"] is None  # its consumer left before the end
    # The unseeded request's seed differs every run: it may meet EOS.
    assert {f.finish_reason for name, f in finals.items() if name not in ("stop", "guided", "cancelled", "stop-ids", "unseeded")} == {"length"}
    records = [json.loads(line) for line in lines_of(trace)[1:]]
    submitted = {r["id"]: r["request"] for r in records if r["in"] == "submit"}
    assert set(submitted) == {"probe", *finals}
    assert submitted["guided"]["guide"] == {"kind": "json_schema", "spec": SCHEMA, "field": "response_format"}
    assert submitted["unseeded"]["params"]["seed"] is not None  # resolved at the engine's edge
    ended = {e["final"]: e["reason"] for r in records for e in (r.get("out") or {}).get("events", []) if "final" in e}
    assert ended["cancelled"] == "cancelled"
    assert any(r["in"] == "cancel" and r["id"] == "cancelled" for r in records)
    assert len(ended) == len(submitted)


@pytest.mark.parametrize("flags", [(), ("--model",)], ids=["fast", "model"])
def test_the_recording_replays_identically(recorded, capsys, flags):
    trace, _ = recorded
    status, out, err = replay(capsys, trace, *flags)
    assert (status, err) == (0, ""), out + err
    assert "identical" in out
    assert "11 requests" in out
    if flags:
        assert "re-run on the model" in out


def tamper_token(trace: Path, dest: Path) -> tuple[Path, str, int]:
    """A copy of ``trace`` with the first recorded sampled token that gave a
    token event changed; returns it, that request and that step."""
    lines = lines_of(trace)
    plans: dict[int, list] = {}
    for number, line in enumerate(lines[1:], start=1):
        record = json.loads(line)
        if record["in"] == "plan" and record["out"]["plan"] is not None:
            plans[record["out"]["plan"]["step"]] = record["out"]["plan"]["rows"]
        tokens = [e for e in (record.get("out") or {}).get("events", []) if "token" in e]
        if record["in"] != "result" or not tokens:
            continue
        rid, token, step = tokens[0]["token"], tokens[0]["id"], record["result"]["step"]
        sampling = [row[0] for row in plans[step] if row[3]]
        row = record["result"]["sampled"][sampling.index(rid)]
        row[[s[0] for s in row].index(token)][0] = 4 if token == 3 else 3  # "%" or "!": plain text
        lines[number] = json.dumps(record, separators=(",", ":")) + "\n"
        return write(dest, lines), rid, step
    raise AssertionError("the trace has no token event")


@pytest.mark.parametrize("flags", [(), ("--model",)], ids=["fast", "model"])
def test_a_changed_token_is_a_difference(recorded, capsys, tmp_path, flags):
    trace, _ = recorded
    tampered, rid, step = tamper_token(trace, tmp_path / "tampered.jsonl")
    status, out, err = replay(capsys, tampered, *flags)
    assert (status, err) == (1, ""), out + err
    first = out.splitlines()[0]
    assert first.startswith("DIFFERENT")
    assert f"step {step}" in first and f"request {rid}" in first
    assert "stopped at the first difference" in out


def truncated(lines: list[str]) -> tuple[list[str], int]:
    return [*lines[:-1], lines[-1][: len(lines[-1]) // 2]], len(lines)


def corrupt_json(lines: list[str]) -> tuple[list[str], int]:
    k = len(lines) // 2
    return [*lines[: k - 1], '{"in": "plan", "now": \n', *lines[k:]], k


def corrupt_record(lines: list[str]) -> tuple[list[str], int]:
    k = len(lines) // 2
    return [*lines[: k - 1], '{"in": "result", "now": 1.0}\n', *lines[k:]], k


def header_with(**changes):
    def edit(lines: list[str]) -> tuple[list[str], int]:
        head = json.loads(lines[0])
        for key, value in changes.items():
            if key == "digest":
                head["checkpoint"]["digest"] = value
            else:
                head[key] = value
        return [json.dumps(head) + "\n", *lines[1:]], 1

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (truncated, "truncated"),
        (corrupt_json, "not valid JSON"),
        (corrupt_record, "corrupt record"),
        (header_with(version=2), "trace format version 2"),
        (header_with(trioserve="0.0.1"), "recorded by trioserve 0.0.1"),
        pytest.param(header_with(digest="sha256:" + "0" * 64), "recorded with checkpoint sha256:000"),
    ],
    ids=["truncated-last-line", "corrupt-json", "corrupt-record", "trace-version", "trioserve-version", "checkpoint-digest"],
)
def test_an_unreplayable_trace_is_one_line_and_exit_2(recorded, capsys, tmp_path, edit, message):
    trace, _ = recorded
    lines, line = edit(lines_of(trace))
    bad = write(tmp_path / "bad.jsonl", lines)
    status, out, err = replay(capsys, bad)
    assert status == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"trioserve replay: error: {bad}:{line}: ")
    assert message in err
    assert "Traceback" not in err


def test_a_corrupt_line_stops_model_mode_too(recorded, capsys, tmp_path):
    trace, _ = recorded
    lines, line = corrupt_json(lines_of(trace))
    status, out, err = replay(capsys, write(tmp_path / "bad.jsonl", lines), "--model")
    assert status == 2
    assert len(err.splitlines()) == 1 and f"bad.jsonl:{line}: not valid JSON" in err, err


def test_a_refused_checkpoint_leaves_no_file_open(recorded, tmp_path):
    trace, _ = recorded
    lines, _ = header_with(digest="sha256:" + "0" * 64)(lines_of(trace))
    bad = write(tmp_path / "bad.jsonl", lines)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            replay_trace(bad)
        except TraceError as exc:
            assert exc.line == 1
        else:
            raise AssertionError("a trace for another checkpoint replayed")
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_a_missing_trace_is_one_line_and_exit_2(capsys, tmp_path):
    missing = tmp_path / "absent.jsonl"
    status, out, err = replay(capsys, missing)
    assert status == 2
    assert err.splitlines() == [f"trioserve replay: error: {missing}:0: cannot open the trace: No such file or directory"]


def relocate(trace: Path, tmp_path: Path, checkpoint: Path, name: str) -> tuple[Path, Path]:
    """A copy of ``checkpoint`` elsewhere, named ``name``, and a copy of
    ``trace`` whose header names a path where there is nothing now."""
    moved = tmp_path / "elsewhere" / name
    moved.parent.mkdir()
    shutil.copyfile(checkpoint, moved)
    lines = lines_of(trace)
    head = json.loads(lines[0])
    head["checkpoint"]["path"] = str(tmp_path / "gone" / checkpoint.name)
    return moved, write(tmp_path / "relocated.jsonl", [json.dumps(head) + "\n", *lines[1:]])


@pytest.mark.parametrize("flags", [(), ("--model",)], ids=["fast", "model"])
def test_checkpoint_flag_finds_a_moved_checkpoint(recorded, capsys, tmp_path, tiny_checkpoints, flags):
    trace, _ = recorded
    checkpoint = tiny_checkpoints["gguf_f32"]
    moved, relocated = relocate(trace, tmp_path, checkpoint, checkpoint.name)

    status, out, err = replay(capsys, relocated, *flags)
    assert status == 2
    assert len(err.splitlines()) == 1 and "relocated.jsonl:1: the recorded checkpoint cannot be read" in err, err
    assert "--checkpoint" in err

    status, out, err = replay(capsys, relocated, *flags, "--checkpoint", str(moved))
    assert (status, err) == (0, ""), out + err
    assert "identical" in out


def test_checkpoint_flag_finds_a_renamed_checkpoint(recorded, capsys, tmp_path, tiny_checkpoints):
    """docs/replay.md: --checkpoint says where the checkpoint is now; it must
    still be the same bytes (nothing about its name)."""
    trace, _ = recorded
    moved, relocated = relocate(trace, tmp_path, tiny_checkpoints["gguf_f32"], "renamed.gguf")
    status, out, err = replay(capsys, relocated, "--checkpoint", str(moved))
    assert (status, err) == (0, ""), out + err
