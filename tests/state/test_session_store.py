"""Session store bookkeeping: pinning, commit vs cancel, and eviction of idle
sessions under the count, history-bytes and idle-time limits."""

from __future__ import annotations

import json

import pytest

from trioserve.state.session import Quota, QuotaExceeded, SessionBusy, SessionNotFound, StaleTurn, Turn
from trioserve.state.session_store import SessionStore


def reply(text: str, draw_end: int = 0) -> Turn:
    return Turn(({"role": "user", "content": "q"}, {"role": "assistant", "content": text}), 7, draw_end, 3, 2)


def test_commit_changes_the_session_and_cancel_does_not():
    store = SessionStore()
    s = store.create(0.0, system="sys", defaults={"temperature": 0}, seed=None)
    lease = store.begin(s.id, 1.0)
    store.cancel(lease, 2.0)
    assert (s.turns, s.messages, s.draw_index, s.busy) == (0, [], 0, False)
    lease = store.begin(s.id, 3.0)
    store.commit(lease, reply("hi", draw_end=5), 4.0)
    assert (s.turns, s.draw_index, s.seed, s.prompt_tokens, s.completion_tokens, s.busy) == (1, 5, 7, 3, 2, False)
    assert s.conversation([{"role": "user", "content": "next"}])[0] == {"role": "system", "content": "sys"}
    assert store.stats() == {"active": 1, "busy": 0, "evicted": 0, "turns_committed": 1, "turns_cancelled": 1}


def test_one_turn_at_a_time_and_busy_sessions_cannot_be_deleted():
    store = SessionStore()
    s = store.create(0.0)
    lease = store.begin(s.id, 0.0)
    with pytest.raises(SessionBusy, match="already has a turn running"):
        store.begin(s.id, 0.0)
    with pytest.raises(SessionBusy, match="delete it after the turn ends"):
        store.delete(s.id, 0.0)
    store.cancel(lease, 0.0)
    store.delete(s.id, 0.0)
    with pytest.raises(SessionNotFound, match="no session"):
        store.get(s.id, 0.0)


def test_count_limit_evicts_least_recently_used_idle_sessions_never_pinned_ones():
    store = SessionStore(max_sessions=2)
    a = store.create(0.0)
    b = store.create(1.0)
    store.begin(a.id, 2.0)  # a is pinned and now the most recent
    c = store.create(3.0)  # over the limit: b (idle, oldest unpinned) goes
    with pytest.raises(SessionNotFound):
        store.get(b.id, 3.0)
    store.create(4.0)  # a is pinned: c goes instead even though a is older
    assert store.get(a.id, 4.0) is a
    with pytest.raises(SessionNotFound):
        store.get(c.id, 4.0)
    assert store.evicted == 2


def test_idle_limit_expires_sessions_not_used_recently():
    store = SessionStore(idle_s=10.0)
    old = store.create(0.0)
    fresh = store.create(5.0)
    assert store.get(fresh.id, 12.0) is fresh  # 7 s idle: kept
    with pytest.raises(SessionNotFound):
        store.get(old.id, 12.0)  # 12 s idle: gone


def test_history_bytes_limit_evicts_oldest_idle_histories():
    store = SessionStore(max_history_bytes=10)
    a = store.create(0.0)
    store.commit(store.begin(a.id, 0.0), reply("12345678"), 1.0)  # 8 + 1 ("q") bytes
    b = store.create(2.0)
    store.commit(store.begin(b.id, 2.0), reply("abcd"), 3.0)  # total 9 + 5 > 10: a (least recent) goes
    with pytest.raises(SessionNotFound):
        store.get(a.id, 3.0)
    assert store.get(b.id, 3.0).history_bytes() == 5


