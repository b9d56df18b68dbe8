"""Sessions and stored responses on disk: one SQLite file (the standard
library's sqlite3, WAL mode), so a committed turn survives a restart.

What is kept: each session's settings, seed, draw position, usage and
committed history, and each stored response's conversation and record.
KV is not: a session back after a restart re-prefills its history on its
next turn (through the prefix cache after that).

A turn's commit is one transaction (its messages and the session's new
position together), written with ``synchronous=FULL``, so once `commit`
returns it is on disk; the caller (the session actor) runs it in a thread
before the final response goes out. Creating, deleting and evicting
sessions are written as they happen, with the same transactions.

The schema carries a version (``PRAGMA user_version``): a file from a newer
trioserve is refused, an older one migrated. A file that is not a database,
is damaged, read-only or locked is a `StateError` naming it, raised when
the store opens, and the file is left as it was.

While serving, a write that fails (a full disk, a file made unwritable) is
a `StateError` saying which, and changes nothing: SQLite's transaction is
undone, and the caller keeps its memory as it was. The file is this
process's alone (``locking_mode=EXCLUSIVE``): the WAL index lives in the
process's heap, never in a ``-shm`` file mapped from the disk, whose pages
fault (SIGBUS, the process gone) when that file cannot be written; a
second server on the same file is refused at start. Before each write the
file and its write-ahead log are checked to be the ones this process wrote
last: a state file deleted, replaced or written by another program under
the server is refused from then on (`StateError`), not written on unseen
(the writes would go to a file no restart finds). Pure Python: no trio."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sqlite3
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trioserve.errors import TrioserveError

SCHEMA_VERSION = 2  # 2: sessions.owner (the tenant a session or stored response belongs to)
FILE_NAME = "state.sqlite3"
BUSY_TIMEOUT_MS = 2000

_SCHEMA = """
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    system TEXT,
    defaults TEXT NOT NULL,
    seed INTEGER,
    model TEXT,
    draw_index INTEGER NOT NULL,
    turns INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    record TEXT,
    kind TEXT NOT NULL,
    used REAL NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE messages (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session_id, position)
);
"""


# What brings a store of each older schema version to the next one, the
# same statements on SQLite and PostgreSQL.
MIGRATIONS = {
    1: [
        "ALTER TABLE sessions ADD COLUMN owner TEXT NOT NULL DEFAULT ''",  # before tenants, everything was the one tenant's
        "UPDATE sessions SET kind = 'response' WHERE record IS NOT NULL",  # version 1 wrote stored responses (which alone have a record) as kind 'session'
    ],
}


class StateError(TrioserveError):
    """The state store cannot be used: one line naming it and why."""


class StateConflict(StateError):
    """The write met a newer state: a session id taken already, or a turn
    committed (or the session deleted) by another replica meanwhile.
    Nothing was written."""


class Rows:
    """What every state store does, on tables `sessions` and `messages`
    (SQL with ``?`` placeholders): a backend gives `_write` (one
    transaction) and `_read`. ``shared``: other processes write the same
    rows (a replica's memory is then a cache of them)."""

    shared = False
    name = ""  # how errors name the store

    def _write(self, statements: Iterable[tuple[str, tuple, str | None]]) -> None:
        """Run ``statements`` in one durable transaction. A statement with a
        conflict message must change exactly one row, else the transaction
        is rolled back and StateConflict raised with that message."""
        raise NotImplementedError

    def _read(self, sql: str, args: tuple = ()) -> tuple[list[str], list[tuple]]:
        """Column names and rows."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # -- reading ----------------------------------------------------------------
    def load(self) -> list[dict[str, Any]]:
        """Every kept session and stored response, least recently used first:
        their fields and their messages in order."""
        return self._rows("SELECT * FROM sessions ORDER BY used, id", (), "SELECT session_id, body FROM messages ORDER BY session_id, position", ())

    def fetch(self, session_id: str) -> dict[str, Any] | None:
        """One session or stored response as `load` gives it; None when there is none."""
        found = self._rows(
            "SELECT * FROM sessions WHERE id = ?", (session_id,),
            "SELECT session_id, body FROM messages WHERE session_id = ? ORDER BY position", (session_id,),
        )  # fmt: skip
        return found[0] if found else None

    def _rows(self, query: str, args: tuple, message_query: str, message_args: tuple) -> list[dict[str, Any]]:
        names, rows = self._read(query, args)
        if not rows:
            return []
        messages: dict[str, list[dict]] = {}
        for session_id, body in self._read(message_query, message_args)[1]:
            messages.setdefault(session_id, []).append(json.loads(body))
        out = []
        for row in rows:
            data = dict(zip(names, row, strict=True))
            data["settings_text"] = data.pop("defaults")  # compact JSON text, as a Session keeps it
            data["record_text"] = data.pop("record")
            data["messages"] = messages.get(data["id"], [])
            out.append(data)
        return out

    # -- writing ------------------------------------------------------------------
    def create(self, session, kind: str, used_wall: float) -> None:
        """A new session (``kind`` "session") or stored response ("response"),
        with its messages; StateConflict when its id is taken."""
        self._write([
            (
                "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (session.id, session.created, session.system, session.settings_text, session.seed, session.model,
                 session.draw_index, session.turns, session.prompt_tokens, session.completion_tokens,
                 session.record_text, kind, used_wall, session.owner),
                None,
            ),
            *_inserts(session.id, 0, session.messages),
        ])  # fmt: skip

    def commit(self, session_id: str, first: int, messages: list[dict], fields: dict[str, Any], used_wall: float) -> None:
        """One committed turn: its messages (positions from ``first``) and
        the session's new ``fields`` (seed, draw_index, turns, usage), in
        one durable transaction. It applies only to the state the turn
        began from (``turns`` one less than the new count): StateConflict
        when the session moved on or went meanwhile (another replica)."""
        sets = ", ".join(f"{name} = ?" for name in fields)
        conflict = f"session {session_id!r} was continued or deleted elsewhere while this turn ran; nothing was committed, send the turn again"
        self._write([
            (f"UPDATE sessions SET {sets}, used = ? WHERE id = ? AND turns = ?", (*fields.values(), used_wall, session_id, fields["turns"] - 1), conflict),
            *_inserts(session_id, first, messages),
        ])  # fmt: skip

    def delete(self, session_id: str) -> None:
        self._write([("DELETE FROM messages WHERE session_id = ?", (session_id,), None), ("DELETE FROM sessions WHERE id = ?", (session_id,), None)])


# What a file is, as the state store checks it before each write: (device,
# inode, size, modification time); None when there is no file.
Signature = tuple[int, int, int, int] | None


class StateDB(Rows):
    """One SQLite state file, opened for this process alone. Its methods may
    be called from any one thread at a time (a lock keeps them apart)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        self.wal = self.path.with_name(self.path.name + "-wal")
        self._lock = threading.Lock()
        self._lost: str | None = None  # why the file may no longer be written (deleted or replaced under the server)
        self._written_over = False  # the file at the path is still this one's, with another's bytes in it
        existed = self.path.exists()
        try:
            if not existed:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            mode = "rw" if existed else "rwc"
            self._db = sqlite3.connect(f"file:{self.path}?mode={mode}", uri=True, check_same_thread=False, isolation_level=None)
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            # Before anything reads the file: this connection keeps its lock
            # until it closes (another process is refused, "locked"), so
            # SQLite keeps the WAL index in this process's heap and never
            # opens or maps a -shm file; nor is the database read through
            # a mapping. A mapped page whose file cannot be written or was
            # cut short is a SIGBUS that ends the process (bench/README.md:
            # what EXCLUSIVE costs).
            self._db.execute("PRAGMA locking_mode = EXCLUSIVE")
            self._db.execute("PRAGMA mmap_size = 0")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StateError(newer_schema(self.name, version))
            if self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise StateError(f"{self.path}: cannot use write-ahead logging here")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.execute("PRAGMA synchronous = FULL")
            problem = self._db.execute("PRAGMA quick_check").fetchone()[0]
            if problem != "ok":
                raise StateError(f"{self.path}: the database is damaged ({problem}); move it away to start with an empty state")
            self._migrate(version)
        except sqlite3.Error as exc:
            raise StateError(f"{self.path}: {_reason(exc)}") from None
        self._seen = self._signatures()  # the files as this process left them
        if self._seen[0] is None:
            raise StateError(f"{self.path}: the state file went away while it was opened; start again")

    def _migrate(self, version: int) -> None:
        """Bring the schema to SCHEMA_VERSION in one transaction (a new file
        gets the whole schema, an older one its MIGRATIONS in order)."""
        if version == SCHEMA_VERSION:
            # Proves the file can be written (read-only, locked: an error
            # now, not at the first commit): a read-only file still opens
            # and begins a transaction; only a write tells.
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.execute("COMMIT")
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if version == 0:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
            else:
                for step in range(version, SCHEMA_VERSION):
                    for statement in MIGRATIONS[step]:
                        self._db.execute(statement)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # not after a full disk: SQLite ended it, and its error is the one to tell
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            if self._lost is None:
                with contextlib.suppress(OSError):
                    self._notice()  # gone since the last write?
            if self._written_over:
                # Closing would copy this process's log into the file, over
                # the bytes another program put there: the log is set aside
                # and the connection left open till the process ends.
                self._set_log_aside()
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._db))  # never closed, even as the interpreter ends
                return
            self._db.close()  # checkpoints the log into the file, unless the file went (SQLite sees it moved)
            if self._lost is not None:
                self._set_log_aside()

    def _read(self, sql: str, args: tuple = ()) -> tuple[list[str], list[tuple]]:
        with self._lock:
            cursor = self._db.execute(sql, args)
            return [d[0] for d in cursor.description], cursor.fetchall()

    def _write(self, statements: Iterable[tuple[str, tuple, str | None]]) -> None:
        with self._lock:
            self._check_files()
            try:
                if self._db.in_transaction:  # left open by a rollback that failed: end it first
                    self._db.execute("ROLLBACK")
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for sql, args, conflict in statements:
                        if self._db.execute(sql, args).rowcount != 1 and conflict is not None:
                            raise StateConflict(conflict)
                    self._db.execute("COMMIT")  # synchronous=FULL: on disk when this returns
                except BaseException:
                    # SQLite ends the transaction itself after some errors (a
                    # full disk): then there is nothing to roll back, and the
                    # first error is the one to tell.
                    if self._db.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            self._db.execute("ROLLBACK")
                    raise
            except sqlite3.IntegrityError as exc:
                raise StateConflict(f"{self.path}: {exc}") from None
            except sqlite3.Error as exc:
                raise StateError(f"{self.path}: {_reason(exc)}") from None
            finally:
                self._seen = self._signatures(self._seen)  # as this write left them, whatever it did

    def _signatures(self, before: tuple[Signature, Signature] | None = None) -> tuple[Signature, Signature]:
        """The state file's and its write-ahead log's signatures now; where
        one cannot be looked at, its signature in ``before``."""
        out = []
        for i, path in enumerate((self.path, self.wal)):
            try:
                out.append(_signature(path))
            except OSError:
                out.append(None if before is None else before[i])
        return out[0], out[1]

    def _check_files(self) -> None:
        """StateError, once and from then on, when the state file or its
        write-ahead log is not as this process's last write left it: deleted,
        replaced by another file, or written by another program (the lock
        keeps SQLite out, not a cp or an rm). Writing on would put every
        later change where no restart finds it, or mix two files' pages."""
        if self._lost is None:
            try:
                self._notice()
            except OSError as exc:
                raise StateError(f"{self.path}: cannot be looked at ({exc.strerror})") from None
            if self._lost is None:
                return
        raise StateError(self._lost)

    def _notice(self) -> None:
        """Set ``_lost`` (and say it, once, on stderr) when the files are
        not as this process left them; OSError when they cannot be looked at."""
        now = (_signature(self.path), _signature(self.wal))
        (file_then, wal_then), (file_now, wal_now) = self._seen, now
        if file_now is None:
            why = "the state file was deleted"
        elif file_now[:2] != file_then[:2]:
            why = "another file was put in the state file's place"
        elif file_now != file_then:
            why = "another program wrote into the state file"
            self._written_over = True
        elif wal_then is not None and wal_now != wal_then:
            why = f"its write-ahead log {self.wal.name} was deleted, replaced or written by another program"
        else:
            return
        self._lost = (
            f"{self.path}: {why} while the server ran; the server writes nothing more there, and refuses every change "
            f"until it is restarted (it then starts from what that path holds)"
        )
        print(f"trioserve: {self._lost}", file=sys.stderr, flush=True)

    def _set_log_aside(self) -> None:
        """The state file went (deleted, replaced, or written over): this
        process's write-ahead log, still at its path, belongs to the file
        that went. SQLite, opening whatever file is there next, would apply
        it to that file (its pages over the other's): it is renamed aside."""
        wal_then = self._seen[1]
        try:
            wal_now = _signature(self.wal)
            if wal_then is None or wal_now is None or wal_now[:2] != wal_then[:2]:
                return  # gone, or another's
            aside = self.wal.with_name(f"{self.wal.name}.lost-{os.getpid()}")
            os.replace(self.wal, aside)
        except OSError as exc:
            print(f"trioserve: {self.wal}: belongs to the state file that went, and could not be set aside ({exc.strerror}); delete it before the next start", file=sys.stderr, flush=True)
            return
        print(f"trioserve: {self.wal}: the write-ahead log of the state file that went, set aside as {aside.name}", file=sys.stderr, flush=True)


