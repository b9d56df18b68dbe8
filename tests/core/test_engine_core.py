"""The EngineCore driven at random through `trace.Recording`, with a fake
runner in place of the model, then its trace replayed by the real replay
machinery (core/replay.py, fast mode).

A hypothesis state machine interleaves what the scheduler actor feeds the
core live: submissions (valid and refused: bad prompts, bad parameters, an
unresolved seed, too large, queue full, a live duplicate id, after death),
cancellations (of live, finished and unknown ids), owners' orders about
retained KV (commit, cancel, forget; stray ones too), whole session turns
(history + new tokens, retain=owner, run to the end, then commit or cancel,
so later turns reuse pinned blocks), plans, and results -- with
submissions, cancellations and orders also arriving while a step is in
flight, between its plan and its result. A result is mostly sampled tokens
taken from a hypothesis-drawn table by a deterministic function of the row
(sometimes the stop id, sometimes two tokens for one row), sometimes
`refused` or `failed`, rarely `fatal`; the engine may also `die`.

Every batch of events the core returns is checked against a model of what
it must be: a plan ends exactly the cancelled live requests; a sampled
result gives, row by row, a token event per non-stop token (with the runner's
logprobs) and ends a request at a stop id, a stop string or max_tokens; a
refused step ends all its rows' requests, a failed one its sampling rows',
a fatal one every live request. Throughout, every accepted request gets
exactly one FinalEvent and nothing after it, a refused submission gets no
event, a step writes only blocks its row holds alone, and each final event's
usage, seed, draw_end and text agree with what was committed.

Teardown runs everything to its end, forgets every owner, and lets the
prefix cache's idle limit trim it: the block pool must then be all free.
The trace (its header naming the tiny GGUF checkpoint and its digest) must
then replay with no difference, and changing one recorded sampled token that
produced a token event must make the replay name that line, step and
request.

Also: replay's summary counts the requests a `die` record ended."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from trioserve.core.engine_core import CoreSettings, new_core
from trioserve.core.replay import replay_trace
from trioserve.core.trace import Recording, TraceWriter, header
from trioserve.errors import EngineDead, QueueFull, RequestError, RequestTooLarge
from trioserve.models.checkpoint import checkpoint_digest, load_tokenizer
from trioserve.models.tokenizer import Tokenizer
from trioserve.state.kv_pool import blocks_needed
from trioserve.types import FinalEvent, GenerateRequest, Sampled, SamplingParams, StepPlan, StepResult, TokenEvent

SETTINGS = CoreSettings(
    num_blocks=12,
    block_size=2,
    max_num_seqs=3,
    max_model_len=16,
    prefill_budget=5,
    max_queue=4,
    retry_after_s=0.5,
    prefix_cache=True,
    prefix_cache_max_blocks=4,
    prefix_cache_idle_s=5.0,
)
EOS = 2  # the tiny tokenizer's only stop id
A, B, C = 35, 36, 37  # "A", "B", "C"
E_ACUTE, LEAD, TRAIL = 270, 130, 105  # "é", and its two bytes b"\xc3" and b"\xa9" as separate tokens
PROMPT_TOKENS = [A, B, C]  # few, so prompts share prefixes and cached blocks
OUTPUT_TOKENS = [A, B, C, E_ACUTE, LEAD, TRAIL, EOS]
STOP_STRINGS = ["AB", "é", "CC"]
OWNERS = ["alice", "bob"]

SUBMISSIONS = st.fixed_dictionaries(
    {
        "which": st.sampled_from(["fresh"] * 6 + ["live", "ended"]),  # a fresh id, a live one's or an ended one's
        "prompt": st.lists(st.sampled_from(PROMPT_TOKENS), min_size=1, max_size=8),
        "bad": st.sampled_from([None] * 25 + ["empty", "vocab", "temperature", "seed", "top_logprobs"]),
        "max_tokens": st.sampled_from([1, 2, 3, 4, 5, 6] * 3 + [15]),  # 15 fits only with a one-token prompt
        "greedy": st.booleans(),
        "seed": st.integers(0, 3),
        "logprobs": st.integers(0, 2),  # 0: none; n: logprobs with n - 1 top
        "stop": st.lists(st.sampled_from(STOP_STRINGS), max_size=2, unique=True),
        "stop_c": st.booleans(),  # "C" as a stop id
        "ignore_eos": st.booleans(),
        "penalty": st.booleans(),
        "draw_start": st.integers(0, 3),
        "retain": st.sampled_from([None, None, *OWNERS]),
    }
)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> tuple[Path, str, Tokenizer]:
    path = tiny_checkpoints["gguf_f32"]
    return path, checkpoint_digest(path), load_tokenizer(path)


@attrs.define(eq=False)
class Req:
    """The model of one accepted request."""

    rid: str
    params: SamplingParams
    prompt: tuple[int, ...]
    draw_start: int
    stop_ids: frozenset[int]
    cancelled: bool = False
    generated: int = 0
    draws: int = 0
    output: list[int] = attrs.field(factory=list)  # committed non-stop tokens
    texts: list[str] = attrs.field(factory=list)  # token events' texts
    final: FinalEvent | None = None


@attrs.frozen
class Expect:
    """One event a result must give: a token (its id) or a final (its reason)."""

    rid: str
    token: int | None = None
    reason: str | None = None


class CoreMachine(RuleBasedStateMachine):
    def __init__(self, checkpoint: tuple[Path, str, Tokenizer], trace_path: Path) -> None:
        super().__init__()
        path, digest, tok = checkpoint
        self.tok = tok
        head = header(SETTINGS, checkpoint_path=str(path), digest=digest, engine={}, vocab_size=tok.vocab_size)
        self.trace = trace_path
        self.writer = TraceWriter(trace_path, head)
        self.core = Recording(new_core(SETTINGS, tok), self.writer)
        self.now = 0.0
        self.table: list[int] = [A]
        self.counter = itertools.count()
        self.live: dict[str, Req] = {}  # accepted, no final yet
        self.ended: list[Req] = []  # every request that got its final
        self.ended_ids: set[str] = set()  # ids free for reuse
        self.refused: set[str] = set()  # fresh ids whose submission was refused
        self.retained: dict[str, list[str]] = {o: [] for o in OWNERS}  # owner -> ids submitted with retain=owner
        self.history: dict[str, list[int]] = {o: [] for o in OWNERS}  # owner -> its committed turns' tokens
        self.flight: StepPlan | None = None
        self.submits = self.tokens = self.finals = 0
        self.dead = False

    # -- time ----------------------------------------------------------------
    def tick(self) -> float:
        self.now += 0.125
        return self.now

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def time_passes(self, dt):
        self.now += dt

    @initialize(table=st.lists(st.sampled_from(OUTPUT_TOKENS), min_size=1, max_size=6))
    def runner_table(self, table):
        self.table = table

    # -- submissions ---------------------------------------------------------
    # Every rule takes one argument: hypothesis picks rules with fewer
    # arguments more often, and a submission has many.
    @rule(submission=SUBMISSIONS)
    def submit(self, submission):
        self.submit_one(**submission)

    def submit_one(self, which, prompt, bad, max_tokens, greedy, seed, logprobs, stop, stop_c, ignore_eos, penalty, draw_start, retain):
        if which == "live" and self.live:
            rid = sorted(self.live)[0]
        elif which == "ended" and self.ended_ids - set(self.live):
            rid = sorted(self.ended_ids - set(self.live))[0]
        else:
            rid = f"r{next(self.counter)}"
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if greedy else 1.0,
            seed=seed,
            logprobs=logprobs > 0,
            top_logprobs=max(0, logprobs - 1),
            stop=tuple(stop),
            stop_token_ids=(C,) if stop_c else (),
            ignore_eos=ignore_eos,
            presence_penalty=0.5 if penalty else 0.0,
        )
        if bad == "empty":
            prompt = []
        elif bad == "vocab":
            prompt = [*prompt, self.tok.vocab_size]
        elif bad == "temperature":
            params = attrs.evolve(params, temperature=3.0)
        elif bad == "seed":
            params = attrs.evolve(params, seed=None)
        elif bad == "top_logprobs":
            params = attrs.evolve(params, logprobs=False, top_logprobs=1)
        self.offer(rid, GenerateRequest(prompt, params, draw_start=draw_start, retain=retain))

    @rule(
        turn=st.tuples(
            st.sampled_from(OWNERS),  # owner
            st.lists(st.sampled_from(PROMPT_TOKENS), min_size=1, max_size=3),  # its new tokens
            st.integers(1, 3),  # max_tokens
            st.booleans(),  # commit
        )
    )
    def session_turn(self, turn):
        owner, new, max_tokens, commit = turn
        """A session's whole turn as the HTTP layer runs it: the owner's
        history and new tokens, submitted with retain=owner, run to its end,
        then committed (its KV becomes the owner's, for the next turn's
        prefix) or cancelled."""
        if self.flight is not None:
            self.result("sampled", 1)
        prompt = self.history[owner] + new
        if len(prompt) + max_tokens > SETTINGS.max_model_len:
            prompt = new
        rid = f"r{next(self.counter)}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=7)
        if not self.offer(rid, GenerateRequest(prompt, params, retain=owner)):
            return
        for _ in range(60):
            if rid not in self.live:
                break
            self.plan()
            if self.flight is not None:
                self.result("sampled", 1)
        req = next(r for r in self.ended if r.rid == rid)  # it must have ended
        if commit and req.final.finish_reason in ("stop", "length"):
            self.history[owner] = prompt + req.output
            self.core.settle(owner, "commit", rid, self.tick())
        else:
            self.core.settle(owner, "cancel", rid, self.tick())

    def offer(self, rid: str, request: GenerateRequest) -> bool:
        """Submit; check the refusal against the model. True when accepted."""
        expected = self.expected_refusal(rid, request)
        refusal = self.core.submit(rid, request, self.tick())
        self.submits += 1
        if expected is None:
            assert refusal is None, f"{rid} refused: {refusal!r}"
        else:
            assert type(refusal) is expected, f"{rid}: expected {expected.__name__}, got {refusal!r}"
        if refusal is not None:
            if rid not in self.live and rid not in self.ended_ids:
                self.refused.add(rid)
            return False
        params = request.params
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset({EOS}))
        self.live[rid] = Req(rid, params, tuple(request.prompt_ids), request.draw_start, stop_ids)
        self.ended_ids.discard(rid)
        if request.retain is not None:
            self.retained[request.retain].append(rid)
        return True

    def expected_refusal(self, rid: str, request: GenerateRequest) -> type | None:
        params = request.params
        if self.dead:
            return EngineDead
        if rid in self.live:
            return RequestError
        if not request.prompt_ids or max(request.prompt_ids) >= self.tok.vocab_size:
            return RequestError
        if params.temperature > 2 or (params.top_logprobs and not params.logprobs) or params.seed is None:
            return RequestError
        total = len(request.prompt_ids) + params.max_tokens
        if total > SETTINGS.max_model_len or blocks_needed(total, SETTINGS.block_size) > SETTINGS.num_blocks:
            return RequestTooLarge
        if len(self.core.policy.waiting) >= SETTINGS.max_queue:
            return QueueFull
        return None

    # -- cancellations and orders --------------------------------------------
    @rule(whom=st.tuples(st.sampled_from(["live", "ended", "unknown", "refused"]), st.integers(0, 5)))
    def cancel(self, whom):
        which, index = whom
        pools = {
            "live": sorted(self.live),
            "ended": sorted(self.ended_ids),
            "unknown": ["nobody"],
            "refused": sorted(self.refused),
        }
        ids = pools[which] or ["nobody"]
        rid = ids[index % len(ids)]
        self.core.cancel(rid, self.tick())
        if rid in self.live:
            self.live[rid].cancelled = True

    @rule(order=st.tuples(st.sampled_from(OWNERS), st.sampled_from(["commit", "cancel", "forget"]), st.integers(0, 5), st.booleans()))
    def settle(self, order):
        owner, order, index, stray = order
        ids = self.retained[owner] if not stray else sorted(self.live) + ["nobody"]
        rid = None if order == "forget" or not ids else ids[-1 - index % len(ids)]
        self.core.settle(owner, order, rid, self.tick())

    # -- iterations -----------------------------------------------------------
    @rule(double=st.integers(0, 7))
    def step(self, double):
        """The scheduler's next move: plan a step, or take the result of the
        one in flight (other rules may run in between, as they do live)."""
        if self.flight is None:
            self.plan()
        else:
            self.result("sampled", double)

    @rule(fault=st.sampled_from(["refused", "failed", "refused", "failed", "fatal"]))
    def step_fails(self, fault):
        """The step in flight (or a new one) does not give tokens: refused
        (its rows fail), failed (its sampling rows fail) or fatal (the
        engine dies)."""
        if self.flight is None:
            self.plan()
        if self.flight is not None:
            self.result(fault, 1)

    @rule(steps=st.integers(1, 8))
    def iterate(self, steps):
        """Whole iterations with nothing arriving mid-step."""
        if self.flight is not None:
            self.result("sampled", 1)
        for _ in range(steps):
            self.plan()
            if self.flight is None:
                return
            self.result("sampled", 1)

    def plan(self) -> None:
        cancelled = {rid for rid, r in self.live.items() if r.cancelled}
        events, plan = self.core.plan(self.tick())
        assert all(isinstance(e, FinalEvent) and e.finish_reason == "cancelled" for e in events), events
        assert sorted(e.request_id for e in events) == sorted(cancelled)
        self.take(events)
        if plan is None:
            assert not self.core.policy.running
            return
        assert 0 < len(plan.rows) <= SETTINGS.max_num_seqs
        assert len({r.request_id for r in plan.rows}) == len(plan.rows)
        bs = SETTINGS.block_size
        pool = self.core.policy.pool
        for row in plan.rows:
            req = self.live[row.request_id]
            assert not req.cancelled
            assert row.token_ids, row
            end = row.start + len(row.token_ids)
            assert end <= len(req.prompt) + req.params.max_tokens
            assert len(row.block_table) * bs >= end
            # A step writes only blocks its row holds alone.
            for block in row.block_table[row.start // bs : (end - 1) // bs + 1]:
                assert pool.refcount(block) == 1, (row, block, pool.refcount(block))
            if row.sample is not None:
                assert row.sample.seed == req.params.seed
                assert row.sample.draw_index == req.draw_start + req.draws
                if req.params.penalized:
                    assert tuple(row.sample.history) == req.prompt + tuple(req.output)
        self.flight = plan

    def result(self, mode: str, double: int) -> None:
        plan, self.flight = self.flight, None
        if mode == "sampled":
            result, expected = self.sample(plan, double)
        elif mode == "refused":
            result = StepResult(plan.number, refused="no room on the device")
            expected = [Expect(r.request_id, reason="error") for r in plan.rows]
        elif mode == "failed":
            result = StepResult(plan.number, failed="the sampler failed")
            expected = [Expect(r.request_id, reason="error") for r in plan.sampling]
        else:
            result = StepResult(plan.number, fatal="the device fell over")
            expected = None
        events = self.core.result(result, self.tick())
        if expected is None:  # fatal: every live request ends, in no particular order
            assert all(isinstance(e, FinalEvent) and e.finish_reason == "error" for e in events)
            assert sorted(e.request_id for e in events) == sorted(self.live)
            self.dead = True
        else:
            got = [Expect(e.request_id, token=e.token_id) if isinstance(e, TokenEvent) else Expect(e.request_id, reason=e.finish_reason) for e in events]
            assert got == expected
            if mode == "sampled":
                self.check_logprobs(events, result, plan)
        self.take(events)

    @rule(now=st.sampled_from([False] * 15 + [True]))
    def die(self, now):
        if not now:  # rarely
            return
        events = self.core.die("a test kills the engine", self.tick())
        assert all(isinstance(e, FinalEvent) and e.finish_reason == "error" for e in events)
        assert sorted(e.request_id for e in events) == sorted(self.live)
        self.take(events)
        self.flight = None
        self.dead = True

    # -- the fake runner ----------------------------------------------------------
    def sample(self, plan: StepPlan, double: int) -> tuple[StepResult, list[Expect]]:
        """Tokens for each sampling row, a function of the row and the table;
        and the events the core must give for them."""
        rows, expected = [], []
        for i, row in enumerate(plan.sampling):
            req = self.live[row.request_id]
            position = row.start + len(row.token_ids)
            count = 2 if double == 0 and i == 0 else 1
            tokens = []
            for k in range(count):
                token = self.table[(position + k + sum(map(ord, req.rid))) % len(self.table)]
                logprob = -(position + k) / 8 if req.params.logprobs else None
                top = tuple((t, -0.25 * (j + 1)) for j, t in enumerate(OUTPUT_TOKENS[: req.params.top_logprobs]))
                tokens.append(Sampled(token, 0 if req.params.greedy else 1, logprob, top))
            rows.append(tuple(tokens))
            expected += self.commit(req, tokens)
        return StepResult(plan.number, tuple(rows)), expected

    def commit(self, req: Req, tokens: list[Sampled]) -> list[Expect]:
        """The events committing ``tokens`` gives; updates the model."""
        out = []
        for s in tokens:
            req.generated += 1
            req.draws += s.draws
            if s.token in req.stop_ids:
                out.append(Expect(req.rid, reason="stop"))
                return out
            req.output.append(s.token)
            out.append(Expect(req.rid, token=s.token))
            text = self.tok.decode(req.output)
            if any(stop in text for stop in req.params.stop):
                out.append(Expect(req.rid, reason="stop"))
                return out
            if req.generated >= req.params.max_tokens:
                out.append(Expect(req.rid, reason="length"))
                return out
        return out

    def check_logprobs(self, events, result: StepResult, plan: StepPlan) -> None:
        given = {row.request_id: list(tokens) for row, tokens in zip(plan.sampling, result.sampled, strict=True)}
        for e in events:
            if isinstance(e, TokenEvent):
                s = given[e.request_id].pop(0)
                assert (e.token_id, e.logprob, e.top_logprobs) == (s.token, s.logprob, s.top_logprobs)

    # -- every event ----------------------------------------------------------------
    def take(self, events) -> None:
        for e in events:
            assert e.request_id not in self.refused, f"an event for refused submission {e.request_id}: {e}"
            req = self.live.get(e.request_id)
            assert req is not None, f"an event for {e.request_id}, which is not live (ended or never accepted): {e}"
            if isinstance(e, TokenEvent):
                self.tokens += 1
                req.texts.append(e.text)
                continue
            self.finals += 1
            req.final = e
            del self.live[e.request_id]
            self.ended.append(req)
            self.ended_ids.add(req.rid)
            self.check_final(req, e)

    def check_final(self, req: Req, e: FinalEvent) -> None:
        assert e.seed == req.params.seed
        assert e.usage.prompt_tokens == len(req.prompt)
        if e.finish_reason in ("error", "cancelled"):
            assert e.error is not None or e.finish_reason == "cancelled"
            return
        assert e.usage.completion_tokens == req.generated
        assert e.draw_end == req.draw_start + req.draws
        decoded = self.tok.decode(req.output)
        cuts = [decoded.find(s) for s in req.params.stop if s in decoded]
        text = "".join(req.texts) + e.text
        assert text == (decoded[: min(cuts)] if cuts else decoded), (req, e)
        if e.finish_reason == "length":
            assert req.generated == req.params.max_tokens

    # -- the end --------------------------------------------------------------------
    def teardown(self):
        try:
            self.finish()
        finally:
            self.writer.close()
        self.check_replay()

    def finish(self) -> None:
        """Run everything to its end, forget every owner, let the cache's idle
        limit empty it: no block may stay taken."""
        if self.flight is not None:
            self.result("sampled", 1)
        for _ in range(200):
            self.plan()
            if self.flight is None and not self.core.policy.waiting:
                break
            if self.flight is not None:
                self.result("sampled", 1)
        assert not self.live, f"requests that never ended: {sorted(self.live)}"
        assert self.flight is None
        for owner in OWNERS:
            self.core.settle(owner, "forget", None, self.tick())
        self.now += SETTINGS.prefix_cache_idle_s + 1
        self.plan()  # applies the orders; admission trims the idle cache
        assert self.flight is None
        policy = self.core.policy
        assert policy.held == {}
        stats = policy.cache.stats()
        assert (stats.pinned_owners, stats.pinned_blocks) == (0, 0)
        assert len(policy.cache) == 0
        assert policy.pool.num_free == SETTINGS.num_blocks, "KV blocks leaked"
        assert sorted(self.ended_ids) == sorted({r.rid for r in self.ended})
        assert all(r.final is not None for r in self.ended)

    def check_replay(self) -> None:
        summary = replay_trace(self.trace)
        assert summary.difference is None, summary.difference.report()
        assert (summary.submits, summary.tokens) == (self.submits, self.tokens)
        assert summary.finals == self.finals
        assert summary.lines == self.writer.lines - 1
        self.check_tampered_replay()

    def check_tampered_replay(self) -> None:
        """Change the first recorded sampled token that produced a token event:
        the replay must stop at that line, naming its step and request."""
        lines = self.trace.read_text().splitlines(keepends=True)
        plans: dict[int, list] = {}
        for number, line in enumerate(lines[1:], start=2):
            record = json.loads(line)
            if record["in"] == "plan" and record["out"]["plan"] is not None:
                plans[record["out"]["plan"]["step"]] = record["out"]["plan"]["rows"]
            if record["in"] != "result" or "sampled" not in record["result"]:
                continue
            tokens = [e for e in record["out"]["events"] if "token" in e]
            if not tokens:
                continue
            rid, token = tokens[0]["token"], tokens[0]["id"]
            step = record["result"]["step"]
            sampling = [r[0] for r in plans[step] if r[3]]
            row = record["result"]["sampled"][sampling.index(rid)]
            row[[s[0] for s in row].index(token)][0] = B if token == A else A
            lines[number - 1] = json.dumps(record, separators=(",", ":")) + "\n"
            break
        else:
            return  # no token event anywhere
        tampered = self.trace.with_name(self.trace.stem + "-tampered.jsonl")
        tampered.write_text("".join(lines))
        difference = replay_trace(tampered).difference
        assert difference is not None, "a changed token went unnoticed"
        assert (difference.line, difference.step, difference.request_id) == (number, step, rid), difference.report()


def test_engine_core_machine(checkpoint, tmp_path):
    paths = (tmp_path / f"trace-{n}.jsonl" for n in itertools.count())
    run_state_machine_as_test(
        lambda: CoreMachine(checkpoint, next(paths)),
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_replay_counts_the_requests_death_ended(checkpoint, tmp_path):
    path, digest, tok = checkpoint
    trace = tmp_path / "trace.jsonl"
    writer = TraceWriter(trace, header(SETTINGS, checkpoint_path=str(path), digest=digest, engine={}, vocab_size=tok.vocab_size))
    core = Recording(new_core(SETTINGS, tok), writer)
    for rid in ("a", "b"):
        assert core.submit(rid, GenerateRequest([A, B], SamplingParams(max_tokens=2, seed=0)), 1.0) is None
    assert len(core.die("gone", 2.0)) == 2
    writer.close()
    summary = replay_trace(trace)
    assert summary.difference is None
    assert summary.finals == 2
