"""One session as trioserve/state/session_store.py keeps it: its committed
history, settings and random-stream position, and its size as counted
against the store's limits; a committed turn, the lease that lets one turn
settle its session, and a commit laid out before it is written; the quota a
tenant keeps sessions within; the errors of the turn protocol. Pure Python
like the store: no trio, no torch."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trioserve.errors import TrioserveError


class SessionNotFound(TrioserveError):
    """Unknown, deleted or evicted session (HTTP 404)."""


class SessionBusy(TrioserveError):
    """A turn is already running on this session (HTTP 409)."""


class QuotaExceeded(TrioserveError):
    """The tenant keeps as many sessions (or stored responses) as it may,
    and none of its own is idle to make room (HTTP 429)."""

    retry_after = 5.0


@attrs.frozen
class Quota:
    """What one tenant may keep in a store: sessions, and history bytes (None: no limit)."""

    sessions: int
    history_bytes: int | None


class StaleTurn(TrioserveError):
    """A commit from a turn that is no longer the session's running turn
    (it was cancelled, or committed already). A bug in the caller, never
    the client's doing: it must not change the session."""


@attrs.define(eq=False)
class Session:
    id: str
    created: float
    system: str | None
    # Sampling settings every turn starts from (tools and schemas among
    # them), kept as compact JSON text: a parsed tree of a large body holds
    # many times its size in Python objects. `defaults` reads it.
    settings_text: str = attrs.field(converter=lambda value: value if isinstance(value, str) else compact_json(value or {}))
    seed: int | None  # None: a random seed is chosen at the first sampled turn
    messages: list[dict[str, Any]] = attrs.field(factory=list)  # committed history, system message excluded
    draw_index: int = 0
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    turn_number: int | None = None  # the running turn's lease number; None when idle
    last_used: float = 0.0
    leases: int = 0  # leases handed out so far: the next one's number
    # What a stored response keeps besides its conversation: its body, as
    # GET /v1/responses/{id} returns it (trioserve/http/responses.py).
    record_text: str | None = attrs.field(default=None, converter=lambda value: value if value is None or isinstance(value, str) else compact_json(value))
    model: str | None = None  # the model whose engine runs its turns (and keeps their KV)
    size: int = 0  # history_bytes(), kept up to date by the store (summing it again at every change grew with the history)
    owner: str = ""  # the tenant it belongs to ("" without API keys: the one tenant)

    @property
    def defaults(self) -> dict[str, Any]:
        return json.loads(self.settings_text)

    @property
    def record(self) -> dict[str, Any] | None:
        """A stored response's body, as GET /v1/responses/{id} returns it."""
        return None if self.record_text is None else json.loads(self.record_text)

    @property
    def busy(self) -> bool:
        """A turn is running (begun, neither committed nor cancelled)."""
        return self.turn_number is not None

    def conversation(self, new: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
        """System message (if any), committed history, then ``new``."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + [dict(m) for m in self.messages] + [dict(m) for m in new]

    def history_bytes(self) -> int:
        """The history's size as counted against the store's limit: message
        text, plus the JSON of any tool calls (and a stored response's record
        as JSON)."""
        return self.size


def compact_json(value: Any) -> str:
    """``value`` as the JSON text a session keeps: no spaces, Unicode as is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def message_bytes(message: Mapping[str, Any]) -> int:
    """What ``message`` counts for against the limits: its text's bytes, and its tool calls' as JSON."""
    size = len(str(message.get("content") or "").encode())
    if message.get("tool_calls"):
        size += len(json.dumps(message["tool_calls"], ensure_ascii=False).encode())
    return size


@attrs.frozen(eq=False)
class TurnLease:
    """One turn's right to settle its session: handed out by `SessionStore.begin`, valid
    until that turn commits or cancels. Compared by identity."""

    session: Session
    number: int

    @property
    def current(self) -> bool:
        """This is still the session's running turn."""
        return self.session.turn_number == self.number


@attrs.frozen
class PendingCommit:
    """A commit checked and laid out, not yet written nor applied."""

    lease: TurnLease
    turn: Turn
    first: int  # the history position of the turn's first message
    fields: dict[str, Any]


@attrs.frozen
class Turn:
    """What a committed turn adds."""

    messages: tuple[dict[str, Any], ...]  # the turn's new messages, then the assistant's
    seed: int
    draw_end: int
    prompt_tokens: int
    completion_tokens: int


def session_from_row(row: Mapping[str, Any], now: float) -> Session:
    """A session as the journal keeps it (`StateDB.load`'s rows)."""
    session = Session(
        row["id"], row["created"], row["system"], row["settings_text"], row["seed"], messages=list(row["messages"]),
        draw_index=row["draw_index"], turns=row["turns"], prompt_tokens=row["prompt_tokens"],
        completion_tokens=row["completion_tokens"], last_used=now, record_text=row["record_text"], model=row["model"],
        owner=row.get("owner") or "",
    )  # fmt: skip
    return sized(session)


def largest_field(session: Session) -> str:
    """The request field that makes most of what ``session`` keeps."""
    parts = {"messages": sum(map(message_bytes, session.messages))}
    for text in (session.settings_text, session.record_text):
        for key, value in (json.loads(text) if text else {}).items():
            parts[key] = parts.get(key, 0) + len(compact_json(value))
    return max(parts, key=parts.__getitem__)


def sized(session: Session) -> Session:
    """``session`` with its size counted: history text, settings and record,
    as the bytes of the text kept."""
    settings = 0 if session.settings_text == "{}" else len(session.settings_text.encode())  # no settings, nothing kept for them
    session.size = sum(map(message_bytes, session.messages)) + settings
    if session.record_text is not None:
        session.size += len(session.record_text.encode())
    return session
