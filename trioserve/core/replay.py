"""`trioserve replay TRACE`: check a recorded run (core/trace.py).

Fast mode (the default) feeds the recorded inputs and step results into a
fresh EngineCore, built from the settings in the trace's header with the
checkpoint's tokenizer, and checks that every output -- refusals, token
events, final events, step plans -- is byte-identical to the recording.
It reads no weights.

Model mode (``--model``) also re-runs every planned step on the real model
with the recorded engine settings, samples it as the server does, and
checks that each step gives the recorded tokens, draws and logprobs.

Another CPU class. The header names the class the trace ran on
(models/compute.py `cpu_class`: torch's CPU capability, the C kernels' instruction
sets). On the default path (int8 activations, the fixed-order sampler)
every class gives the same bits, so the replay runs here as it is. Where a
step's result differs and the trace came from another class, the replay
runs again at the recorded level, in a child process with torch's
capability and the kernels' level pinned (`ATEN_CPU_CAPABILITY`,
`TRIOSERVE_CPU_FEATURES`), when this CPU can run it (a wider CPU runs a
narrower one's path); when it cannot, the replay ends with status 3 and one
line saying so. A trace from before headers named their class is tried at
each of torch's levels this CPU can run before a difference is reported.

Exit status: 0 when everything is identical; 1 at the first difference,
after printing the request, the step, and the expected and actual output;
2 when the trace cannot be replayed (unreadable, truncated or corrupt line,
another trace version or trioserve version, another checkpoint), with one
line naming the line of the file; 3 when it came from another CPU class
whose level this CPU cannot run (docs/replay.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import attrs

from trioserve.core.engine_core import CoreMisuse, CoreSettings, EngineCore, new_core
from trioserve.core.trace import (
    TraceError,
    dumps,
    events_json,
    plan_json,
    read_trace,
    refusal_json,
    request_from_json,
    result_from_json,
    result_json,
)
from trioserve.errors import CheckpointError, TrioserveError
from trioserve.types import StepPlan, StepResult


@attrs.frozen
class Difference:
    """The first place a replay disagrees with the recording."""

    line: int
    step: int | None
    request_id: str | None
    what: str  # "output" (the core's) or "step result" (the model's)
    expected: Any
    actual: Any

    def report(self) -> str:
        where = [f"line {self.line}"]
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.request_id is not None:
            where.append(f"request {self.request_id}")
        return (
            f"DIFFERENT {self.what} at {', '.join(where)}\n"
            f"  expected: {dumps(self.expected)}\n"
            f"  actual:   {dumps(self.actual)}"
        )


@attrs.define
class Summary:
    lines: int = 0
    submits: int = 0
    steps: int = 0
    tokens: int = 0
    finals: int = 0
    model_steps: int = 0  # steps re-run on the model
    difference: Difference | None = None
    recorded_cpu: dict | None = None  # the header's CPU class (None: not named)
    here_cpu: dict | None = None  # the class the model ran on here (model mode)

    def report(self, mode: str) -> str:
        checked = f"{self.steps} steps" + (f" ({self.model_steps} re-run on the model)" if mode == "model" else "")
        return f"{self.lines} records, {self.submits} requests, {checked}, {self.tokens} tokens, {self.finals} finished"


RunStep = Callable[[StepPlan], StepResult]  # a plan in, its result out (models/step_runner.py)


def replay_trace(
    path: str | Path,
    *,
    checkpoint: str | Path | None = None,
    model: bool = False,
    runner_factory: Callable[[dict, Any], RunStep] | None = None,
) -> Summary:
    """Replay ``path``; the summary's ``difference`` is the first found.
    ``checkpoint`` overrides where the recorded checkpoint is found. Raises
    TraceError when the trace cannot be replayed."""
    with read_trace(path) as reader:
        return _replay(reader, path, checkpoint=checkpoint, model=model, runner_factory=runner_factory)


def _replay(reader, path, *, checkpoint, model: bool, runner_factory) -> Summary:
    head = reader.header
    source = checkpoint if checkpoint is not None else head.get("checkpoint", {}).get("path")
    tokenizer, compiler = _load_tokenizer(path, head, source)
    try:
        settings = CoreSettings(**{"prefill_sharing": "tenants", **head["core"]})  # a trace from before it existed shared that way
    except (KeyError, TypeError) as exc:
        raise TraceError(path, 1, f"the header's core settings are unusable: {exc}") from None
    core = new_core(settings, tokenizer)
    runner = None
    if model:
        runner = (runner_factory or model_runner)(head, source)
    summary = Summary(recorded_cpu=head.get("cpu"), here_cpu=getattr(runner, "cpu", None))
    pending: dict[int, StepResult] = {}  # step -> what the model gave, until its recorded result line
    for number, record in reader:
        summary.lines += 1
        try:
            difference = _feed(core, record, number, compiler, summary, runner, pending)
        except TraceError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, CoreMisuse, TrioserveError) as exc:
            raise TraceError(path, number, f"corrupt record: {type(exc).__name__}: {exc}") from None
        if difference is not None:
            summary.difference = difference
            return summary
    return summary


def _feed(core: EngineCore, record: dict, line: int, compile_guide, summary: Summary, runner, pending) -> Difference | None:
    kind = record["in"]
    now = float(record["now"])
    if kind == "submit":
        summary.submits += 1
        refusal = core.submit(record["id"], request_from_json(record["request"], compile_guide), now)
        return _compare(line, None, record["id"], record["out"], refusal_json(refusal))
    if kind == "cancel":
        core.cancel(record["id"], now, record.get("error"))
        return None
    if kind == "settle":
        core.settle(record["owner"], record["order"], record["id"], now)
        return None
    if kind == "plan":
        events, plan = core.plan(now)
        actual = {"events": events_json(events), "plan": plan_json(plan)}
        step = plan.number if plan is not None else None
        _count(summary, actual["events"])
        if plan is not None and runner is not None:
            pending[plan.number] = runner(plan)
            summary.model_steps += 1
        return _compare(line, step, None, record["out"], actual)
    if kind == "result":
        recorded = result_from_json(record["result"])
        if recorded.step in pending:
            ran = pending.pop(recorded.step)
            if ran != recorded:
                return _result_difference(line, core, recorded, ran)
        summary.steps += 1
        events = core.result(recorded, now)
        actual = {"events": events_json(events)}
        _count(summary, actual["events"])
        return _compare(line, recorded.step, None, record["out"], actual)
    if kind == "die":
        events = core.die(record["cause"], now)
        actual = {"events": events_json(events)}
        _count(summary, actual["events"])
        return _compare(line, None, None, record["out"], actual)
    raise ValueError(f"unknown input {kind!r}")


def _count(summary: Summary, events: list[dict]) -> None:
    for e in events:
        if "token" in e:
            summary.tokens += 1
        elif "final" in e:
            summary.finals += 1


def _compare(line: int, step: int | None, request_id: str | None, expected: Any, actual: Any) -> Difference | None:
    if dumps(expected) == dumps(actual):
        return None
    # Narrow a list of events down to the first one that differs.
    if isinstance(expected, dict) and isinstance(actual, dict):
        exp_events, act_events = expected.get("events"), actual.get("events")
        if isinstance(exp_events, list) and isinstance(act_events, list) and dumps(exp_events) != dumps(act_events):
            for i in range(max(len(exp_events), len(act_events))):
                e = exp_events[i] if i < len(exp_events) else None
                a = act_events[i] if i < len(act_events) else None
                if dumps(e) != dumps(a):
                    rid = _request_of(e) or _request_of(a) or request_id
                    return Difference(line, step, rid, "output", e, a)
        if dumps(expected.get("plan")) != dumps(actual.get("plan")):
            return Difference(line, step, request_id, "plan", expected.get("plan"), actual.get("plan"))
    return Difference(line, step, request_id, "output", expected, actual)


def _request_of(event: Any) -> str | None:
    if isinstance(event, dict):
        return event.get("token") or event.get("final") or event.get("prompt")
    return None


def _result_difference(line: int, core: EngineCore, recorded: StepResult, ran: StepResult) -> Difference:
    """Where the model's result for a step departs from the recorded one."""
    plan = core.in_flight
    rows = plan.sampling if plan is not None else ()
    exp, act = result_json(recorded), result_json(ran)
    exp_rows, act_rows = exp.get("sampled", []), act.get("sampled", [])
    for i, row in enumerate(rows):
        e = exp_rows[i] if i < len(exp_rows) else None
        a = act_rows[i] if i < len(act_rows) else None
        if dumps(e) != dumps(a):
            return Difference(line, recorded.step, row.request_id, "step result", _token_view(e), _token_view(a))
    return Difference(line, recorded.step, None, "step result", exp, act)