def newer_schema(name: str, version: int) -> str:
    return f"{name}: written by a newer trioserve (schema {version}; this one reads up to {SCHEMA_VERSION}); use that version or another state store"


def open_store(state_dir: str, state_url: str | None, environ) -> Rows | None:
    """The state store the settings name (blocking): PostgreSQL for
    ``state_url``, else the --state-dir file; None for memory only.
    StateError, one line, when it cannot be used."""
    if state_url:
        from trioserve.state.durable_pg import PostgresStateDB  # psycopg only where it is used

        return PostgresStateDB(state_url)
    path = state_file(state_dir, environ)
    return None if path is None else StateDB(path)


def state_file(state_dir: str, environ) -> Path | None:
    """The state file for --state-dir ``state_dir``: None for "none"
    (memory only); "auto" is $XDG_DATA_HOME/trioserve, else
    ~/.local/share/trioserve."""
    if state_dir == "none":
        return None
    if state_dir == "auto":
        base = environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return Path(base) / "trioserve" / FILE_NAME
    return Path(state_dir) / FILE_NAME


def _inserts(session_id: str, first: int, messages: list[dict]) -> list[tuple[str, tuple, None]]:
    return [("INSERT INTO messages VALUES (?, ?, ?)", (session_id, first + i, json.dumps(m, ensure_ascii=False)), None) for i, m in enumerate(messages)]


def _signature(path: Path) -> Signature:
    """What ``path`` is now (None: nothing there); OSError when it cannot be looked at."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


# SQLite's primary result codes that say why a write failed.
SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN = 10, 13, 14


def _reason(exc: sqlite3.Error) -> str:
    text = str(exc)
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    if primary == SQLITE_FULL or "disk is full" in text:
        return f"the disk it is on is full ({text}); free space there, then retry"
    if primary == SQLITE_IOERR:
        return f"cannot be written: the disk failed, or the file was made unwritable ({text}, {exc.sqlite_errorname}); make it writable, then retry"
    if primary == SQLITE_CANTOPEN:
        return f"cannot be opened ({text}); give the server a --state-dir it can write"
    if "not a database" in text or "malformed" in text:
        return f"not a trioserve state database, or damaged ({text}); move it away to start with an empty state"
    if "locked" in text or "busy" in text:
        return f"locked by another process ({text}); one server per --state-dir, or give each its own"
    if "readonly" in text or "read-only" in text:
        return f"cannot be written ({text}); give the server a --state-dir it can write"
    return text
