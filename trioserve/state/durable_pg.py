"""Sessions and stored responses in PostgreSQL (``--state-url
postgresql://...``), shared by every replica that names the same database.

The rows and transactions are state/durable.py's (`Rows`): a turn's commit
is one transaction, durable when PostgreSQL's COMMIT returns (its default
``synchronous_commit``). What differs from the SQLite file is that other
processes write the same rows, so a replica's memory is a cache of them
(``shared``): the session routes bring a session up to date from the
database before they use it (`actors.session.synced`), and a commit
applies only to the state its turn began from (`Rows.commit`): a session
continued meanwhile by another replica is a `StateConflict`, never a
forked history.

The tables live in their own schema, ``trioserve``, created on first use;
its ``meta`` table carries the schema version (a newer one is refused).
A database that cannot be reached, refuses the login or the schema is a
`StateError` naming the database (never its password); a connection lost
later fails that one write or read (503 at the edge) and the next call
connects again. Every wait has a bound: connecting (`CONNECT_TIMEOUT_S`),
each statement and each lock. Pure Python: no trio."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable

import psycopg

from trioserve.state.durable import MIGRATIONS, SCHEMA_VERSION, Rows, StateConflict, StateError, newer_schema

CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_MS = 10_000
LOCK_TIMEOUT_MS = 5_000
SCHEMA = "trioserve"

# The SQLite tables (state/durable.py), in PostgreSQL's types: wall times
# are double precision and seeds 64-bit.
_TABLES = """
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    created DOUBLE PRECISION NOT NULL,
    system TEXT,
    defaults TEXT NOT NULL,
    seed BIGINT,
    model TEXT,
    draw_index BIGINT NOT NULL,
    turns BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    record TEXT,
    kind TEXT NOT NULL,
    used DOUBLE PRECISION NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE messages (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    position BIGINT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session_id, position)
);
CREATE TABLE meta (version INTEGER NOT NULL)
"""


def safe_url(url: str) -> str:
    """``url`` without its password, to name the database in messages."""
    return re.sub(r"(//[^/@:]*):[^/@]*@", r"\1@", url)


def _placeholders(sql: str) -> str:
    return sql.replace("?", "%s")


class PostgresStateDB(Rows):
    """The state rows in one PostgreSQL database, for this process. Its
    methods may be called from any one thread at a time (a lock keeps them
    apart)."""

    shared = True

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = safe_url(url)
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        with self._lock:
            try:
                self._migrate(self._connection())
            except psycopg.Error as exc:
                self._drop()
                raise StateError(f"{self.name}: {_reason(exc)}") from None
            except StateError:
                self._drop()
                raise

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            options = f"-c search_path={SCHEMA} -c statement_timeout={STATEMENT_TIMEOUT_MS} -c lock_timeout={LOCK_TIMEOUT_MS}"
            self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, options=options)
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _migrate(self, conn: psycopg.Connection) -> None:
        """Create the schema, or check its version, in one transaction; an
        advisory lock keeps replicas that start together from racing."""
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('trioserve.schema'))")
            conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
            exists = conn.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.meta",)).fetchone()[0]
            if exists is None:
                for statement in _TABLES.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute("INSERT INTO meta VALUES (%s)", (SCHEMA_VERSION,))
                return
            row = conn.execute("SELECT max(version) FROM meta").fetchone()
            version = row[0] if row is not None and row[0] is not None else 0
            if version > SCHEMA_VERSION:
                raise StateError(newer_schema(self.name, version))
            if version < SCHEMA_VERSION:
                for step in range(version, SCHEMA_VERSION):
                    for statement in MIGRATIONS[step]:
                        conn.execute(statement)
                conn.execute("UPDATE meta SET version = %s", (SCHEMA_VERSION,))

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _read(self, sql: str, args: tuple = ()) -> tuple[list[str], list[tuple]]:
        with self._lock:
            try:
                cursor = self._connection().execute(_placeholders(sql), args)
                return [d.name for d in cursor.description], cursor.fetchall()
            except psycopg.Error as exc:
                self._lost(exc)
                raise StateError(f"{self.name}: {_reason(exc)}") from None

    def _write(self, statements: Iterable[tuple[str, tuple, str | None]]) -> None:
        with self._lock:
            try:
                conn = self._connection()
                with conn.transaction():
                    for sql, args, conflict in statements:
                        if conn.execute(_placeholders(sql), args).rowcount != 1 and conflict is not None:
                            raise StateConflict(conflict)
            except psycopg.errors.IntegrityError as exc:
                raise StateConflict(f"{self.name}: {_first_line(exc)}") from None
            except psycopg.Error as exc:
                self._lost(exc)
                raise StateError(f"{self.name}: {_reason(exc)}") from None

    def _lost(self, exc: psycopg.Error) -> None:
        """After an error that broke the connection, the next call connects again."""
        if isinstance(exc, psycopg.OperationalError) or (self._conn is not None and self._conn.broken):
            self._drop()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _reason(exc: psycopg.Error) -> str:
    text = _first_line(exc)
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return f"not allowed ({text}); the role needs CREATE on the database (first start) and read/write on schema {SCHEMA}"
    if isinstance(exc, psycopg.OperationalError):
        return f"cannot reach or use the database ({text})"
    return text
