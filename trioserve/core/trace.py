"""Recording an engine run at its one boundary: the EngineCore's inputs.

A trace is one JSON Lines file per server run. Its first line is a header:
the trace format version, the trioserve version, the checkpoint's identity
(its path and the SHA-256 of its bytes) and the settings the core was built
with. Every later line is one call into the core, in the order it was
made, with the time its caller read and what the core returned:

    {"in": "submit", "now": 12.5, "id": "chatcmpl-1-0", "request": {...}, "out": null}
    {"in": "cancel", "now": 12.6, "id": "chatcmpl-1-0"}
    {"in": "settle", "now": 12.6, "owner": "sess-1", "order": "commit", "id": "chatcmpl-1-0"}
    {"in": "plan", "now": 12.7, "out": {"events": [...], "plan": {"step": 3, "rows": [...]}}}
    {"in": "result", "now": 12.72, "result": {"step": 3, "sampled": [...]}, "out": {"events": [...]}}
    {"in": "die", "now": 13.0, "cause": "...", "out": {"events": [...]}}

An embedding request's submission carries "pooling"; a step's result
carries "pooled" (its pooling rows' fixed-point sums, exact integers), and
the request's final event its "embedding", so replays check those too.
A request that scores its prompt carries "prompt_logprobs" in its params
(absent otherwise); a step's result then carries "scored" (each scoring
row's [token, logprob, rank, top] per scored position) and the request's
prompt event ({"prompt": id, "logprobs": [...]}) is an output like the others.

Because the core is deterministic, feeding the same inputs to a fresh core
gives the same outputs (core/replay.py checks it, byte for byte), and
re-running each planned step on the model must give the recorded result.
docs/replay.md describes every field."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from trioserve import __version__
from trioserve.core.engine_core import CoreSettings, EngineCore
from trioserve.errors import TrioserveError
from trioserve.types import (
    Event,
    FinalEvent,
    GenerateRequest,
    PromptEvent,
    PromptLogprob,
    Sampled,
    SamplingParams,
    StepPlan,
    StepResult,
)

TRACE_FORMAT = "trioserve-trace"
TRACE_VERSION = 1


class TraceError(TrioserveError):
    """A trace that cannot be replayed: unreadable, truncated, corrupt, or
    from another version or checkpoint. ``str()`` is one line naming the
    line of the file."""

    def __init__(self, path: str | Path, line: int, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        super().__init__(f"{self.path}:{line}: {problem}")


# -- encoding -----------------------------------------------------------------
def dumps(value: Any) -> str:
    """One line of JSON, the same bytes for the same value every time."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def params_json(params: SamplingParams) -> dict:
    out = attrs.asdict(params, recurse=False)
    out["logit_bias"] = [list(pair) for pair in params.logit_bias]
    out["stop"] = list(params.stop)
    out["stop_token_ids"] = list(params.stop_token_ids)
    if params.prompt_logprobs is None:  # absent, as before the field existed
        del out["prompt_logprobs"]
    return out


def params_from_json(data: dict) -> SamplingParams:
    data = dict(data)
    data["logit_bias"] = tuple((int(t), float(b)) for t, b in data["logit_bias"])
    data["stop"] = tuple(data["stop"])
    data["stop_token_ids"] = tuple(data["stop_token_ids"])
    return SamplingParams(**data)


def request_json(request: GenerateRequest) -> dict:
    guide = None
    if request.guide is not None:
        spec = request.guide.spec
        guide = {"kind": spec.kind, "spec": list(spec.spec) if isinstance(spec.spec, tuple) else spec.spec, "field": spec.field}
    out = {
        "prompt_ids": list(request.prompt_ids),
        "params": params_json(request.params),
        "draw_start": request.draw_start,
        "retain": request.retain,
        "guide": guide,
    }
    if request.pooling is not None:  # an embedding request (absent otherwise, as before it existed)
        out["pooling"] = request.pooling
    if request.adapter is not None:  # a LoRA adapter's request (absent otherwise, as before adapters existed)
        out["adapter"] = request.adapter
    if request.cache_salt is not None:  # a salted request (absent otherwise, as before salts existed)
        out["cache_salt"] = request.cache_salt
    if request.tenant is not None:  # a tenant's request (absent otherwise, as before tenants existed)
        out["tenant"] = request.tenant
    return out


