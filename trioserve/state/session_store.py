"""Stateful sessions: committed conversation history, settings and the
random-stream position, with the turn protocol's bookkeeping. Pure Python:
no trio, no torch; the session actors (trioserve/actors/session.py) and the
session routes drive it.

A turn *begins* (the session is pinned: one turn at a time), generates
provisionally, and then either *commits* (history, draw position and usage
change) or *cancels* (nothing changes, so a retry starts from the same
place). `begin` hands out a `TurnLease`, the turn's identity: only the
lease of the turn that is running may commit or cancel it, and only once.
The turn's session actor is the only one that settles it; the lease is the
second line of defence: a late or repeated settle from a turn that already
ended is harmless, it can never end a later turn. Idle sessions are evicted
least recently used beyond the count limit or after the idle limit; a
pinned session is never evicted.

With a ``journal`` (state/durable.py's StateDB) every change is written
through to disk as well: a session made, a turn committed, a session
deleted or evicted; `restore` brings them back after a restart. A commit
can be split (`prepare_commit`, `write`, `apply`) so that the durable
write runs in a thread before the commit shows anywhere. A write the
journal refuses (StateError: a full disk, a file gone) changes nothing in
memory either; an eviction whose delete it refuses keeps that session, on
disk and here, until a later eviction can delete it (the store stays over
its limits meanwhile), so an eviction never fails the request that made it.

The records it keeps and hands out (Session, Turn, TurnLease), the tenant's
Quota and the protocol's errors are trioserve/state/session.py's."""

from __future__ import annotations

import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trioserve.errors import RequestError
from trioserve.state.durable import StateError
from trioserve.state.session import (  # the records are named here too, where callers of the store look for them
    PendingCommit,
    Quota,
    QuotaExceeded,
    Session,
    SessionBusy,
    SessionNotFound,
    StaleTurn,
    Turn,
    TurnLease,
    compact_json,
    largest_field,
    message_bytes,
    session_from_row,
    sized,
)

__all__ = [
    "SessionStore", "PendingCommit", "Quota", "QuotaExceeded", "Session", "SessionBusy", "SessionNotFound", "StaleTurn",
    "Turn", "TurnLease", "compact_json",
]  # fmt: skip


