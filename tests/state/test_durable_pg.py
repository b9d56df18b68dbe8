"""The PostgreSQL state store (trioserve/state/durable_pg.py) against a real
PostgreSQL server the test starts (tests/postgres.py; skipped, saying why,
where it cannot): the same rows as the SQLite file for the same changes,
and what replicas sharing it see of each other's sessions, as two
SessionStores on one database, as two processes have them."""

from __future__ import annotations

import psycopg
import pytest

from trioserve.state.durable import SCHEMA_VERSION, StateConflict, StateDB, StateError
from trioserve.state.durable_pg import PostgresStateDB, safe_url
from trioserve.state.session import SessionNotFound, Turn
from trioserve.state.session_store import SessionStore


def _turn(text: str, index: int) -> Turn:
    return Turn(({"role": "user", "content": text}, {"role": "assistant", "content": f"reply {index}"}), 7, 3 * index, 5, 3)


def _changes(db) -> list[dict]:
    """The same run of changes, on any store: made, committed, deleted, and a stored response."""
    store = SessionStore(journal=db)
    kept = store.create(1.0, system="Be brief.", defaults={"temperature": 0.5}, seed=11, created=1700000000.25, session_id="keep", model="tiny")
    gone = store.create(2.0, session_id="gone")
    for i in range(3):
        store.commit(store.begin(kept.id, 3.0 + i), _turn(f"question {i} ✓", i + 1), 3.0 + i)
    store.commit(store.begin(gone.id, 9.0), _turn("bye", 1), 9.0)
    store.delete(gone.id, 10.0)
    responses = SessionStore(journal=db, kind="response")
    responses.create(11.0, session_id="resp_1", messages=[{"role": "user", "content": "hi"}], record={"id": "resp_1", "output": [1, 2]})
    rows = db.load()
    for row in rows:
        row.pop("used")  # the wall time of the write
    return rows


def test_the_same_changes_give_the_same_rows_as_the_sqlite_file(postgres, tmp_path):
    db = PostgresStateDB(postgres.url)
    try:
        assert db.shared and not StateDB.shared
        assert _changes(db) == _changes(StateDB(tmp_path / "state.sqlite3"))
        assert [row["id"] for row in db.load()] == ["keep", "resp_1"]
        again = PostgresStateDB(postgres.url)  # a second process on the same database reads it all
        assert again.fetch("keep")["messages"][-1] == {"role": "assistant", "content": "reply 3"}
        assert again.fetch("keep")["seed"] == 7 and again.fetch("keep")["turns"] == 3
        assert again.fetch("gone") is None
        again.close()
    finally:
        db.close()


def test_a_replica_sees_what_another_made_continued_and_deleted(postgres):
    a_db, b_db = PostgresStateDB(postgres.url), PostgresStateDB(postgres.url)
    a, b = SessionStore(journal=a_db), SessionStore(journal=b_db)
    try:
        made = a.create(0.0, session_id="conv", seed=3)
        a.commit(a.begin(made.id, 1.0), _turn("one", 1), 1.0)
        with pytest.raises(SessionNotFound):
            b.get("conv", 1.0)
        b.refresh("conv", b_db.fetch("conv"), 2.0)  # as `synced` does before a route uses it
        assert b.get("conv", 2.0).messages == made.messages
        b.commit(b.begin("conv", 2.0), _turn("two", 2), 2.0)

        # A still holds the session as it was: a turn it runs from there
        # must not fork the history B continued.
        stale = a.begin("conv", 3.0)
        with pytest.raises(StateConflict, match="continued or deleted elsewhere"):
            a.commit(stale, _turn("fork", 2), 3.0)
        a.cancel(stale, 3.0)
        assert [m["content"] for m in a_db.fetch("conv")["messages"]] == ["one", "reply 1", "two", "reply 2"]

        a.refresh("conv", a_db.fetch("conv"), 4.0)
        assert a.get("conv", 4.0).turns == 2 and a.get("conv", 4.0).messages == b.get("conv", 4.0).messages
        a.commit(a.begin("conv", 4.0), _turn("three", 3), 4.0)  # up to date, it commits
        assert a_db.fetch("conv")["turns"] == 3

        b.refresh("conv", b_db.fetch("conv"), 5.0)
        b.delete("conv", 5.0)
        a.refresh("conv", a_db.fetch("conv"), 6.0)
        with pytest.raises(SessionNotFound):
            a.get("conv", 6.0)
    finally:
        a_db.close()
        b_db.close()


