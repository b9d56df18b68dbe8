"""Sessions and the KV they keep, driven at random with no trio running:
a SessionStore whose removals become "forget" orders, a SchedulingPolicy
over a PrefixCache and a small BlockPool, and the scheduler's register of
retention orders (a real `Scheduler`'s `retention`, written by its `settle`
and checked against a model after every order: "commit"/"cancel" keyed by
(owner, request id), "forget" by (owner, None), insertion-ordered), applied
in order by `SchedulingPolicy.settle` at the top of every scheduler
iteration before cancelled sequences are dropped and admission runs, as
`Scheduler.steps` does. The connection's side follows
`trioserve/http/sessions.py`: begin, submit with retain=<session id>, then
commit (store, then a "commit" order naming the request) or cancel (store,
then a "cancel" order naming it when the store returned True).

After every step the store's accounting must match a model of its sessions
(LRU order, busy, eviction by idle time, count and history bytes, the
counters), every pool block's reference count must be exactly the running
sequences that hold it, the cache's own reference and one per owner pinning
it, the pins, `policy.held` and each queued sequence's `retain` must match a
model of what finishing and each order do; unless a "forget" is pending for
it, nothing is pinned, held or retained for a session that is gone; a
session's own pins are a prefix of its committed tokens; and `policy.held`
names a request for a session only while that request is the session's
finished turn waiting to be settled, or an order about it is pending.
Teardown ends everything and forgets every session: the pool must then be
all free.

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
most of the pool; scheduler iterations."""

from __future__ import annotations

from collections import Counter, OrderedDict

import attrs
import pytest
from hypothesis import HealthCheck, settings
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
from trioserve.errors import RequestTooLarge
from trioserve.models.detokenizer import IncrementalDetokenizer
from trioserve.types import SamplingParams
from trioserve.models.tokenizer import Tokenizer
from trioserve.state.kv_pool import BlockPool
from trioserve.state.prefix_cache import ROOT, PrefixCache, block_key, held_key
from trioserve.state.scheduling import SchedulingPolicy
from trioserve.state.sequence import Sequence
from trioserve.state.session_store import Session, SessionBusy, SessionNotFound, SessionStore, StaleTurn, Turn, TurnLease
from trioserve.state.stops import StopMatcher

BS = 2  # tokens per block
BLOCKS = 16
MAX_LEN = 24  # a request fits in at most 12 of the 16 blocks
CACHE_MAX_BLOCKS = 3  # the cache's own limits: what nobody pins goes quickly
CACHE_IDLE_S = 4.0
MAX_SESSIONS = 3
SESSION_IDLE_S = 10.0
HISTORY_BYTES = 16
STEP_S = 0.1  # the clock moves this much per scheduler iteration
STOP = 2  # the stop id every sequence has
ALPHABET = [5, 6]  # new prompt tokens: small, so histories share blocks
SAMPLED = [5, 6, 7, STOP]  # what a step samples (every sampling row the same)


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_checkpoints["hf"])


def build_seq(tok: Tokenizer, sid: str, prompt: list[int], max_tokens: int, retain: str | None) -> Sequence:
    return Sequence(
        id=sid,
        prompt_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        seed=0,
        stop_ids=frozenset({STOP}),
        detokenizer=IncrementalDetokenizer(tok),
        stops=StopMatcher(()),
        arrival=0.0,
        retain=retain,
    )


@attrs.define(eq=False)
class Flight:
    """A turn between begin and commit/cancel: its sequence, the new tokens
    it brought, and how the sequence ended (None while it runs)."""

    seq: Sequence
    new: list[int]
    lease: TurnLease  # the turn's identity in the store
    reason: str | None = None