class SessionStore:
    def __init__(
        self,
        *,
        max_sessions: int = 1024,
        idle_s: float | None = None,
        max_history_bytes: int | None = None,
        on_remove: Callable[[str], None] | None = None,
        journal=None,
        kind: str = "session",
        quota: Callable[[str], Quota] | None = None,
    ) -> None:
        """``on_remove(session_id)`` is told of every session that goes
        (deleted or evicted), so what is kept for it elsewhere can go too.
        ``journal``: a StateDB every change is written to (its rows of
        ``kind``: "session" or "response"). ``quota(owner)``: what each
        tenant may keep (default: the whole store's limits, as for the one
        tenant there is without keys). A tenant over its quota, or over the
        store's limits, makes room from its own idle sessions only: one
        tenant never evicts another's."""
        self.on_remove = on_remove
        self.journal = journal
        self.kind = kind
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self.max_history_bytes = max_history_bytes
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._bytes = 0  # the sum of every kept session's history_bytes()
        self._owned: dict[str, list[int]] = {}  # owner -> [sessions, history bytes]
        self.quota = quota or (lambda owner: Quota(self.max_sessions, self.max_history_bytes))
        self.evicted = 0
        self.committed = 0
        self.cancelled = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def create(self, now: float, **fields: Any) -> Session:
        """A new session, written (with a journal) and kept: ``fields`` as
        `prepare_create` takes them."""
        session = self.prepare_create(now, **fields)
        self.write_create(session)
        return self.insert(session, now)

    def prepare_create(
        self,
        now: float,
        *,
        system: str | None = None,
        defaults: Mapping[str, Any] | None = None,
        seed: int | None = None,
        created: float | None = None,
        session_id: str | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
        record: dict[str, Any] | None = None,
        model: str | None = None,
        owner: str = "",
    ) -> Session:
        """A new session, not yet written nor kept. ``now`` is the store's
        clock (for idleness); ``created`` the wall time shown to clients
        (default ``now``). A stored response brings its own id, its whole
        conversation as ``messages`` and its ``record``. QuotaExceeded when
        ``owner`` keeps all it may and nothing of its own is idle."""
        self.expire(now)
        session = Session(
            session_id or f"sess-{secrets.token_hex(12)}", now if created is None else created, system, dict(defaults or {}), seed,
            messages=[dict(m) for m in messages], last_used=now, record_text=record, model=model, owner=owner,
        )  # fmt: skip
        if session.id in self._sessions:
            raise ValueError(f"a session {session.id!r} exists already")
        self.check_room(owner)
        sized(session)
        self.check_keepable(owner, session.size, lambda: largest_field(session))
        if not self._would_stay(owner, session.size):
            what = "sessions" if self.kind == "session" else "stored responses"
            raise QuotaExceeded(f"the server keeps as many {what} as it may, and none of this API key's is idle to make room; retry when one ends")
        return session

    def _would_stay(self, owner: str, size: int) -> bool:
        """A new session of ``owner`` of ``size`` bytes fits once all of
        ``owner``'s idle sessions made room (never another's): otherwise it
        would be evicted as soon as it is kept."""
        idle = [self._sessions[sid] for sid in self._idle_of(owner)]
        freed_count, freed_bytes = len(idle), sum(s.size for s in idle)
        count, owned_bytes = self._owned.get(owner, (0, 0))
        quota = self.quota(owner)
        return (
            count + 1 - freed_count <= quota.sessions and len(self._sessions) + 1 - freed_count <= self.max_sessions
            and (quota.history_bytes is None or owned_bytes + size - freed_bytes <= quota.history_bytes)
            and (self.max_history_bytes is None or self._bytes + size - freed_bytes <= self.max_history_bytes)
        )  # fmt: skip

    def check_keepable(self, owner: str, size: int, field: Callable[[], str]) -> None:
        """RequestError naming ``field()`` when one session of ``size`` bytes
        is more than ``owner`` may keep in all."""
        allowed = min(x for x in (self.quota(owner).history_bytes, self.max_history_bytes, math.inf) if x is not None)
        if size > allowed:
            name = field()
            what = "session" if self.kind == "session" else "stored response"
            raise RequestError(f"{name}: this {what} would keep {size} bytes, more than the {allowed} this API key may keep in all; send less", field=name)

    def check_room(self, owner: str) -> None:
        """QuotaExceeded when ``owner`` keeps as many as it may and none of
        its own is idle, to go for a new one."""
        count = self._owned.get(owner, (0, 0))[0]
        if count >= min(self.quota(owner).sessions, self.max_sessions) and not any(self._idle_of(owner)):
            what = "sessions" if self.kind == "session" else "stored responses"
            raise QuotaExceeded(f"{count} {what} are kept for this API key, as many as it may keep, and each is in use; retry when one ends")

    def write_create(self, session: Session) -> None:
        """The new session, durably on disk (blocking: may run in a thread);
        nothing without a journal. Raises StateError, and nothing is kept."""
        if self.journal is not None:
            self.journal.create(session, self.kind, time.time())

    def insert(self, session: Session, now: float) -> Session:
        """The written session, kept in memory from now on."""
        if session.id in self._sessions:
            raise ValueError(f"a session {session.id!r} exists already")
        self._keep(session)
        self._enforce_count(session.owner)
        return session

    @property
    def shared(self) -> bool:
        """Other replicas write the same rows (a PostgreSQL store): memory is
        a cache of the journal, brought up to date by `refresh`."""
        return self.journal is not None and self.journal.shared

    def restore(self, rows: list[dict[str, Any]], now: float) -> int:
        """Bring back the sessions of this store's kind that `StateDB.load`
        read (least recently used first); how many."""
        count = 0
        for row in rows:
            if row["kind"] != self.kind or row["id"] in self._sessions:
                continue
            self._keep(session_from_row(row, now))
            count += 1
        for owner in list(self._owned):
            self._enforce_count(owner)
        return count

    def refresh(self, session_id: str, row: dict[str, Any] | None, now: float) -> None:
        """Bring ``session_id`` up to date with its journal ``row`` (as
        `fetch` read it; None: it is gone): a session another replica made
        or continued is taken as the row has it, one it deleted is dropped
        here too. A session with a turn running here is left alone (its
        commit checks the row itself)."""
        local = self._sessions.get(session_id)
        if local is not None and local.busy:
            return
        if row is None or row["kind"] != self.kind:
            if local is not None:
                self._remove(session_id, durable=False)
            return
        if local is not None:
            if local.turns == row["turns"]:
                return
            self._remove(session_id, durable=False)
        kept = session_from_row(row, now)
        self._keep(kept)
        self._enforce_count(kept.owner)

    def _keep(self, session: Session) -> None:
        self._bytes += session.size
        self._sessions[session.id] = session
        owned = self._owned.setdefault(session.owner, [0, 0])
        owned[0] += 1
        owned[1] += session.size

    def _grow(self, session: Session, added: int) -> None:
        session.size += added
        self._bytes += added
        self._owned[session.owner][1] += added

    def _idle_of(self, owner: str):
        """``owner``'s idle sessions, least recently used first."""
        return (sid for sid, session in self._sessions.items() if session.owner == owner and not session.busy)

    def owned(self, owner: str) -> tuple[int, int]:
        """(sessions, history bytes) ``owner`` keeps here."""
        count, size = self._owned.get(owner, (0, 0))
        return count, size

    def get(self, session_id: str, now: float, *, use: bool = False, owner: str | None = None) -> Session:
        """The session; with ``use`` it counts as used now (a stored
        response read or continued), for idleness and eviction order. With
        ``owner``, another tenant's session is not found, exactly as an
        unknown one is."""
        self.expire(now)
        session = self._sessions.get(session_id)
        if session is None or (owner is not None and session.owner != owner):
            raise SessionNotFound(f"no session {session_id!r} (unknown, deleted, or evicted after being idle)")
        if use:
            self._touch(session, now)
        return session

    def delete(self, session_id: str, now: float, *, owner: str | None = None) -> None:
        """Delete it (on disk first, with a journal): `check_delete`,
        `write_delete` and `forget`, which a caller on an event loop runs
        apart, the write in a thread."""
        self.check_delete(session_id, now, owner=owner)
        self.write_delete(session_id)
        self.forget(session_id)

    def check_delete(self, session_id: str, now: float, *, owner: str | None = None) -> None:
        """SessionNotFound, or SessionBusy while a turn runs."""
        if self.get(session_id, now, owner=owner).busy:
            raise SessionBusy(f"session {session_id!r} has a turn running; delete it after the turn ends")

    def write_delete(self, session_id: str) -> None:
        """Its rows deleted (blocking: may run in a thread); nothing without a journal."""
        if self.journal is not None:
            self.journal.delete(session_id)

    def forget(self, session_id: str) -> None:
        """The deleted session, gone from memory too (if still there)."""
        if session_id in self._sessions:
            self._remove(session_id, durable=False)

    def begin(self, session_id: str, now: float, *, owner: str | None = None) -> TurnLease:
        """Pin the session for a turn; the lease is that turn's identity."""
        session = self.get(session_id, now, owner=owner)
        if session.busy:
            raise SessionBusy(f"session {session_id!r} already has a turn running")
        session.leases += 1
        session.turn_number = session.leases
        self._touch(session, now)
        return TurnLease(session, session.leases)

    def commit(self, lease: TurnLease, turn: Turn, now: float) -> None:
        """The leased turn's final response was chosen: it becomes history
        (on disk first, with a journal). Raises StaleTurn (changing nothing)
        when that turn already ended."""
        pending = self.prepare_commit(lease, turn)
        self.write(pending)
        self.apply(pending, now)

    def prepare_commit(self, lease: TurnLease, turn: Turn) -> PendingCommit:
        """Check the lease and lay the commit out; StaleTurn when its turn ended."""
        session = lease.session
        if not lease.current:
            raise StaleTurn(f"session {session.id!r}: turn {lease.number} already ended; it cannot commit")
        fields = {
            "seed": turn.seed, "draw_index": turn.draw_end, "turns": session.turns + 1,
            "prompt_tokens": session.prompt_tokens + turn.prompt_tokens,
            "completion_tokens": session.completion_tokens + turn.completion_tokens,
        }  # fmt: skip
        return PendingCommit(lease, turn, len(session.messages), fields)

    def write(self, pending: PendingCommit) -> None:
        """The commit, durably on disk (blocking: run it in a thread); nothing without a journal."""
        if self.journal is not None:
            self.journal.commit(pending.lease.session.id, pending.first, [dict(m) for m in pending.turn.messages], pending.fields, time.time())

    def apply(self, pending: PendingCommit, now: float) -> None:
        """The written commit, in memory: the history grows, the turn ends."""
        lease, turn = pending.lease, pending.turn
        session = lease.session
        if not lease.current:
            raise StaleTurn(f"session {session.id!r}: turn {lease.number} already ended; it cannot commit")
        session.messages.extend(dict(m) for m in turn.messages)
        self._grow(session, sum(map(message_bytes, turn.messages)))
        session.seed = turn.seed
        session.draw_index = turn.draw_end
        session.turns += 1
        session.prompt_tokens += turn.prompt_tokens
        session.completion_tokens += turn.completion_tokens
        session.turn_number = None
        self.committed += 1
        self._touch(session, now)
        self._enforce_count(session.owner)

    def cancel(self, lease: TurnLease, now: float) -> bool:
        """The leased turn ended without a final response: nothing changes.
        False, and nothing done, when that turn had already ended (committed
        or cancelled), whatever turn the session runs now."""
        session = lease.session
        if not lease.current:
            return False
        session.turn_number = None
        self.cancelled += 1
        if session.id in self._sessions:
            self._touch(session, now)
        return True

    def expire(self, now: float) -> None:
        if self.idle_s is None:
            return
        for sid in list(self._sessions):
            session = self._sessions[sid]
            if now - session.last_used <= self.idle_s:
                break  # the rest were used more recently
            if not session.busy and not self._evict(sid):
                return  # the journal refuses deletes now: the rest stay too

    def _evict(self, session_id: str) -> bool:
        """Evict an idle session, its rows too (unless the journal is
        shared). False, and the session kept, when the journal refused the
        delete: kept in memory as it is kept on disk."""
        try:
            self._remove(session_id, durable=not self.shared)
        except StateError:
            return False
        self.evicted += 1
        return True

    def _remove(self, session_id: str, *, durable: bool = True) -> None:
        """Forget the session; ``durable``: delete its rows too."""
        if durable and self.journal is not None:
            self.journal.delete(session_id)
        session = self._sessions.pop(session_id)
        self._bytes -= session.size
        owned = self._owned[session.owner]
        owned[0] -= 1
        owned[1] -= session.size
        if owned[0] == 0:
            del self._owned[session.owner]
        if self.on_remove is not None:
            self.on_remove(session_id)

    def _touch(self, session: Session, now: float) -> None:
        session.last_used = now
        self._sessions.move_to_end(session.id)

    def _enforce_count(self, owner: str) -> None:
        """Evict ``owner``'s idle sessions, least recently used first, while
        it is over its quota or the store over its count or history-bytes
        limit: never another owner's (with one owner, as without API keys,
        that is every idle session)."""
        quota = self.quota(owner)
        for sid in list(self._idle_of(owner)):
            count, size = self._owned.get(owner, (0, 0))
            over = (
                count > quota.sessions or len(self._sessions) > self.max_sessions
                or (quota.history_bytes is not None and size > quota.history_bytes)
                or (self.max_history_bytes is not None and self._bytes > self.max_history_bytes)
            )  # fmt: skip
            if not over or not self._evict(sid):
                return

    def stats(self) -> dict[str, int]:
        return {
            "active": len(self._sessions),
            "busy": sum(s.busy for s in self._sessions.values()),
            "evicted": self.evicted,
            "turns_committed": self.committed,
            "turns_cancelled": self.cancelled,
        }
