"""Sessions and the KV they keep, driven at random with no trio running,
through the EngineCore: a SessionStore whose removals become "forget"
orders, and an EngineCore over a SchedulingPolicy, a PrefixCache and a small
BlockPool, driven as the scheduler actor drives it. Submissions go through
`core.submit`, abandonment through `core.cancel`, owners' orders about
retained KV through `core.settle` (its register, `core.retention`, is
checked against a model after every order: "commit"/"cancel" keyed by
(owner, request id), "forget" by (owner, None), insertion-ordered), and each
scheduler iteration is `core.plan` -- the orders apply in order, then
cancelled requests end, then admission runs, then the next step is planned
-- followed, when there is a step, by `core.result` with one sampled token
per sampling row. How each turn ended ("stop", "length", "cancelled") is
read from the final events the core returns, its output from its token
events. The turn's side follows the session actor
(`trioserve/actors/session.py`): begin, submit with retain=<session id>,
then commit (store, then a "commit" order naming the request) or cancel
(store, then a "cancel" order naming it when the store returned True).

After every step the store's accounting must match a model of its sessions
(LRU order, busy, eviction by idle time, count and history bytes, the
counters), every pool block's reference count must be exactly the running
sequences that hold it, the cache's own reference and one per owner pinning
it, the pins, `policy.held` and each queued sequence's `retain` must match a
model of what finishing and each order do (checked too as admission starts,
right after the core applied the orders); unless a "forget" is pending for
it, nothing is pinned, held or retained for a session that is gone; a
session's own pins are a prefix of its committed tokens; and `policy.held`
names a request for a session only while that request is the session's
finished turn waiting to be settled, or an order about it is pending. The
core's requests are exactly the queued sequences, and between rules no step
is in flight. Teardown ends everything and forgets every session: the pool
must then be all free.

Rules: create; begin a turn (the scheduler then idle, or busy with a step so
that orders and the submission wait); a whole turn in one rule; commit or
cancel a finished turn; abandon a waiting or running one, noticed by the
scheduler or not (the sequence then runs on and may end normally after its
"cancel" order: it must hold nothing), perhaps deleting the session too,
perhaps while a step runs; the scheduler noticing such a turn later; commit a
finished turn while the scheduler is busy and begin and abandon the next one
before its next iteration (the commit must still take effect); delete; a
second turn on a busy session, and anything on a gone one (refused); time
passing, with or without an expiry sweep; a stateless request that needs
most of the pool; scheduler iterations.

Two tenants keep sessions in the store, "alice" and "bob", each under its
own quota of sessions and history bytes; the two quotas add up to more than
the store's own limits, so a tenant makes room from its own idle sessions
both for its quota and for the store's limits, and is refused
(QuotaExceeded) when all it keeps is busy. Every create names a tenant and
every store call acts as one: the session's own, or, in `trespass`, the
other, which must find nothing (exactly as for an unknown id) and change
nothing. Each rule acts as at most one tenant, and after it what every other
tenant reads -- its sessions, in order, with their histories, turns, seeds,
draw positions and settings -- is what it read before (sessions that expired
by then excepted: the clock, not a tenant, removes those)."""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator

import attrs
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from trioserve.core.engine_core import EngineCore
from trioserve.errors import RequestError, RequestTooLarge
from trioserve.models.tokenizer import Tokenizer
from trioserve.state.kv_pool import BlockPool
from trioserve.state.prefix_cache import ROOT, PrefixCache, block_key, held_key
from trioserve.state.scheduling import SchedulingPolicy
from trioserve.state.sequence import Sequence
from trioserve.state.session_store import (
    Quota,
    QuotaExceeded,
    Session,
    SessionBusy,
    SessionNotFound,
    SessionStore,
    StaleTurn,
    Turn,
    TurnLease,
    compact_json,
)
from trioserve.types import (
    Event,
    FinalEvent,
    GenerateRequest,
    Sampled,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenEvent,
    Usage,
)

BS = 2  # tokens per block
BLOCKS = 16
MAX_LEN = 24  # a request fits in at most 12 of the 16 blocks
CACHE_MAX_BLOCKS = 3  # the cache's own limits: what nobody pins goes quickly
CACHE_IDLE_S = 4.0
MAX_SESSIONS = 3
SESSION_IDLE_S = 10.0
HISTORY_BYTES = 16
STEP_S = 0.1  # the clock moves this much per step
STOP = 2  # the stop id every sequence has (and its only one)
ALPHABET = [5, 6]  # new prompt tokens: small, so histories share blocks
SAMPLED = [5, 6, 7, STOP]  # what a step samples (every sampling row the same)
HOG_BASE = 8  # a hog's prompt tokens are at least this: it shares nothing with sessions
OWNERS = ("alice", "bob")
# Each tenant's quota: together more than the store's limits (4 > MAX_SESSIONS
# sessions, 22 > HISTORY_BYTES bytes), so either can be what forces an
# eviction. Bob may keep one session: with its turn running, he is refused.
QUOTAS = {"alice": Quota(3, 12), "bob": Quota(1, 10)}
# A session's settings, kept as compact JSON and counted in its bytes: none
# (nothing counted), small, or more than any tenant may keep in one session.
SETTINGS = [None, None, None, {"t": "x"}, {"t": "x" * 8}]
TIME = "the clock"  # the actor of a rule in which only time removes sessions


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_checkpoints["hf"])