def _token_view(row: Any) -> Any:
    """[[token, draws, logprob, top]] as readable dicts."""
    if not isinstance(row, list):
        return row
    return [{"token": t, "draws": d, "logprob": lp, "top": top} for t, d, lp, top in row]


def _load_tokenizer(path, head: dict, source):
    """The recorded checkpoint's tokenizer and a guide compiler over it,
    after checking that the checkpoint is the one the trace names."""
    from trioserve.models.checkpoint import checkpoint_digest, load_tokenizer  # noqa: PLC0415 - heavy imports, only here
    from trioserve.models.guided import GuideCompiler, GuideSpec  # noqa: PLC0415

    recorded = head.get("checkpoint", {}).get("digest")
    if not source:
        raise TraceError(path, 1, "the header names no checkpoint")
    try:
        digest = checkpoint_digest(source)
    except (OSError, CheckpointError) as exc:
        raise TraceError(path, 1, f"the recorded checkpoint cannot be read ({exc}); pass --checkpoint PATH") from None
    if digest != recorded:
        raise TraceError(path, 1, f"recorded with checkpoint {recorded}, but {source} is {digest}")
    try:
        tokenizer = load_tokenizer(source)
    except CheckpointError as exc:
        raise TraceError(path, 1, str(exc)) from None
    if tokenizer.vocab_size != head.get("vocab_size"):
        raise TraceError(path, 1, f"the trace's vocabulary has {head.get('vocab_size')} tokens, the checkpoint's {tokenizer.vocab_size}")
    compiler = GuideCompiler(tokenizer)

    def compile_guide(data: dict):
        spec = data["spec"]
        return compiler.guides(GuideSpec(data["kind"], tuple(spec) if isinstance(spec, list) else spec, data["field"]), 1)[0]

    return tokenizer, compile_guide