@attrs.define(eq=False)
class Live:
    """The model of one live session."""

    session: Session  # the store's object, for commit and cancel
    last_used: float
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
        self.policy = SchedulingPolicy(
            self.pool,
            max_num_seqs=3,
            max_model_len=MAX_LEN,
            prefill_budget=5,
            max_queue=100,
            prefix_cache=self.cache,
            clock=lambda: self.now,
        )
        self.store = SessionStore(
            max_sessions=MAX_SESSIONS,
            idle_s=SESSION_IDLE_S,
            max_history_bytes=HISTORY_BYTES,
            on_remove=self.on_remove,
        )
        # The real register of orders (only `settle` and `retention` are used,
        # with no trio running), and its model: (owner, request id) ->
        # "commit" | "cancel", (owner, None) -> "forget", insertion-ordered.
        self.scheduler = EngineCore(self.policy, tok)
        self.policy.clock = lambda: self.now
        self.orders: dict[tuple[str, str | None], str] = {}
        self.removed: list[str] = []  # what on_remove was told, checked by each rule
        self.counter = 0
        # Model of the store.
        self.live: OrderedDict[str, Live] = OrderedDict()  # least recently used first
        self.ids: list[str] = []  # every session ever created
        self.gone: list[str] = []  # deleted or evicted
        self.evicted = self.committed = self.cancelled = 0
        # Model of the pins: owner -> pinned tokens (whole blocks), least
        # recently pinned first. An owner whose chain is empty (a turn that
        # computed less than one block) pins nothing and is no owner.
        self.pins: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.held: dict[str, str] = {}  # model of policy.held: session -> request whose KV is held
        self.retains: dict[str, str] = {}  # request id -> session, for queued sequences that still retain
        self.owner_of: dict[str, str] = {}  # request id -> session, for every turn ever submitted
        self.zombies: list[Sequence] = []  # cancelled, dropped at the next iteration
        self.strays: list[Sequence] = []  # abandoned turns the scheduler has not noticed: they run on
        self.stateless: list[Sequence] = []
        self.spent: list[TurnLease] = []  # leases of turns that ended (committed or cancelled)

    # -- the server's wiring ------------------------------------------------
    def on_remove(self, sid: str) -> None:
        self.removed.append(sid)
        self.settle(sid, "forget")  # engine.forget_retained

    def settle(self, owner: str, order: str, request_id: str | None = None) -> None:
        """Scheduler.settle (engine.settle_retained / forget_retained), and
        its model: one entry per (owner, request id), "forget" per (owner,
        None); setting an entry again keeps its place."""
        self.orders[(owner, None if order == "forget" else request_id)] = order
        self.scheduler.settle(owner, order, request_id, self.now)
        assert list(self.scheduler.retention.items()) == list(self.orders.items())

    def iterate(self, token: int | None = None) -> None:
        """One turn of Scheduler.steps: orders, cancelled, admission, a step."""
        self.top()
        if token is not None and self.policy.running:
            self.step(token)
            self.now += STEP_S

    def top(self) -> None:
        """The top of an iteration, before its step."""
        self.apply_orders()
        self.drop_cancelled()
        self.admit()

    def apply_orders(self) -> None:
        """Scheduler._apply_retention: every order in the register, in order."""
        orders, self.scheduler.retention = self.scheduler.retention, {}
        assert list(orders.items()) == list(self.orders.items())
        self.orders = {}
        for (owner, request_id), order in orders.items():
            self.policy.settle(owner, order, request_id)
            self.model_settle(owner, order, request_id)
        if orders:
            self.cache.trim(self.now)

    def drop_cancelled(self) -> None:
        dropped = self.policy.drop_cancelled()
        assert sorted(s.id for s in dropped) == sorted(s.id for s in self.zombies)
        assert all(s.finish_reason == "cancelled" for s in dropped)
        for seq in dropped:
            self.retains.pop(seq.id, None)
        self.zombies.clear()

    def admit(self) -> None:
        before = list(self.pins)
        evictions = self.cache.stats().pin_evictions
        self.policy.admit(self.now)
        # Admission short of room may take whole owners' pins, least recently
        # pinned first; nothing else about the pins changes.
        after = self.cache._pins
        taken = [owner for owner in before if owner not in after]
        assert before[: len(taken)] == taken, "pins taken out of order"
        assert list(after) == before[len(taken) :]
        assert self.cache.stats().pin_evictions - evictions == len(taken)
        for owner in taken:
            del self.pins[owner]

    def step(self, token: int) -> None:
        rows = self.policy.plan()
        assert rows
        self.policy.stepped(rows)
        for row in rows:
            if not row.samples:
                continue
            seq = row.seq
            outcome = seq.commit(token, 0, self.now)
            if outcome.finish_reason is None:
                continue
            assert outcome.finish_reason in ("stop", "length")
            computed = seq.history()[: seq.num_cached]
            owner = self.retains.pop(seq.id, None)
            assert seq.retain == owner
            self.policy.finish(seq, outcome.finish_reason)
            if owner is not None:  # held until its owner settles it
                self.model_pin(held_key(owner), computed)
                self.held[owner] = seq.id
            self.ended(seq, outcome.finish_reason)

    def ended(self, seq: Sequence, reason: str) -> None:
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
        assert flight is not None and flight.seq is seq and flight.reason is None
        flight.reason = reason

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

    def model_enforce(self) -> list[str]:
        """Evict the least recently used idle session while over a limit."""
        out = []
        while len(self.live) > MAX_SESSIONS or sum(s.history_bytes for s in self.live.values()) > HISTORY_BYTES:
            idle = [sid for sid, s in self.live.items() if not s.busy]
            if not idle:
                break
            self.evict(idle[0])
            out.append(idle[0])
        return out

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

    def new_seq(self, prompt: list[int], max_tokens: int, retain: str | None) -> Sequence:
        self.counter += 1
        return build_seq(self.tok, f"r{self.counter}", prompt, max_tokens, retain)

    # -- rules: the connection's side ---------------------------------------
    @initialize()
    def start(self):
        self.create()
        self.create()

    @precondition(lambda self: len(self.live) <= MAX_SESSIONS and len(self.ids) < 8)
    @rule()
    def create(self):
        expected = self.model_expire()
        session = self.store.create(self.now)
        self.live[session.id] = Live(session, self.now)
        self.ids.append(session.id)
        expected += self.model_enforce()  # may be the new session itself, when all others are busy
        self.check_removed(expected)

    @precondition(lambda self: self.idle_ids())
    @rule(
        data=st.data(),
        new=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4),
        max_tokens=st.integers(1, 4),
        wake=st.booleans(),
    )
    def begin(self, data, new, max_tokens, wake):
        """With ``wake`` the scheduler was idle and runs an iteration at once
        (orders, admission); otherwise it is busy with a step, and orders
        sent meanwhile wait with the submission for its next iteration."""
        self.begin_turn(data.draw(st.sampled_from(self.idle_ids()), label="session"), new, max_tokens, wake=wake)

    def begin_turn(self, sid: str, new: list[int], max_tokens: int, *, wake: bool = True) -> Flight | None:
        """store.begin, then submit the turn's sequence (retain=sid)."""
        expected = self.model_expire()
        if sid not in self.live:  # expired just now
            with pytest.raises(SessionNotFound):
                self.store.begin(sid, self.now)
            self.check_removed(expected)
            return None
        live = self.live[sid]
        lease = self.store.begin(sid, self.now)
        session = lease.session
        self.check_removed(expected)
        assert session is live.session and session.busy and lease.current
        self.touch(sid)
        seq = self.new_seq(live.tokens + new, max_tokens, sid)
        try:
            self.policy.enqueue(seq)
        except RequestTooLarge:
            # Nothing was submitted: the store cancels, no order is sent.
            assert len(seq.prompt_ids) + max_tokens > MAX_LEN
            assert self.store.cancel(lease, self.now)
            self.spent.append(lease)
            self.cancelled += 1
            self.touch(sid)
            return None
        self.retains[seq.id] = self.owner_of[seq.id] = sid
        live.flight = Flight(seq, new, lease)
        if wake:
            self.iterate()
        return live.flight

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
        live = self.live[sid]
        flight = live.flight
        seq = flight.seq
        # Each turn's messages name its request, so the history's order shows.
        messages = (
            {"role": "user", "content": "u" * len(flight.new), "name": seq.id},
            {"role": "assistant", "content": "a" * len(seq.output_ids), "name": seq.id},
        )
        turn = Turn(
            messages=messages,
            seed=seq.seed,
            draw_end=seq.draw_index,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=seq.generated,
        )
        self.store.commit(flight.lease, turn, self.now)
        self.spent.append(flight.lease)
        live.messages.extend(messages)
        live.flight = None
        live.tokens = seq.history()
        live.history_bytes += len(flight.new) + len(seq.output_ids)
        live.turns += 1
        self.committed += 1
        self.touch(sid)
        # Committing can evict, even this session (its history over the bytes limit).
        self.check_removed(self.model_enforce())
        self.settle(sid, "commit", seq.id)  # engine.settle_retained(commit=True), after the store
        assert not self.store.cancel(flight.lease, self.now)  # release(): nothing left to cancel

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
        (the sequence is marked cancelled, dropped at its next iteration) or
        not yet (it runs on, and may end normally after its order was
        applied: it must then hold nothing). With ``delete`` the session is
        deleted right after (a "forget" order too); with ``mid_step`` all
        this happens while a step runs, so that step may end the sequence
        before the orders apply (and the turn's KV is held until they do)."""
        sid = data.draw(st.sampled_from(self.running_ids()), label="session")
        if mid_step:
            self.top()
        self.abandon_turn(sid, noticed=noticed)
        if delete:
            self.delete_session(sid)
        if mid_step and self.policy.running:
            self.step(token)
            self.now += STEP_S

    def abandon_turn(self, sid: str, *, noticed: bool) -> None:
        live = self.live[sid]
        seq = live.flight.seq
        assert live.flight.reason is None
        if noticed:
            seq.cancelled = True
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
        """A turn that ended is settled again, late (the body's finalizer,
        a second cleanup path): its cancel does nothing and its commit is
        refused, whatever turn its session runs now. The HTTP side sends an
        order only when its cancel returned True, so none goes out."""
        lease = data.draw(st.sampled_from(self.spent), label="lease")
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
        flight = self.begin_turn(sid, new, max_tokens, wake=data.draw(st.booleans(), label="wake"))
        assert not self.store.cancel(cut, self.now)  # the late cleanup
        if flight is None:
            return
        assert self.store.get(sid, self.now).busy and flight.lease.current
        with pytest.raises(SessionBusy):
            self.store.begin(sid, self.now)
        self.iterate(token)

    @precondition(lambda self: self.strays)
    @rule(data=st.data())
    def notice(self, data):
        """The scheduler notices at last that an abandoned turn's client is gone."""
        seq = data.draw(st.sampled_from(self.strays), label="stray")
        seq.cancelled = True
        self.strays.remove(seq)
        self.zombies.append(seq)

    @precondition(lambda self: self.finished_ids())
    @rule(
        data=st.data(),
        new=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4),
        max_tokens=st.integers(1, 4),
        noticed=st.booleans(),
    )
    def commit_then_abandon_next(self, data, new, max_tokens, noticed):
        """Turn N is committed while the scheduler is busy (its "commit"
        order waits), then turn N+1 is begun and abandoned before the next
        iteration: both orders apply there, in order, so N's KV becomes the
        session's and N+1's cancel changes nothing held."""
        sid = data.draw(st.sampled_from(self.finished_ids()), label="session")
        request_id = self.live[sid].flight.seq.id
        assert self.policy.held.get(sid) == request_id
        # What the commit must leave the session: N's held chain, or, when that
        # was taken for room or is less than a block, what it pinned before.
        expected = self.pins.get(held_key(sid), self.pins.get(sid, ()))
        self.commit(sid)
        flight = self.begin_turn(sid, new, max_tokens, wake=False)
        if flight is not None:
            self.abandon_turn(sid, noticed=noticed)
        assert (sid, request_id) in self.orders
        kept = sid in self.live  # committing may have evicted it
        self.apply_orders()
        if kept:
            assert self.cache.pinned_tokens(sid) == len(expected), "a pending commit was lost"
            assert self.cache.pinned_tokens(held_key(sid)) == 0 and sid not in self.policy.held
        else:
            assert self.cache.pinned_tokens(sid) == self.cache.pinned_tokens(held_key(sid)) == 0
        self.drop_cancelled()
        self.admit()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def delete(self, data):
        self.delete_session(data.draw(st.sampled_from(list(self.live)), label="session"))

    def delete_session(self, sid: str) -> None:
        expected = self.model_expire()
        if sid not in self.live:
            with pytest.raises(SessionNotFound):
                self.store.delete(sid, self.now)
        elif self.live[sid].busy:
            with pytest.raises(SessionBusy):
                self.store.delete(sid, self.now)
            assert self.store.get(sid, self.now) is self.live[sid].session
        else:
            self.store.delete(sid, self.now)
            del self.live[sid]
            self.gone.append(sid)
            expected.append(sid)
        self.check_removed(expected)

    @precondition(lambda self: self.busy_ids() or self.gone)
    @rule(data=st.data(), op=st.sampled_from(["get", "begin", "delete"]))
    def refused(self, data, op):
        """A second turn on a busy session, or deleting it, is refused (409);
        anything on a deleted, evicted or unknown session is not found (404)."""
        sid = data.draw(st.sampled_from([*self.busy_ids(), *self.gone, "sess-never-made"]), label="session")
        expected = self.model_expire()  # never a busy session
        if sid in self.live and op == "get":
            assert self.store.get(sid, self.now) is self.live[sid].session
        else:
            with pytest.raises(SessionBusy if sid in self.live else SessionNotFound):
                getattr(self.store, op)(sid, self.now)
        self.check_removed(expected)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 5.0, 11.0]), expire=st.booleans())
    def tick(self, dt, expire):
        """Time passes; the store expires idle sessions now, or at its next call."""
        self.now += dt
        if expire:
            expected = self.model_expire()
            self.store.expire(self.now)
            self.check_removed(expected)

    # -- rules: the scheduler's side ----------------------------------------
    @precondition(lambda self: not self.stateless and len(self.cache))
    @rule(blocks=st.integers(6, MAX_LEN // BS), max_tokens=st.integers(1, 3))
    def hog(self, blocks, max_tokens):
        """A stateless request that needs most of the pool: admission takes
        idle blocks first, then whole owners' pins."""
        total = blocks * BS
        seq = self.new_seq([1000 + self.counter * 100 + i for i in range(total - max_tokens)], max_tokens, None)
        self.policy.enqueue(seq)
        self.stateless.append(seq)
        self.iterate()

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
            assert s.messages == live.messages, "the history is not exactly the committed turns, in order"
        assert len(self.store) <= max(MAX_SESSIONS, busy)
        # Every turn in flight belongs to a live session, and its sequence is
        # the scheduler's; the scheduler has nothing else but abandoned turns
        # and stateless requests, and each retains as the model says.
        queued = list(self.policy.waiting) + list(self.policy.running)
        flights = []
        for live in self.live.values():
            if live.flight is not None and live.flight.reason is None:
                assert live.flight.seq in queued
                assert live.flight.seq.retain == live.session.id
                flights.append(live.flight.seq)
        assert sorted(s.id for s in queued) == sorted(s.id for s in flights + self.strays + self.zombies + self.stateless)
        for seq in queued:
            assert seq.retain == self.retains.get(seq.id), f"{seq.id} retains for {seq.retain!r}"

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
        for seq in list(self.policy.waiting) + list(self.policy.running):
            seq.cancelled = True
        for sid, live in self.live.items():
            if live.busy:
                request_id = live.flight.seq.id
                assert self.store.cancel(live.flight.lease, self.now)
                self.settle(sid, "cancel", request_id)
        for sid in self.ids:
            self.settle(sid, "forget")
        self.apply_orders()
        self.policy.drop_cancelled()
        assert not self.policy.waiting and not self.policy.running
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