def test_a_taken_id_is_a_conflict_and_eviction_keeps_the_rows(postgres):
    a_db, b_db = PostgresStateDB(postgres.url), PostgresStateDB(postgres.url)
    try:
        a, b = SessionStore(journal=a_db, max_sessions=1), SessionStore(journal=b_db)
        a.create(0.0, session_id="mine")
        with pytest.raises(StateConflict):
            b.create(0.0, session_id="mine")
        assert len(b) == 0
        # A's memory holds one session: the older one leaves A's memory,
        # not the database, which other replicas share.
        a.create(1.0, session_id="other")
        assert a.evicted == 1 and len(a) == 1
        assert a_db.fetch("mine") is not None
        a.refresh("mine", a_db.fetch("mine"), 2.0)
        assert a.get("mine", 2.0).id == "mine"
    finally:
        a_db.close()
        b_db.close()


def test_a_lost_connection_fails_that_call_and_the_next_connects_again(postgres):
    db = PostgresStateDB(postgres.url)
    store = SessionStore(journal=db)
    try:
        store.create(0.0, session_id="s")
        postgres.stop("immediate")
        lease = store.begin("s", 1.0)
        with pytest.raises(StateError, match="cannot reach or use the database") as caught:
            store.commit(lease, _turn("lost", 1), 1.0)
        assert "\n" not in str(caught.value)
        assert store.get("s", 1.0).turns == 0  # nothing committed
        store.cancel(lease, 1.0)
        postgres.start()
        store.commit(store.begin("s", 2.0), _turn("back", 1), 2.0)
        assert db.fetch("s")["turns"] == 1
    finally:
        db.close()


def test_a_newer_schema_is_refused_in_one_line_naming_the_database_without_its_password(postgres):
    PostgresStateDB(postgres.url).close()
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute("ALTER ROLE trioserve PASSWORD 'hunter2'")
        conn.execute("UPDATE trioserve.meta SET version = %s", (SCHEMA_VERSION + 1,))
    url = postgres.url.replace("trioserve@", "trioserve:hunter2@")
    with pytest.raises(StateError) as caught:
        PostgresStateDB(url)
    text = str(caught.value)
    assert text.startswith(safe_url(url) + ": written by a newer trioserve"), text
    assert "hunter2" not in text and "\n" not in text
    with psycopg.connect(postgres.url) as conn:  # left as it was
        assert conn.execute("SELECT version FROM trioserve.meta").fetchone()[0] == SCHEMA_VERSION + 1


def test_a_database_that_cannot_be_reached_is_one_line():
    with pytest.raises(StateError) as caught:
        PostgresStateDB("postgresql://someone:secret@127.0.0.1:1/state")
    text = str(caught.value)
    assert text.startswith("postgresql://someone@127.0.0.1:1/state: cannot reach or use the database"), text
    assert "secret" not in text and "\n" not in text


def test_a_schema_1_database_is_migrated(postgres):
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA trioserve")
        conn.execute(
            "CREATE TABLE trioserve.sessions (id TEXT PRIMARY KEY, created DOUBLE PRECISION NOT NULL, system TEXT, defaults TEXT NOT NULL,"
            " seed BIGINT, model TEXT, draw_index BIGINT NOT NULL, turns BIGINT NOT NULL, prompt_tokens BIGINT NOT NULL,"
            " completion_tokens BIGINT NOT NULL, record TEXT, kind TEXT NOT NULL, used DOUBLE PRECISION NOT NULL)"
        )
        conn.execute("CREATE TABLE trioserve.messages (session_id TEXT NOT NULL, position BIGINT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (session_id, position))")
        conn.execute("CREATE TABLE trioserve.meta (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO trioserve.meta VALUES (1)")
        conn.execute("INSERT INTO trioserve.sessions VALUES ('resp_1', 1, NULL, '{}', NULL, 'tiny', 0, 0, 0, 0, '{}', 'session', 2)")
    db = PostgresStateDB(postgres.url)
    try:
        row = db.fetch("resp_1")
        assert row["kind"] == "response" and row["owner"] == ""
    finally:
        db.close()
    with psycopg.connect(postgres.url) as conn:
        assert conn.execute("SELECT version FROM trioserve.meta").fetchone()[0] == SCHEMA_VERSION