def request_from_json(data: dict, compile_guide: Callable[[dict], Any]) -> GenerateRequest:
    guide = compile_guide(data["guide"]) if data["guide"] is not None else None
    return GenerateRequest(
        tuple(data["prompt_ids"]),
        params_from_json(data["params"]),
        draw_start=data["draw_start"],
        retain=data["retain"],
        guide=guide,
        pooling=data.get("pooling"),
        adapter=data.get("adapter"),
        cache_salt=data.get("cache_salt"),
        tenant=data.get("tenant"),
    )


def refusal_json(refusal: BaseException | None) -> dict | None:
    if refusal is None:
        return None
    return {"error": type(refusal).__name__, "message": str(refusal)}


def event_json(event: Event) -> dict:
    if isinstance(event, PromptEvent):
        return {"prompt": event.request_id, "logprobs": [scored_json(p) for p in event.logprobs]}
    if isinstance(event, FinalEvent):
        t = event.timings
        out = {
            "final": event.request_id,
            "reason": event.finish_reason,
            "prompt_tokens": event.usage.prompt_tokens,
            "completion_tokens": event.usage.completion_tokens,
            "seed": event.seed,
            "text": event.text,
            "error": event.error,
            "draw_end": event.draw_end,
            "timings": None if t is None else [t.queue_s, t.ttft_s, t.total_s],
        }
        if event.embedding is not None:
            out["embedding"] = list(event.embedding)
        if event.error_field is not None:
            out["error_field"] = event.error_field
        return out
    return {
        "token": event.request_id,
        "id": event.token_id,
        "text": event.text,
        "logprob": event.logprob,
        "top": [list(pair) for pair in event.top_logprobs],
    }


def plan_json(plan: StepPlan | None) -> dict | None:
    """A plan's shape: each row's request, start, token count and whether
    it samples (the token ids and block tables follow from the inputs)."""
    if plan is None:
        return None
    return {"step": plan.number, "rows": [[r.request_id, r.start, len(r.token_ids), r.sample is not None] for r in plan.rows]}


def sampled_json(s: Sampled) -> list:
    return [s.token, s.draws, s.logprob, [list(pair) for pair in s.top_logprobs]]


def scored_json(p: PromptLogprob) -> list:
    return [p.token, p.logprob, p.rank, [list(pair) for pair in p.top]]


def scored_from_json(data: list) -> PromptLogprob:
    token, logprob, rank, top = data
    return PromptLogprob(int(token), float(logprob), int(rank), tuple((int(i), float(lp)) for i, lp in top))


def result_json(result: StepResult) -> dict:
    out: dict[str, Any] = {"step": result.step}
    if result.sampled:
        out["sampled"] = [[sampled_json(s) for s in row] for row in result.sampled]
    for field in ("refused", "fatal", "failed"):
        value = getattr(result, field)
        if value is not None:
            out[field] = value
    if result.pooled:
        out["pooled"] = [list(row) for row in result.pooled]
    if result.scored:
        out["scored"] = [[scored_json(p) for p in row] for row in result.scored]
    return out


def result_from_json(data: dict) -> StepResult:
    sampled = tuple(
        tuple(Sampled(int(tok), int(draws), logprob, tuple((int(i), float(lp)) for i, lp in top)) for tok, draws, logprob, top in row)
        for row in data.get("sampled", ())
    )
    pooled = tuple(tuple(int(x) for x in row) for row in data.get("pooled", ()))
    scored = tuple(tuple(scored_from_json(p) for p in row) for row in data.get("scored", ()))
    return StepResult(data["step"], sampled, data.get("refused"), data.get("fatal"), data.get("failed"), pooled, scored)


def events_json(events: list[Event]) -> list[dict]:
    return [event_json(e) for e in events]


# -- writing ------------------------------------------------------------------
def header(settings: CoreSettings, *, checkpoint_path: str, digest: str, engine: dict, vocab_size: int, cpu: dict | None = None) -> dict:
    """The first line. "sampler" names the sampler's arithmetic ("fixed":
    kernels/sampler_math.py; a trace without it sampled with torch's), and
    "cpu" the class of machine it ran on (models/compute.py `cpu_class`; absent before
    traces recorded it, null on a GPU)."""
    return {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "trioserve": __version__,
        "checkpoint": {"path": checkpoint_path, "digest": digest},
        "core": attrs.asdict(settings),
        "engine": engine,
        "vocab_size": vocab_size,
        "sampler": "fixed",
        "cpu": cpu,
        "started_unix": time.time(),
    }