class ModelSteps:
    """A model's StepRunner as a RunStep, with the CPU class it runs on."""

    def __init__(self, run: RunStep, cpu: dict | None) -> None:
        self.run = run
        self.cpu = cpu

    def __call__(self, plan: StepPlan) -> StepResult:
        return self.run(plan)


def model_runner(head: dict, source) -> RunStep:
    """Runs planned steps as the server does (models/step_runner.py), with the
    recorded engine settings (dtype, 4-bit weights, device, block size,
    batch-invariant arithmetic) and the recorded sampler arithmetic."""
    from trioserve.kernels.cpu import resolve_dtype, resolve_kv_dtype  # noqa: PLC0415 - heavy imports, only in model mode
    from trioserve.kernels.sampler_math import NUMERICS  # noqa: PLC0415
    from trioserve.models.checkpoint import load_checkpoint  # noqa: PLC0415
    from trioserve.models.compute import cpu_class  # noqa: PLC0415
    from trioserve.models.guided import GuideCompiler  # noqa: PLC0415
    from trioserve.models.build import build_model  # noqa: PLC0415
    from trioserve.models.step_runner import StepRunner  # noqa: PLC0415

    engine, core = head["engine"], head["core"]
    checkpoint = load_checkpoint(source, dtype=resolve_dtype(engine["dtype"], engine["device"]))
    # Traces from before #11 carry no batch_invariant: their steps ran the batch-dependent arithmetic;
    # traces from before --activations ran bf16 activations; traces from before #47 sampled with torch's arithmetic.
    invariant = bool(engine.get("batch_invariant", False))
    model = build_model(
        checkpoint, use_int4=engine["use_int4"], device=engine["device"], batch_invariant=invariant, kernels=engine.get("kernels", "auto"),
        activations=engine.get("activations", "bf16"), kv_dtype=resolve_kv_dtype(engine.get("kv_cache_dtype", "auto")),
        max_model_len=core["max_model_len"],  # the recorded core's: no position past it was ever run
    )  # fmt: skip
    cache = model.new_kv_cache(core["num_blocks"], core["block_size"])
    numerics = NUMERICS[head.get("sampler", "torch")]
    runner = StepRunner(model, cache, vocab_size=checkpoint.tokenizer.vocab_size, guides=GuideCompiler(checkpoint.tokenizer), numerics=numerics)
    return ModelSteps(runner.run, cpu_class(model) if model.device.type == "cpu" else None)