def request(prompt: list[int], max_tokens: int, retain: str | None) -> GenerateRequest:
    """Greedy, with STOP as the only stop id whatever the tokenizer's are."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0, stop_token_ids=(STOP,), ignore_eos=True)
    return GenerateRequest(prompt, params, retain=retain)


class ProbedPolicy(SchedulingPolicy):
    """The real policy with one look inside: `at_admission` runs as admission
    starts, after the core applied the owners' orders and dropped the
    cancelled requests, so the pins can be checked right there."""

    at_admission: Callable[[], None] | None = None

    def admit(self, now: float) -> list[Sequence]:
        if self.at_admission is not None:
            self.at_admission()
        return super().admit(now)


@attrs.frozen
class Admission:
    """The cache's pins (owner -> pinned tokens, least recently pinned
    first), `policy.held` and the pin evictions so far, as admission starts."""

    pins: dict[str, int]
    held: dict[str, str]
    evictions: int


@attrs.define(eq=False)
class Flight:
    """A turn between begin and commit/cancel: its sequence (the core's), the
    prompt it was submitted with and the new tokens it brought; once it has
    ended, its final event and the tokens its token events carried."""

    seq: Sequence
    prompt: list[int]
    new: list[int]
    lease: TurnLease  # the turn's identity in the store
    final: FinalEvent | None = None
    streamed: list[int] = attrs.field(factory=list)

    @property
    def reason(self) -> str | None:
        """How the turn ended, by its final event (None while it runs)."""
        return None if self.final is None else self.final.finish_reason


@attrs.define(eq=False)
class Live:
    """The model of one live session."""

    session: Session  # the store's object, for commit and cancel
    last_used: float
    owner: str
    tokens: list[int] = attrs.field(factory=list)  # committed history as tokens
    history_bytes: int = 0
    turns: int = 0
    flight: Flight | None = None
    messages: list[dict] = attrs.field(factory=list)  # committed history, in order

    @property
    def busy(self) -> bool:
        return self.flight is not None


class SessionMachine(RuleBasedStateMachine):
    def __init__(self, tok: Tokenizer) -> None:
        super().__init__()
        self.tok = tok
        self.now = 0.0
        self.pool = BlockPool(BLOCKS, BS)
        self.cache = PrefixCache(self.pool, max_blocks=CACHE_MAX_BLOCKS, idle_s=CACHE_IDLE_S)
        self.policy = ProbedPolicy(
            self.pool,
            max_num_seqs=3,
            max_model_len=MAX_LEN,
            prefill_budget=5,
            max_queue=100,
            prefix_cache=self.cache,
        )
        self.policy.at_admission = self.at_admission
        self.store = SessionStore(
            max_sessions=MAX_SESSIONS,
            idle_s=SESSION_IDLE_S,
            max_history_bytes=HISTORY_BYTES,
            on_remove=self.on_remove,
            quota=QUOTAS.__getitem__,
        )
        # The core sees only the times it is given (every call passes
        # self.now). Its register of orders is checked against a model:
        # (owner, request id) -> "commit" | "cancel", (owner, None) ->
        # "forget", insertion-ordered.
        self.core = EngineCore(self.policy, tok)
        self.orders: dict[tuple[str, str | None], str] = {}
        self.step: StepPlan | None = None  # the step in flight: the scheduler is busy
        self.admission: Admission | None = None  # what the last admission started from
        self.removed: list[str] = []  # what on_remove was told, checked by each rule
        self.counter = 0
        # Model of the store.
        self.live: OrderedDict[str, Live] = OrderedDict()  # least recently used first
        self.ids: list[str] = []  # every session ever created
        self.owner_by_sid: dict[str, str] = {}  # its tenant, for every session ever created
        # The tenant the current rule acts as (None: nobody; TIME: the clock),
        # and what each tenant read after the last rule, at that rule's end.
        self.actor: str | None = None
        self.read: dict[str, tuple] = {}
        self.read_at = 0.0
        self.gone: list[str] = []  # deleted or evicted
        self.evicted = self.committed = self.cancelled = 0
        # Model of the pins: owner -> pinned tokens (whole blocks), least
        # recently pinned first. An owner whose chain is empty (a turn that
        # computed less than one block) pins nothing and is no owner.
        self.pins: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.held: dict[str, str] = {}  # model of policy.held: session -> request whose KV is held
        self.retains: dict[str, str] = {}  # request id -> session, for queued sequences that still retain
        self.owner_of: dict[str, str] = {}  # request id -> session, for every turn ever submitted
        self.requests: dict[str, Sequence] = {}  # every request submitted that has not ended, by id
        self.streamed: dict[str, list[int]] = {}  # the tokens each such request's token events carried
        self.zombies: list[Sequence] = []  # cancelled in the core, ended at its next plan
        self.strays: list[Sequence] = []  # abandoned turns the scheduler has not noticed: they run on
        self.stateless: list[Sequence] = []
        self.spent: list[TurnLease] = []  # leases of turns that ended (committed or cancelled)

    # -- the server's wiring ------------------------------------------------
    def on_remove(self, sid: str) -> None:
        self.removed.append(sid)
        self.settle(sid, "forget")  # engine.forget_retained

    def settle(self, owner: str, order: str, request_id: str | None = None) -> None:
        """core.settle (engine.settle_retained / forget_retained), and its
        model: one entry per (owner, request id), "forget" per (owner,
        None); setting an entry again keeps its place."""
        self.orders[(owner, None if order == "forget" else request_id)] = order
        self.core.settle(owner, order, request_id, self.now)
        assert list(self.core.retention.items()) == list(self.orders.items())

    def submit(self, prompt: list[int], max_tokens: int, retain: str | None) -> Sequence | RequestTooLarge:
        """core.submit under a fresh request id: the core's sequence, or its refusal."""
        self.counter += 1
        rid = f"r{self.counter}"
        refusal = self.core.submit(rid, request(prompt, max_tokens, retain), self.now)
        if refusal is not None:
            assert isinstance(refusal, RequestTooLarge), refusal
            assert rid not in self.core.seqs
            return refusal
        seq = self.core.seqs[rid]
        assert (seq.prompt_ids, seq.retain, set(seq.stop_ids)) == (prompt, retain, {STOP})
        self.requests[rid] = seq
        self.streamed[rid] = []
        return seq

    # -- the scheduler's loop, through the core -------------------------------
    def iterate(self, token: int) -> None:
        """One turn of the scheduler's loop: `core.plan`, then the step (if
        any) with every sampling row given ``token``."""
        with self.busy(token):
            pass

    @contextlib.contextmanager
    def busy(self, token: int) -> Iterator[None]:
        """An iteration whose step runs while the body does: what the body
        submits, cancels or orders waits for the next iteration, except that
        the step's result may end a cancelled request before it is dropped."""
        self.top()
        yield
        self.finish_step(token)

    def top(self) -> None:
        """`core.plan`: every order in the register applies, in order; the
        cancelled requests end (exactly the noticed ones, by their final
        events); admission runs; the next step is planned and is in flight."""
        assert self.step is None and self.core.in_flight is None
        assert list(self.core.retention.items()) == list(self.orders.items())
        orders, self.orders = self.orders, {}
        for (owner, request_id), order in orders.items():
            self.model_settle(owner, order, request_id)
        zombies = sorted(s.id for s in self.zombies)
        self.admission = None
        events, plan = self.core.plan(self.now)
        assert self.core.retention == {}
        assert all(isinstance(e, FinalEvent) and e.finish_reason == "cancelled" for e in events), events
        assert sorted(e.request_id for e in events) == zombies
        self.publish(events)
        assert not self.zombies
        self.admitted()
        assert (plan is None) == (not self.policy.running)
        assert plan is self.core.in_flight
        self.step = plan

    def at_admission(self) -> None:
        """Admission starts (inside `core.plan`): the orders have applied, so
        the pins and `policy.held` must be the model's right now."""
        self.check_pins()
        assert self.policy.held == self.held
        pins = {owner: self.cache.pinned_tokens(owner) for owner in self.cache._pins}
        self.admission = Admission(pins, dict(self.policy.held), self.cache.stats().pin_evictions)

    def admitted(self) -> None:
        """Admission short of room may take whole owners' pins, least
        recently pinned first; nothing else about the pins changes."""
        assert self.admission is not None, "the core planned without admitting"
        before = list(self.admission.pins)
        assert before == list(self.pins)
        after = self.cache._pins
        taken = [owner for owner in before if owner not in after]
        assert before[: len(taken)] == taken, "pins taken out of order"
        assert list(after) == before[len(taken) :]
        assert self.cache.stats().pin_evictions - self.admission.evictions == len(taken)
        for owner in taken:
            del self.pins[owner]

    def finish_step(self, token: int) -> None:
        """`core.result` for the step in flight: every sampling row sampled
        ``token``. A stop id ends every sampling row ("stop", no token
        event); any other token is streamed, and ends only rows that reach
        max_tokens ("length")."""
        plan = self.step
        if plan is None:
            return
        sampling = [row.request_id for row in plan.sampling]  # none when every row is a prompt chunk short of its end
        result = StepResult(plan.number, sampled=tuple((Sampled(token, 0),) for _ in sampling))
        events = self.core.result(result, self.now)
        self.step = None
        assert self.core.in_flight is None
        streamed = [(e.request_id, e.token_id) for e in events if isinstance(e, TokenEvent)]
        ended = [e for e in events if isinstance(e, FinalEvent)]
        assert streamed == ([] if token == STOP else [(rid, token) for rid in sampling])
        assert all(e.finish_reason == ("stop" if token == STOP else "length") for e in ended), ended
        if token == STOP:
            assert sorted(e.request_id for e in ended) == sorted(sampling)
        self.publish(events)
        self.now += STEP_S

    def publish(self, events: list[Event]) -> None:
        """What the core returned, as the requests' consumers see it."""
        for event in events:
            if isinstance(event, TokenEvent):
                self.streamed[event.request_id].append(event.token_id)
            else:
                self.end(event)

    def end(self, final: FinalEvent) -> None:
        """A request's final event: how it ended decides what is held."""
        seq = self.requests.pop(final.request_id)
        streamed = self.streamed.pop(final.request_id)
        assert streamed == seq.output_ids, "the token events are not the output"
        assert final.usage == Usage(len(seq.prompt_ids), seq.generated)
        assert (final.seed, final.draw_end, final.error) == (0, seq.draw_index, None)
        if final.finish_reason == "cancelled":
            assert seq in self.zombies, f"{seq.id} ended cancelled but was never cancelled"
            self.zombies.remove(seq)
            self.retains.pop(seq.id, None)
            if seq in self.stateless:
                self.stateless.remove(seq)
            return
        assert final.finish_reason in ("stop", "length"), final
        computed = seq.history()[: seq.num_cached]
        owner = self.retains.pop(seq.id, None)
        assert seq.retain == owner
        if owner is not None:  # held until its owner settles it
            self.model_pin(held_key(owner), computed)
            self.held[owner] = seq.id
        self.ended(seq, final, streamed)

    def ended(self, seq: Sequence, final: FinalEvent, streamed: list[int]) -> None:
        if seq in self.stateless:
            self.stateless.remove(seq)
            return
        sid = self.owner_of[seq.id]
        if seq in self.strays or seq in self.zombies:
            # Abandoned (a "cancel" order was sent) but ended normally: once
            # that order or a "forget" was applied, it must hold nothing.
            (self.strays if seq in self.strays else self.zombies).remove(seq)
            if (sid, seq.id) not in self.orders and (sid, None) not in self.orders:
                assert self.policy.held.get(sid) != seq.id, "an abandoned turn holds KV after its order was applied"
            return
        flight = self.live[sid].flight
        assert flight is not None and flight.seq is seq and flight.final is None
        flight.final = final
        flight.streamed = streamed

    # -- model of the pins --------------------------------------------------
    def model_pin(self, owner: str, tokens: list[int]) -> None:
        """PrefixCache.pin right after register: the whole chain is cached."""
        self.pins.pop(owner, None)
        if len(tokens) >= BS:
            self.pins[owner] = tuple(tokens[: len(tokens) // BS * BS])

    def model_settle(self, owner: str, order: str, request_id: str | None) -> None:
        """"cancel" and "forget" stop the queued sequences they name (that
        request; all the owner's) from retaining. "commit" and "cancel" act
        on the held KV only when it is that request's; "forget" always, and
        on the owner's own pins too."""
        if order != "commit":
            for rid, o in list(self.retains.items()):
                if o == owner and (order == "forget" or rid == request_id):
                    del self.retains[rid]
        held = held_key(owner)
        if order == "forget" or (owner in self.held and self.held[owner] == request_id):
            self.held.pop(owner, None)
            if order != "commit":
                self.pins.pop(held, None)
            elif held in self.pins:  # else (taken for room, or less than a block) the owner keeps its pins
                tokens = self.pins.pop(held)
                self.pins.pop(owner, None)
                self.pins[owner] = tokens
        if order == "forget":
            self.pins.pop(owner, None)

    def chain_blocks(self, tokens: tuple[int, ...]) -> list[int]:
        """The cached blocks of ``tokens``' whole-block chain; all must be cached."""
        blocks = []
        parent = ROOT
        for i in range(len(tokens) // BS):
            chunk = tokens[i * BS : (i + 1) * BS]
            key = block_key(parent, chunk)
            entry = self.cache._entries.get(key)
            assert entry is not None and entry.tokens == chunk, "a pinned block left the cache"
            blocks.append(entry.block)
            parent = key
        return blocks

    # -- model of the store -------------------------------------------------
    def touch(self, sid: str) -> None:
        self.live[sid].last_used = self.now
        self.live.move_to_end(sid)

    def evict(self, sid: str) -> None:
        assert not self.live[sid].busy
        del self.live[sid]
        self.gone.append(sid)
        self.evicted += 1

    def model_expire(self) -> list[str]:
        out = [sid for sid, s in self.live.items() if not s.busy and self.now - s.last_used > SESSION_IDLE_S]
        for sid in out:
            self.evict(sid)
        return out

    def owned(self, owner: str) -> tuple[int, int]:
        """(sessions, history bytes) the model says ``owner`` keeps."""
        mine = [s for s in self.live.values() if s.owner == owner]
        return len(mine), sum(s.history_bytes for s in mine)

    def would_stay(self, owner: str, size: int) -> bool:
        """A new session of ``owner`` fits once all of ``owner``'s idle ones went."""
        idle = [s for s in self.live.values() if s.owner == owner and not s.busy]
        count, mine = self.owned(owner)
        quota = QUOTAS[owner]
        freed = sum(s.history_bytes for s in idle)
        return (
            count + 1 - len(idle) <= quota.sessions and len(self.live) + 1 - len(idle) <= MAX_SESSIONS
            and mine + size - freed <= quota.history_bytes
            and sum(s.history_bytes for s in self.live.values()) + size - freed <= HISTORY_BYTES
        )  # fmt: skip

    def model_enforce(self, owner: str) -> list[str]:
        """Evict ``owner``'s least recently used idle session while it is over
        its quota or the store over its limits; never another tenant's, so
        the store may stay over its limits when ``owner`` has nothing idle."""
        out = []
        quota = QUOTAS[owner]
        while True:
            count, size = self.owned(owner)
            over = {
                "the tenant's sessions": count > quota.sessions,
                "the tenant's bytes": size > quota.history_bytes,
                "the store's sessions": len(self.live) > MAX_SESSIONS,
                "the store's bytes": sum(s.history_bytes for s in self.live.values()) > HISTORY_BYTES,
            }
            if not any(over.values()):
                break
            idle = [sid for sid, s in self.live.items() if s.owner == owner and not s.busy]
            if not idle:
                break
            event(f"{owner} evicts for {' and '.join(k for k, v in over.items() if v)}")
            self.evict(idle[0])
            out.append(idle[0])
        return out

    def reads(self, owner: str, at: float) -> tuple:
        """What ``owner`` reads of the store at time ``at``, from the store's
        own objects (reading through `get` would expire sessions): its
        sessions that have not expired by then, least recently used first,
        each with everything a client of it sees or continues from."""
        return tuple(
            (
                sid, s.busy, s.last_used, s.created, s.system, s.settings_text, s.record_text, s.seed, s.draw_index,
                s.turns, s.prompt_tokens, s.completion_tokens, tuple(tuple(sorted(m.items())) for m in s.messages),
            )  # fmt: skip
            for sid, s in self.store._sessions.items()
            if s.owner == owner and (s.busy or at - s.last_used <= SESSION_IDLE_S)
        )

    def act_as(self, owner: str | None) -> None:
        """The current rule acts as ``owner`` (one tenant at most per rule)."""
        assert self.actor in (None, owner), f"a rule acting as both {self.actor!r} and {owner!r}"
        self.actor = owner

    def check_removed(self, expected: list[str]) -> None:
        assert self.removed == expected, "on_remove was told of other sessions than the model removed"
        self.removed.clear()

    def idle_ids(self) -> list[str]:
        return [sid for sid, s in self.live.items() if not s.busy]

    def busy_ids(self) -> list[str]:
        return [sid for sid, s in self.live.items() if s.busy]

    def finished_ids(self) -> list[str]:
        return [sid for sid, s in self.live.items() if s.flight is not None and s.flight.reason is not None]

    def running_ids(self) -> list[str]:
        return [sid for sid, s in self.live.items() if s.flight is not None and s.flight.reason is None]

    def queued(self) -> list[Sequence]:
        """What the machine knows the core has: turns running, abandoned
        turns, stateless requests."""
        flights = [live.flight for live in self.live.values() if live.flight is not None]
        return [f.seq for f in flights if f.reason is None] + self.strays + self.zombies + self.stateless

    # -- rules: the connection's side ---------------------------------------
    @initialize()
    def start(self):
        for owner in OWNERS:
            self.create_session(owner, None)

    @precondition(lambda self: len(self.ids) < 10)
    @rule(owner=st.sampled_from(OWNERS), defaults=st.sampled_from(SETTINGS))
    def create(self, owner, defaults):
        self.act_as(owner)
        self.create_session(owner, defaults)

    def create_session(self, owner: str, defaults: dict | None) -> None:
        """A tenant full of busy sessions is refused; one session that alone
        is more than the tenant may keep is refused, naming its largest
        field; otherwise the tenant makes room from its own idle sessions,
        and a session that could not stay even then is refused (429) rather
        than made and evicted at once."""
        expected = self.model_expire()
        size = len(compact_json(defaults).encode()) if defaults else 0  # no settings: nothing counted for them
        quota = QUOTAS[owner]
        full = self.owned(owner)[0] >= min(quota.sessions, MAX_SESSIONS)
        if full and not any(s.owner == owner and not s.busy for s in self.live.values()):
            event(f"{owner}'s create refused: QuotaExceeded")
            with pytest.raises(QuotaExceeded):
                self.store.create(self.now, defaults=defaults, owner=owner)
        elif size > min(quota.history_bytes, HISTORY_BYTES):
            event("create refused: settings too large")
            with pytest.raises(RequestError) as refusal:
                self.store.create(self.now, defaults=defaults, owner=owner)
            assert refusal.value.field == "t"
        elif not self.would_stay(owner, size):
            event(f"{owner}'s create refused: it would be evicted at once")
            with pytest.raises(QuotaExceeded, match="none of this API key's is idle"):
                self.store.create(self.now, defaults=defaults, owner=owner)
        else:
            session = self.store.create(self.now, defaults=defaults, owner=owner)
            assert session.owner == owner and session.settings_text == compact_json(defaults or {})
            self.live[session.id] = Live(session, self.now, owner, history_bytes=size)
            self.ids.append(session.id)
            self.owner_by_sid[session.id] = owner
            expected += self.model_enforce(owner)
            assert session.id in self.live, "a session made was evicted at once"
        self.check_removed(expected)

    @precondition(lambda self: self.idle_ids())
    @rule(
        data=st.data(),
        new=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4),
        max_tokens=st.integers(1, 4),
        wake=st.booleans(),
        token=st.sampled_from(SAMPLED),
    )
    def begin(self, data, new, max_tokens, wake, token):
        """With ``wake`` the scheduler was idle and runs an iteration at once
        (orders, admission, a step); otherwise it is busy with a step, and
        orders sent meanwhile wait with the submission for its next
        iteration."""
        sid = data.draw(st.sampled_from(self.idle_ids()), label="session")
        if wake:
            self.begin_turn(sid, new, max_tokens, token=token)
            return
        with self.busy(token):
            self.begin_turn(sid, new, max_tokens)

    def begin_turn(self, sid: str, new: list[int], max_tokens: int, *, token: int | None = None) -> Flight | None:
        """store.begin (as the session's tenant), then submit the turn's
        request (retain=sid); with ``token``, the scheduler wakes and runs an
        iteration."""
        owner = self.owner_by_sid[sid]
        self.act_as(owner)
        expected = self.model_expire()
        if sid not in self.live:  # expired just now
            with pytest.raises(SessionNotFound):
                self.store.begin(sid, self.now, owner=owner)
            self.check_removed(expected)
            return None
        live = self.live[sid]
        lease = self.store.begin(sid, self.now, owner=owner)
        session = lease.session
        self.check_removed(expected)
        assert session is live.session and session.busy and lease.current
        self.touch(sid)
        prompt = live.tokens + new
        seq = self.submit(prompt, max_tokens, sid)
        if isinstance(seq, RequestTooLarge):
            # Nothing was submitted: the store cancels, no order is sent.
            assert len(prompt) + max_tokens > MAX_LEN
            assert self.store.cancel(lease, self.now)
            self.spent.append(lease)
            self.cancelled += 1
            self.touch(sid)
            return None
        self.retains[seq.id] = self.owner_of[seq.id] = sid
        live.flight = Flight(seq, prompt, new, lease)
        flight = live.flight
        if token is not None:
            self.iterate(token)
        return flight

    @precondition(lambda self: self.idle_ids())
    @rule(
        data=st.data(),
        new=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4),
        max_tokens=st.integers(1, 4),
        token=st.sampled_from(SAMPLED),
        commit=st.sampled_from([True, True, True, False]),
    )
    def whole_turn(self, data, new, max_tokens, token, commit):
        """Begin, run the scheduler until the turn's sequence ends (others
        run too), then settle it: a whole turn in one rule, so histories and
        their pins grow long."""
        sid = data.draw(st.sampled_from(self.idle_ids()), label="session")
        flight = self.begin_turn(sid, new, max_tokens)
        if flight is None:
            return
        for _ in range(100):
            if flight.reason is not None:
                break
            self.iterate(token)
        else:
            raise AssertionError("the turn never finished")
        self.settle_finished(sid, commit)

    @precondition(lambda self: self.finished_ids())
    @rule(data=st.data(), commit=st.sampled_from([True, True, True, False]))
    def settle_turn(self, data, commit):
        """A finished turn's final response goes out (commit), or it never
        does (client gone, error: cancel)."""
        self.settle_finished(data.draw(st.sampled_from(self.finished_ids()), label="session"), commit)

    def settle_finished(self, sid: str, commit: bool) -> None:
        self.act_as(self.owner_by_sid[sid])
        if commit:
            self.commit(sid)
            return
        live = self.live[sid]
        request_id = live.flight.seq.id
        assert self.store.cancel(live.flight.lease, self.now)
        self.spent.append(live.flight.lease)
        live.flight = None
        self.cancelled += 1
        self.touch(sid)
        self.settle(sid, "cancel", request_id)  # engine.settle_retained(commit=False)

    def commit(self, sid: str) -> None:
        """The turn's final response went out: the store keeps what its
        events said (the streamed tokens, the final's usage, seed and draw
        end), then a "commit" order names its request."""
        self.act_as(self.owner_by_sid[sid])
        live = self.live[sid]
        flight = live.flight
        final = flight.final
        request_id = final.request_id
        assert request_id == flight.seq.id
        # Each turn's messages name its request, so the history's order shows.
        messages = (
            {"role": "user", "content": "u" * len(flight.new), "name": request_id},
            {"role": "assistant", "content": "a" * len(flight.streamed), "name": request_id},
        )
        turn = Turn(
            messages=messages,
            seed=final.seed,
            draw_end=final.draw_end,
            prompt_tokens=final.usage.prompt_tokens,
            completion_tokens=final.usage.completion_tokens,
        )
        self.store.commit(flight.lease, turn, self.now)
        self.spent.append(flight.lease)
        live.messages.extend(messages)
        live.flight = None
        live.tokens = flight.prompt + flight.streamed
        assert live.tokens == flight.seq.history()
        live.history_bytes += len(flight.new) + len(flight.streamed)
        live.turns += 1
        self.committed += 1
        self.touch(sid)
        # Committing can evict, even this session (its history over the bytes limit).
        self.check_removed(self.model_enforce(live.owner))
        self.settle(sid, "commit", request_id)  # engine.settle_retained(commit=True), after the store
        assert not self.store.cancel(flight.lease, self.now)  # the actor's last settle: nothing left to cancel

    @precondition(lambda self: self.running_ids())
    @rule(
        data=st.data(),
        noticed=st.booleans(),
        delete=st.sampled_from([False, False, True]),
        mid_step=st.booleans(),
        token=st.sampled_from(SAMPLED),
    )
    def abandon(self, data, noticed, delete, mid_step, token):
        """The client leaves while its turn waits or runs: the store cancels
        and a "cancel" order names the turn's request. The scheduler notices
        (`core.cancel`: the request ends "cancelled" at the next plan) or
        not yet (it runs on, and may end normally after its order was
        applied: it must then hold nothing). With ``delete`` the session is
        deleted right after (a "forget" order too); with ``mid_step`` all
        this happens while a step runs, so that step may end the sequence
        before the orders apply (and the turn's KV is held until they do)."""
        sid = data.draw(st.sampled_from(self.running_ids()), label="session")
        with self.busy(token) if mid_step else contextlib.nullcontext():
            self.abandon_turn(sid, noticed=noticed)
            if delete:
                self.delete_session(sid)

    def abandon_turn(self, sid: str, *, noticed: bool) -> None:
        self.act_as(self.owner_by_sid[sid])
        live = self.live[sid]
        seq = live.flight.seq
        assert live.flight.reason is None
        if noticed:
            self.core.cancel(seq.id, self.now)
            self.zombies.append(seq)
        else:
            self.strays.append(seq)
        assert self.store.cancel(live.flight.lease, self.now)
        self.spent.append(live.flight.lease)
        live.flight = None
        self.cancelled += 1
        self.touch(sid)
        self.settle(sid, "cancel", seq.id)  # engine.settle_retained(commit=False)

    @precondition(lambda self: self.spent)
    @rule(data=st.data())
    def stale_settle(self, data):
        """A turn that ended is settled again, late (a second cleanup path;
        the session actor settles once, so the lease is the second line of
        defence): its cancel does nothing and its commit is
        refused, whatever turn its session runs now. The HTTP side sends an
        order only when its cancel returned True, so none goes out."""
        lease = data.draw(st.sampled_from(self.spent), label="lease")
        self.act_as(lease.session.owner)
        assert not lease.current
        assert not self.store.cancel(lease, self.now)
        with pytest.raises(StaleTurn):
            self.store.commit(lease, Turn(({"role": "user", "content": "stale"},), 1, 99, 1, 1), self.now)

    @precondition(lambda self: self.running_ids())
    @rule(
        data=st.data(),
        new=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4),
        max_tokens=st.integers(1, 4),
        noticed=st.booleans(),
        token=st.sampled_from(SAMPLED),
    )
    def cut_then_next(self, data, new, max_tokens, noticed, token):
        """A streamed turn is cut at whatever event it has reached, and the
        client starts the next turn at once on another connection; then the
        cut turn's cleanup runs again, late. The next turn keeps running (a
        third is still refused) and later settles on its own."""
        sid = data.draw(st.sampled_from(self.running_ids()), label="session")
        cut = self.live[sid].flight.lease
        self.abandon_turn(sid, noticed=noticed)
        wake = data.draw(st.booleans(), label="wake")
        flight = self.begin_turn(sid, new, max_tokens, token=token if wake else None)
        assert not self.store.cancel(cut, self.now)  # the late cleanup
        if flight is None:
            return
        owner = self.owner_by_sid[sid]
        assert self.store.get(sid, self.now, owner=owner).busy and flight.lease.current
        with pytest.raises(SessionBusy):
            self.store.begin(sid, self.now, owner=owner)
        self.iterate(token)

    @precondition(lambda self: self.strays)
    @rule(data=st.data())
    def notice(self, data):
        """The scheduler notices at last that an abandoned turn's client is gone."""
        seq = data.draw(st.sampled_from(self.strays), label="stray")
        self.core.cancel(seq.id, self.now)
        self.strays.remove(seq)
        self.zombies.append(seq)

    @precondition(lambda self: self.finished_ids())
    @rule(
        data=st.data(),
        new=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4),
        max_tokens=st.integers(1, 4),
        noticed=st.booleans(),
        token=st.sampled_from(SAMPLED),
    )
    def commit_then_abandon_next(self, data, new, max_tokens, noticed, token):
        """Turn N is committed while the scheduler is busy with a step (its
        "commit" order waits), then turn N+1 is begun and abandoned before
        the next iteration: both orders apply there, in order, so N's KV
        becomes the session's and N+1's cancel changes nothing held."""
        sid = data.draw(st.sampled_from(self.finished_ids()), label="session")
        with self.busy(token):
            request_id = self.live[sid].flight.seq.id
            assert self.policy.held.get(sid) == request_id
            # What the commit must leave the session: N's held chain, or, when
            # that was taken for room or is less than a block, what it pinned before.
            expected = self.pins.get(held_key(sid), self.pins.get(sid, ()))
            self.commit(sid)
            flight = self.begin_turn(sid, new, max_tokens)
            if flight is not None:
                self.abandon_turn(sid, noticed=noticed)
            assert (sid, request_id) in self.orders
        kept = sid in self.live  # committing may have evicted it
        self.top()
        # As admission started, right after the orders applied:
        pinned = self.admission.pins
        if kept:
            assert pinned.get(sid, 0) == len(expected), "a pending commit was lost"
            assert pinned.get(held_key(sid), 0) == 0 and sid not in self.admission.held
        else:
            assert pinned.get(sid, 0) == pinned.get(held_key(sid), 0) == 0
        self.finish_step(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def delete(self, data):
        self.delete_session(data.draw(st.sampled_from(list(self.live)), label="session"))

    def delete_session(self, sid: str) -> None:
        owner = self.owner_by_sid[sid]
        self.act_as(owner)
        expected = self.model_expire()
        if sid not in self.live:
            with pytest.raises(SessionNotFound):
                self.store.delete(sid, self.now, owner=owner)
        elif self.live[sid].busy:
            with pytest.raises(SessionBusy):
                self.store.delete(sid, self.now, owner=owner)
            assert self.store.get(sid, self.now, owner=owner) is self.live[sid].session
        else:
            self.store.delete(sid, self.now, owner=owner)
            del self.live[sid]
            self.gone.append(sid)
            expected.append(sid)
        self.check_removed(expected)

    @precondition(lambda self: self.busy_ids() or self.gone)
    @rule(data=st.data(), op=st.sampled_from(["get", "begin", "delete"]))
    def refused(self, data, op):
        """A second turn on a busy session, or deleting it, is refused (409);
        anything on a deleted, evicted or unknown session is not found (404),
        whichever tenant asks."""
        sid = data.draw(st.sampled_from([*self.busy_ids(), *self.gone, "sess-never-made"]), label="session")
        owner = self.owner_by_sid[sid] if sid in self.live else data.draw(st.sampled_from(OWNERS), label="owner")
        self.act_as(owner)
        expected = self.model_expire()  # never a busy session
        if sid in self.live and op == "get":
            assert self.store.get(sid, self.now, owner=owner) is self.live[sid].session
        else:
            with pytest.raises(SessionBusy if sid in self.live else SessionNotFound):
                getattr(self.store, op)(sid, self.now, owner=owner)
        self.check_removed(expected)

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), op=st.sampled_from(["get", "use", "begin", "check_delete", "delete"]))
    def trespass(self, data, op):
        """A tenant names the other's session, idle, busy or gone: it is not
        found, with the very error an id never made gets, and nothing
        changes (no turn begins, nothing is deleted, nothing counts as used;
        only what has expired goes, as at any call)."""
        sid = data.draw(st.sampled_from(self.ids), label="session")
        (intruder,) = [o for o in OWNERS if o != self.owner_by_sid[sid]]
        self.act_as(intruder)
        expected = self.model_expire()
        before = {owner: self.reads(owner, self.now) for owner in OWNERS}
        call = {
            "get": lambda i: self.store.get(i, self.now, owner=intruder),
            "use": lambda i: self.store.get(i, self.now, use=True, owner=intruder),
            "begin": lambda i: self.store.begin(i, self.now, owner=intruder),
            "check_delete": lambda i: self.store.check_delete(i, self.now, owner=intruder),
            "delete": lambda i: self.store.delete(i, self.now, owner=intruder),
        }[op]
        with pytest.raises(SessionNotFound) as refusal:
            call(sid)
        with pytest.raises(SessionNotFound) as unknown:
            call("sess-never-made")
        assert type(refusal.value) is type(unknown.value) is SessionNotFound
        assert str(refusal.value) == str(unknown.value).replace("sess-never-made", sid)
        assert {owner: self.reads(owner, self.now) for owner in OWNERS} == before
        self.check_removed(expected)
        if sid in self.live:
            event(f"trespass on a {'busy' if self.live[sid].busy else 'idle'} session")

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 5.0, 11.0]), expire=st.booleans())
    def tick(self, dt, expire):
        """Time passes; the store expires idle sessions now, or at its next call."""
        self.now += dt
        if expire:
            self.act_as(TIME)
            expected = self.model_expire()
            self.store.expire(self.now)
            self.check_removed(expected)

    # -- rules: the scheduler's side ----------------------------------------
    @precondition(lambda self: not self.stateless and len(self.cache))
    @rule(blocks=st.integers(6, MAX_LEN // BS), max_tokens=st.integers(1, 3), token=st.sampled_from(SAMPLED))
    def hog(self, blocks, max_tokens, token):
        """A stateless request that needs most of the pool: admission takes
        idle blocks first, then whole owners' pins. Its first block is its
        own (no other prompt starts with it), so it shares nothing cached."""
        span = self.tok.vocab_size - HOG_BASE
        first = [HOG_BASE + self.counter % span, HOG_BASE + self.counter // span % span]
        prompt = first + [HOG_BASE + i for i in range(blocks * BS - max_tokens - len(first))]
        seq = self.submit(prompt, max_tokens, None)
        assert isinstance(seq, Sequence), seq
        self.stateless.append(seq)
        self.iterate(token)

    @precondition(lambda self: self.policy.waiting or self.policy.running or self.orders)
    @rule(tokens=st.lists(st.sampled_from(SAMPLED), min_size=1, max_size=6))
    def run(self, tokens):
        for token in tokens:
            self.iterate(token)

    @precondition(lambda self: self.policy.waiting or self.policy.running)
    @rule(token=st.sampled_from(SAMPLED[:-1]))
    def run_to_end(self, token):
        for _ in range(200):
            if not (self.policy.waiting or self.policy.running):
                return
            self.iterate(token)
        raise AssertionError("sequences never finished: something waits forever")

    # -- invariants ---------------------------------------------------------
    @invariant()
    def idle_between_rules(self):
        assert self.step is None and self.core.in_flight is None

    @invariant()
    def store_matches_model(self):
        assert list(self.store._sessions) == list(self.live)  # same sessions, same LRU order
        assert len(self.store) == len(self.live)
        busy = len(self.busy_ids())
        assert self.store.stats() == {
            "active": len(self.live),
            "busy": busy,
            "evicted": self.evicted,
            "turns_committed": self.committed,
            "turns_cancelled": self.cancelled,
        }
        for live in self.live.values():
            s = live.session
            assert (s.busy, s.turns, s.last_used, s.history_bytes()) == (live.busy, live.turns, live.last_used, live.history_bytes)
            assert s.owner == live.owner
            assert s.messages == live.messages, "the history is not exactly the committed turns, in order"
        # Each tenant within its quota, and the store within its limits: what
        # one tenant adds is idle, so it can always make room from its own.
        for owner in OWNERS:
            count, size = self.store.owned(owner)
            assert (count, size) == self.owned(owner)
            assert count <= QUOTAS[owner].sessions and size <= QUOTAS[owner].history_bytes
        assert set(self.store._owned) == {live.owner for live in self.live.values()}
        assert len(self.store) <= MAX_SESSIONS
        assert sum(live.history_bytes for live in self.live.values()) <= HISTORY_BYTES
        # Every turn in flight belongs to a live session, and its sequence is
        # the scheduler's; the scheduler has nothing else but abandoned turns
        # and stateless requests, and each retains as the model says. The
        # core's requests (those with no final event yet) are exactly these.
        queued = list(self.policy.waiting) + list(self.policy.running)
        for live in self.live.values():
            if live.flight is not None and live.flight.reason is None:
                assert live.flight.seq in queued
                assert live.flight.seq.retain == live.session.id
        assert sorted(s.id for s in queued) == sorted(s.id for s in self.queued())
        assert sorted(self.core.seqs) == sorted(self.requests) == sorted(s.id for s in queued)
        for seq in queued:
            assert seq.retain == self.retains.get(seq.id), f"{seq.id} retains for {seq.retain!r}"

    @invariant()
    def tenants_isolated(self):
        """What each tenant the last rule did not act as reads now is what it
        read before that rule (at that time, so that what expired meanwhile
        is no difference): no tenant's call creates, evicts, deletes, begins,
        commits, reorders or touches another's sessions, and the
        scheduler's work changes none. The clock's sweep is nobody's."""
        if self.read and self.actor != TIME:
            for owner in OWNERS:
                if owner != self.actor:
                    assert self.reads(owner, self.read_at) == self.read[owner], f"{self.actor!r} changed what {owner!r} reads"
        if self.actor in OWNERS and any(self.read.get(owner) for owner in OWNERS if owner != self.actor):
            event("a tenant acted while the other kept sessions")
        self.actor = None
        self.read = {owner: self.reads(owner, self.now) for owner in OWNERS}
        self.read_at = self.now

    @invariant()
    def blocks_add_up(self):
        tables = [self.pool.table(s.id) for s in self.policy.running]
        for seq in self.policy.waiting:
            assert self.pool.table(seq.id) == []
        cached = {e.block for e in self.cache._entries.values()}
        assert len(cached) == len(self.cache)
        pinned = Counter(b for tokens in self.pins.values() for b in self.chain_blocks(tokens))
        for b in range(BLOCKS):
            expected = sum(b in t for t in tables) + (b in cached) + pinned[b]
            assert self.pool.refcount(b) == expected, f"block {b}"
        assert self.pool.num_free == sum(self.pool.refcount(b) == 0 for b in range(BLOCKS))

    @invariant()
    def pins_match_model(self):
        self.check_pins()

    def check_pins(self) -> None:
        actual = [
            (owner, tuple(t for b in blocks for t in self.cache._entries[self.key_of(b)].tokens))
            for owner, blocks in self.cache._pins.items()
        ]
        assert actual == list(self.pins.items())
        s = self.cache.stats()
        assert s.pinned_owners == len(self.pins)
        assert s.pinned_blocks == len({b for tokens in self.pins.values() for b in self.chain_blocks(tokens)})
        for owner, tokens in self.pins.items():
            assert self.cache.pinned_tokens(owner) == len(tokens)

    def key_of(self, block: int) -> bytes:
        (key,) = [k for k, e in self.cache._entries.items() if e.block == block]
        return key

    @invariant()
    def pins_belong_to_live_sessions(self):
        assert self.policy.held == self.held
        forgetting = {owner for owner, request_id in self.orders if request_id is None}
        by_held = {held_key(sid): sid for sid in self.ids}
        for owner, tokens in self.pins.items():
            sid = by_held.get(owner, owner)
            assert sid in self.ids, f"pins for an owner that never was a session: {owner!r}"
            if sid in forgetting:
                continue  # the next iteration lets go of them
            assert sid in self.live, "KV kept for a session that is gone, and no order will let it go"
            if owner == sid:
                assert list(tokens) == self.live[sid].tokens[: len(tokens)], "a session keeps tokens it never committed"
            else:
                assert sid in self.policy.held, "KV held for no request"
        for request_id, sid in self.retains.items():
            assert sid in self.live or sid in forgetting, "a request retains for a session that is gone"
        # KV is held for a request only while it is the session's finished
        # turn waiting to be settled, or an order about it waits to apply;
        # and every such turn has its KV held.
        for sid, request_id in self.policy.held.items():
            if (sid, request_id) in self.orders or sid in forgetting:
                continue
            live = self.live.get(sid)
            assert live is not None, "KV held for a session that is gone, and no order will let it go"
            flight = live.flight
            assert flight is not None and flight.reason is not None and flight.seq.id == request_id, (
                "KV held for a request that is not the session's finished turn"
            )
            tokens = self.pins.get(held_key(sid), ())
            assert list(tokens) == flight.seq.history()[: len(tokens)]
        for sid in self.finished_ids():
            assert self.policy.held.get(sid) == self.live[sid].flight.seq.id

    def teardown(self):
        if self.step is not None or self.core.in_flight is not None:
            return  # a rule failed mid-step: that failure is the report
        # Every request's consumer leaves: the core ends them all at its next plan.
        queued = self.queued()
        for seq in queued:
            if seq not in self.zombies:
                self.core.cancel(seq.id, self.now)
        self.zombies = list(queued)
        self.strays.clear()
        for sid, live in self.live.items():
            if live.busy:
                request_id = live.flight.seq.id
                assert self.store.cancel(live.flight.lease, self.now)
                self.settle(sid, "cancel", request_id)
        for sid in self.ids:
            self.settle(sid, "forget")
        self.top()
        assert self.step is None, "a step was planned after everything was cancelled"
        assert not self.policy.waiting and not self.policy.running and not self.core.seqs
        assert self.policy.held == {} and not self.retains
        s = self.cache.stats()
        assert (s.pinned_owners, s.pinned_blocks) == (0, 0)
        self.cache.clear()
        assert len(self.cache) == 0
        assert self.pool.num_free == BLOCKS


def test_session_machine(tok):
    run_state_machine_as_test(
        lambda: SessionMachine(tok),
        settings=settings(
            max_examples=100,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