def new_trace_path(directory: str | Path) -> Path:
    """A fresh file name in ``directory`` for this run (created if missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for n in range(1000):
        path = directory / f"trace-{stamp}-{os.getpid()}{'' if n == 0 else f'-{n}'}.jsonl"
        if not path.exists():
            return path
    raise FileExistsError(f"{directory}: no free trace file name")


class TraceWriter:
    """Appends records to a trace file; each line is flushed as it is
    written, so a crash loses at most the line being written."""

    def __init__(self, path: str | Path, head: dict) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("x", encoding="utf-8")
        self.lines = 0
        self.write(head)

    def write(self, record: dict) -> None:
        self._file.write(dumps(record) + "\n")
        self._file.flush()
        self.lines += 1

    def close(self) -> None:
        self._file.close()


class Recording:
    """An EngineCore that writes every call, with its ``now`` and what it
    returned, to a trace. It has the core's interface, so the scheduler
    cannot tell the difference."""

    def __init__(self, core: EngineCore, writer: TraceWriter) -> None:
        self.core = core
        self.writer = writer

    # the core's state, read through
    @property
    def stats(self):
        return self.core.stats

    @property
    def policy(self):
        return self.core.policy

    def snapshot(self):
        return self.core.snapshot()

    # the inputs, recorded
    def submit(self, request_id: str, request: GenerateRequest, now: float):
        refusal = self.core.submit(request_id, request, now)
        self.writer.write({"in": "submit", "now": now, "id": request_id, "request": request_json(request), "out": refusal_json(refusal)})
        return refusal

    def cancel(self, request_id: str, now: float, error: str | None = None) -> None:
        self.core.cancel(request_id, now, error)
        record = {"in": "cancel", "now": now, "id": request_id}
        if error is not None:  # absent otherwise, as before it existed
            record["error"] = error
        self.writer.write(record)

    def requests_of(self, adapter: str) -> list[str]:
        return self.core.requests_of(adapter)

    def settle(self, owner: str, order: str, request_id: str | None, now: float) -> None:
        self.core.settle(owner, order, request_id, now)
        self.writer.write({"in": "settle", "now": now, "owner": owner, "order": order, "id": request_id})

    def plan(self, now: float):
        events, plan = self.core.plan(now)
        self.writer.write({"in": "plan", "now": now, "out": {"events": events_json(events), "plan": plan_json(plan)}})
        return events, plan

    def result(self, result: StepResult, now: float):
        events = self.core.result(result, now)
        self.writer.write({"in": "result", "now": now, "result": result_json(result), "out": {"events": events_json(events)}})
        return events

    def die(self, cause: str, now: float):
        events = self.core.die(cause, now)
        self.writer.write({"in": "die", "now": now, "cause": cause, "out": {"events": events_json(events)}})
        return events


# -- reading ------------------------------------------------------------------
class TraceReader:
    """A trace's checked header, and its records one by one as (line
    number, record). Close it (or use it as a context manager) when done;
    iterating to the end closes it too."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file = self.path.open("rb")
        except OSError as exc:
            raise TraceError(self.path, 0, f"cannot open the trace: {exc.strerror or exc}") from None
        try:
            self.header = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> dict:
        first = self._file.readline()
        if not first:
            raise TraceError(self.path, 1, "the trace is empty")
        head = _parse(self.path, 1, first)
        if head.get("format") != TRACE_FORMAT:
            raise TraceError(self.path, 1, f"not a trioserve trace (format {head.get('format')!r})")
        if head.get("version") != TRACE_VERSION:
            raise TraceError(self.path, 1, f"trace format version {head.get('version')!r}; this trioserve reads version {TRACE_VERSION}")
        if head.get("trioserve") != __version__:
            raise TraceError(self.path, 1, f"recorded by trioserve {head.get('trioserve')}; this is trioserve {__version__}")
        return head

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        with self._file:
            for number, raw in enumerate(self._file, start=2):
                yield number, _parse(self.path, number, raw)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_trace(path: str | Path) -> TraceReader:
    """Open a trace: TraceError (naming the line) if its header is not one
    this trioserve can replay."""
    return TraceReader(path)


def _parse(path: Path, number: int, raw: bytes) -> dict:
    if not raw.endswith(b"\n"):
        raise TraceError(path, number, "the line is truncated (no newline at its end)")
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(path, number, f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise TraceError(path, number, "not a JSON object")
    return value