# -- another CPU class ----------------------------------------------------------
PINNED_ENV = "TRIOSERVE_REPLAY_PINNED"  # set in the child that replays at a recorded level: no further tries
OTHER_CLASS = 3  # the exit status for a trace from a class this CPU cannot run
CHILD_TIMEOUT_S = 6 * 3600.0  # a replay at another level may re-run a long trace
# torch's CPU capabilities on x86 (widest first), the CPU flags each needs,
# and the oneDNN instruction set that goes with each in a pinned replay.
ATEN_LEVELS = {"AVX512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"), "AVX2": ("avx2", "fma"), "DEFAULT": ()}
ONEDNN_ISA = {"AVX512": "AVX512_CORE_BF16", "AVX2": "AVX2", "DEFAULT": "SSE41"}
# The C kernels' instruction sets (native.isa()) that a level of TRIOSERVE_CPU_FEATURES builds by name.
NAMED_LEVELS = ("avx2", "avx2-vnni", "generic")


def describe_class(cpu: dict | None) -> str:
    if not cpu:
        return "an unnamed CPU class"
    kernels = cpu.get("cpu_kernels") or f"{cpu.get('kernels')} kernels"
    return f"{cpu.get('arch')}, torch {cpu.get('torch')}, C kernels {kernels}"


def _same_class(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("arch", "torch", "cpu_kernels"))


def _aten_levels_here() -> list[str]:
    """torch's capabilities this CPU can run, widest first."""
    import platform  # noqa: PLC0415

    from trioserve.kernels.cpu import cpu_flags  # noqa: PLC0415

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    return [level for level, needs in ATEN_LEVELS.items() if all(f in flags for f in needs)]


def _recorded_level(recorded: dict, here: dict) -> tuple[dict[str, str] | None, str]:
    """The environment that runs ``recorded``'s level here, or None and why it cannot be run."""
    from trioserve.kernels.cpu import level_fits  # noqa: PLC0415

    if recorded.get("arch") != here.get("arch"):
        return None, f"it ran on {recorded.get('arch')}"
    env: dict[str, str] = {}
    aten = recorded.get("torch")
    if aten != here.get("torch"):
        if aten not in _aten_levels_here():
            return None, f"torch's {aten} level needs instructions this CPU lacks"
        env["ATEN_CPU_CAPABILITY"] = aten.lower()
        env["ONEDNN_MAX_CPU_ISA"] = ONEDNN_ISA[aten]
    isa = recorded.get("cpu_kernels")
    if isa != here.get("cpu_kernels"):
        if isa in NAMED_LEVELS and not level_fits(isa):
            env["TRIOSERVE_CPU_FEATURES"] = isa
        elif isa is not None and isa == _native_isa():
            env["TRIOSERVE_CPU_FEATURES"] = "native"
        else:
            return None, f"the C kernels' {isa} level is not one this CPU runs"
    return env, ""