def test_tool_calls_count_towards_history_bytes():
    store = SessionStore()
    s = store.create(0.0)
    lease = store.begin(s.id, 0.0)
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    turn = Turn(messages=({"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls}), seed=1, draw_end=0, prompt_tokens=1, completion_tokens=1)
    store.commit(lease, turn, 1.0)
    assert s.history_bytes() == 1 + len(json.dumps(calls))


def test_a_settled_turn_can_never_settle_a_later_one():
    """A turn's lease ends with it: a late cancel (a finalizer, a second
    cleanup path) of turn A while turn B runs does nothing, and a late
    commit is refused; B alone commits, once."""
    store = SessionStore()
    s = store.create(0.0)
    a = store.begin(s.id, 0.0)
    assert store.cancel(a, 1.0)  # A is cut
    b = store.begin(s.id, 2.0)  # B begins at once
    assert not store.cancel(a, 3.0)  # A's cleanup again: B keeps running
    assert s.busy
    with pytest.raises(SessionBusy):
        store.begin(s.id, 3.0)  # so a third turn is still refused
    with pytest.raises(StaleTurn, match="already ended"):
        store.commit(a, reply("from A"), 3.0)
    assert (s.turns, s.messages) == (0, [])
    store.commit(b, reply("from B", draw_end=4), 4.0)
    assert (s.turns, s.messages[-1]["content"], s.draw_index) == (1, "from B", 4)
    assert not store.cancel(b, 5.0)  # B's own release after its commit: nothing to do
    with pytest.raises(StaleTurn):
        store.commit(b, reply("twice"), 5.0)  # and it commits only once
    assert s.turns == 1 and store.stats()["turns_cancelled"] == 1


# -- tenants: owners and their quotas


def test_another_owners_session_is_not_found_as_an_unknown_one_is():
    store = SessionStore()
    mine = store.create(0.0, owner="alice")
    for call in (lambda: store.get(mine.id, 1.0, owner="bob"), lambda: store.begin(mine.id, 1.0, owner="bob"), lambda: store.delete(mine.id, 1.0, owner="bob")):
        with pytest.raises(SessionNotFound) as theirs:
            call()
        with pytest.raises(SessionNotFound) as unknown:
            store.get("sess-unknown", 1.0, owner="bob")
        assert str(theirs.value).replace(mine.id, "X") == str(unknown.value).replace("sess-unknown", "X")
    assert store.get(mine.id, 1.0, owner="alice") is mine and store.get(mine.id, 1.0) is mine  # no owner given: the server's own look-ups


def test_owners_make_room_from_their_own_idle_sessions_only():
    store = SessionStore(max_sessions=4, quota=lambda owner: Quota(2, None))
    hers = [store.create(float(i), owner="alice").id for i in range(2)]
    his = [store.create(10.0 + i, owner="bob").id for i in range(5)]
    assert all(store.get(s, 20.0, owner="alice") for s in hers)
    assert [s for s in his if s in store._sessions] == his[-2:]
    assert store.owned("alice") == (2, 0) and store.owned("bob") == (2, 0) and store.evicted == 3


def test_a_full_owner_with_nothing_idle_is_refused_not_let_over():
    store = SessionStore(max_sessions=10, quota=lambda owner: Quota(2, None))
    leases = [store.begin(store.create(0.0, owner="alice").id, 0.0, owner="alice") for _ in range(2)]
    with pytest.raises(QuotaExceeded, match="2 sessions are kept for this API key"):
        store.create(1.0, owner="alice")
    store.create(1.0, owner="bob")  # others are not held back
    store.cancel(leases[0], 2.0)  # one of hers is idle again: it makes room
    store.create(3.0, owner="alice")
    assert store.owned("alice")[0] == 2


def test_history_bytes_are_counted_per_owner():
    store = SessionStore(max_history_bytes=1000, quota=lambda owner: Quota(100, 300))
    old = store.create(0.0, owner="alice")
    store.commit(store.begin(old.id, 0.0), Turn(({"role": "user", "content": "x" * 200},), 1, 1, 1, 1), 0.0)
    store.create(1.0, owner="bob", messages=[{"role": "user", "content": "y" * 250}])
    new = store.create(2.0, owner="alice")
    store.commit(store.begin(new.id, 2.0), Turn(({"role": "user", "content": "z" * 150},), 1, 1, 1, 1), 2.0)
    # Alice went over her 300 bytes: her older session went, not Bob's.
    assert old.id not in store._sessions and store.owned("alice") == (1, 150) and store.owned("bob") == (1, 250)