def _native_isa() -> str | None:
    from trioserve.kernels import native_build  # noqa: PLC0415

    lib = native_build.library_at("native")
    return None if lib is None else lib.trioserve_isa().decode()


def _replay_at(trace: str, checkpoint: str | None, env: dict[str, str], threads: int | None) -> tuple[int, str, str]:
    """`trioserve replay --model` in a child process with ``env`` added (torch
    reads its capability once, when it starts): its status, stdout and stderr."""
    command = [sys.executable, "-m", "trioserve", "replay", str(trace), "--model"]
    if checkpoint is not None:
        command += ["--checkpoint", str(checkpoint)]
    if threads is not None:
        command += ["--threads", str(threads)]
    done = subprocess.run(
        command, env={**os.environ, **env, PINNED_ENV: "1"}, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
    )
    return done.returncode, done.stdout, done.stderr


def _words(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items() if k != "ONEDNN_MAX_CPU_ISA")


def _elsewhere(trace: str, checkpoint: str | None, summary: Summary, out: TextIO, err: TextIO, threads: int | None) -> int | None:
    """After a step result differed: replay at the recorded level where this
    CPU can (its status), say the trace came from a class it cannot run (3),
    or None when the difference stands (same class, or nothing else to try)."""
    here, recorded, step = summary.here_cpu, summary.recorded_cpu, summary.difference.step
    if here is None:
        return None
    if recorded is None:  # recorded before headers named the class: try torch's other levels
        for level in _aten_levels_here():
            if level == here.get("torch"):
                continue
            env = {"ATEN_CPU_CAPABILITY": level.lower(), "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[level]}
            status, text, _ = _replay_at(trace, checkpoint, env, threads)
            if status == 0:
                out.write(text)
                print(f"replay (model): the trace names no CPU class; identical at {_words(env)} (step {step} differed at {here.get('torch')})", file=out)
                return 0
        return None
    if _same_class(recorded, here):
        return None
    env, why = _recorded_level(recorded, here)
    if env is None:
        print(
            f"trioserve replay: {trace} came from another CPU class ({describe_class(recorded)}; here: {describe_class(here)}), "
            f"whose level this CPU cannot run ({why}); step {step} gave other bits here",
            file=err,
        )
        return OTHER_CLASS
    status, text, errors = _replay_at(trace, checkpoint, env, threads)
    out.write(text)
    err.write(errors)
    if status == 0:
        print(f"replay (model): recorded on {describe_class(recorded)}; identical at its level ({_words(env)}); step {step} differed at this CPU's own", file=out)
    return status


def main(
    trace: str, *, checkpoint: str | None = None, model: bool = False, out: TextIO | None = None, err: TextIO | None = None,
    threads: int | None = None,
) -> int:
    """Replay ``trace`` and report on ``out`` (default: sys.stdout at the
    time of the call) and ``err``; the exit status. ``threads``: the CPU
    threads asked for (None: the default), passed to a replay at another
    level."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    mode = "model" if model else "fast"
    try:
        summary = replay_trace(trace, checkpoint=checkpoint, model=model)
    except TraceError as exc:
        print(f"trioserve replay: error: {exc}", file=err)
        return 2
    if summary.difference is not None:
        if summary.difference.what == "step result" and not os.environ.get(PINNED_ENV):
            status = _elsewhere(trace, checkpoint, summary, out, err, threads)
            if status is not None:
                return status
        print(summary.difference.report(), file=out)
        print(f"replay ({mode}): stopped at the first difference after {summary.report(mode)}", file=out)
        return 1
    print(f"replay ({mode}): identical: {summary.report(mode)}", file=out)
    return 0
