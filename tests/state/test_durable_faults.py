"""The SQLite state store (trioserve/state/durable.py) under faults made for
real (tests/disk_faults.py): a full disk, a write-ahead log made immutable,
a -shm file made immutable, and the state file deleted, replaced or written
by another program under the store. Each refused write is a StateError
saying why, and changes nothing, on disk or in the SessionStore's memory;
the store takes writes again once the disk can."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.disk_faults import fill, immutable, small_disk
from trioserve.state.durable import FILE_NAME, StateDB, StateError
from trioserve.state.session import Turn
from trioserve.state.session_store import SessionStore

FULL = "the disk it is on is full (database or disk is full); free space there, then retry"
UNWRITABLE = "cannot be written: the disk failed, or the file was made unwritable (disk I/O error, SQLITE_IOERR_WRITE); make it writable, then retry"
AFTERWARDS = "while the server ran; the server writes nothing more there, and refuses every change until it is restarted (it then starts from what that path holds)"


def _turn(i: int) -> Turn:
    return Turn(({"role": "user", "content": f"question {i} " * 200}, {"role": "assistant", "content": f"answer {i}"}), 7, i, 5, 3)


def _try_turn(store: SessionStore, session_id: str, i: int) -> None:
    """One turn as the session actor runs it: committed, or (raising) cancelled."""
    lease = store.begin(session_id, float(i))
    try:
        store.commit(lease, _turn(i), float(i))
    finally:
        store.cancel(lease, float(i))  # nothing once committed


def _rows(path: Path) -> list[tuple]:
    db = StateDB(path)
    try:
        return [(row["id"], row["turns"], [m["content"] for m in row["messages"]]) for row in db.load()]
    finally:
        db.close()


def _as_kept(store: SessionStore) -> list[tuple]:
    return sorted((s.id, s.turns, [m["content"] for m in s.messages]) for s in store._sessions.values())


def _refused(store: SessionStore, session_id: str, message: str) -> None:
    """A turn, a new session and a delete are each refused with ``message``;
    the store's memory is as it was."""
    before = _as_kept(store)
    with pytest.raises(StateError) as caught:
        _try_turn(store, session_id, 99)
    assert str(caught.value) == message
    with pytest.raises(StateError) as caught:
        store.create(100.0, system="new")
    assert str(caught.value) == message
    with pytest.raises(StateError) as caught:
        store.delete(session_id, 101.0)
    assert str(caught.value) == message
    assert _as_kept(store) == before and not store.get(session_id, 102.0).busy


def test_a_full_disk_refuses_each_write_saying_so_and_the_store_goes_on_once_there_is_room(tmp_path):
    with small_disk(tmp_path / "disk", "512k") as disk:
        path = disk / FILE_NAME
        db = StateDB(path)
        store = SessionStore(journal=db)
        session = store.create(0.0, system="Be brief.")
        _try_turn(store, session.id, 1)
        filler = fill(disk)
        # SQLite ends the transaction itself on a full disk: the error told
        # is the disk's, never "cannot rollback - no transaction is active".
        _refused(store, session.id, f"{path}: {FULL}")
        filler.unlink()
        _try_turn(store, session.id, 2)
        kept = _as_kept(store)
        assert kept[0][1] == 2
        db.close()
        assert _rows(path) == kept  # nothing half written
        check = sqlite3.connect(path)
        assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        check.close()


def test_an_unwritable_write_ahead_log_is_refused_saying_so_until_it_is_writable(tmp_path):
    """Made immutable on the machine's own disk (tmpfs lets an open file be
    written after chattr +i; ext4 does not)."""
    path = tmp_path / FILE_NAME
    db = StateDB(path)
    store = SessionStore(journal=db)
    session = store.create(0.0)
    _try_turn(store, session.id, 1)
    with immutable(tmp_path / f"{FILE_NAME}-wal"):
        _refused(store, session.id, f"{path}: {UNWRITABLE}")
    _try_turn(store, session.id, 2)
    kept = _as_kept(store)
    db.close()
    assert _rows(path) == kept and kept[0][1] == 2


def test_the_wal_index_is_in_the_process_memory_so_no_shm_file_can_fault(tmp_path):
    """With the -shm file mapped from the disk, one made immutable ended the
    process with SIGBUS at its next write. The store keeps the index in its
    heap (locking_mode EXCLUSIVE): there is no -shm, a -shm left there
    (immutable, even) is never opened, and a second process is refused."""
    path = tmp_path / FILE_NAME
    shm = tmp_path / f"{FILE_NAME}-shm"
    db = StateDB(path)
    store = SessionStore(journal=db)
    session = store.create(0.0)
    _try_turn(store, session.id, 1)
    assert not shm.exists()
    shm.write_bytes(b"\xff" * 32768)
    with immutable(shm):
        for i in range(2, 40):
            _try_turn(store, session.id, i)
        with pytest.raises(StateError, match=f"^{path}: locked by another process"):
            StateDB(path)
        kept = _as_kept(store)
        db.close()
        assert _rows(path) == kept and kept[0][1] == 39


def _other_state_file(where: Path) -> Path:
    """A valid state file of another server, closed."""
    where.mkdir()
    other = StateDB(where / FILE_NAME)
    SessionStore(journal=other).create(0.0, session_id="from-elsewhere")
    other.close()
    return where / FILE_NAME


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("deleted", "the state file was deleted"),
        ("directory-deleted", "the state file was deleted"),
        ("replaced", "another file was put in the state file's place"),
        ("overwritten", "another program wrote into the state file"),
        ("log-deleted", f"its write-ahead log {FILE_NAME}-wal was deleted, replaced or written by another program"),
    ],
)
def test_a_state_file_deleted_or_replaced_under_the_store_is_refused_from_then_on(tmp_path, capfd, fault, why):
    state = tmp_path / "state"
    path = state / FILE_NAME
    db = StateDB(path)
    store = SessionStore(journal=db)
    session = store.create(0.0)
    _try_turn(store, session.id, 1)
    other = _other_state_file(tmp_path / "other")
    if fault == "deleted":
        path.unlink()
    elif fault == "directory-deleted":
        shutil.rmtree(state)
    elif fault == "replaced":
        os.replace(other, path)
    elif fault == "overwritten":
        shutil.copyfile(other, path)  # the same file, other bytes
    else:
        (state / f"{FILE_NAME}-wal").unlink()
    message = f"{path}: {why} {AFTERWARDS}"
    _refused(store, session.id, message)
    if fault in ("deleted", "directory-deleted"):  # a new file where it was changes nothing: still refused
        state.mkdir(exist_ok=True)
        shutil.copyfile(other, path)
        _refused(store, session.id, message)
    assert capfd.readouterr().err == f"trioserve: {message}\n"  # said once, for the operator
    kept = path.read_bytes() if path.exists() else None
    db.close()
    # This store's log is never applied to the file there now: not at this
    # close, not at the next open (it is set aside).
    assert not (state / f"{FILE_NAME}-wal").exists() or fault == "log-deleted"
    if fault in ("deleted", "directory-deleted", "replaced", "overwritten"):
        assert path.read_bytes() == kept
        copy = tmp_path / "copy"  # (written over in place, the file stays locked by this process: its store is never closed)
        copy.mkdir()
        shutil.copyfile(path, copy / FILE_NAME)
        assert [row[0] for row in _rows(copy / FILE_NAME)] == ["from-elsewhere"]
    else:  # its own file, written by its close: every change it answered is there
        assert [row[:2] for row in _rows(path)] == [(session.id, 1)]


class _RefusingDeletes:
    """A journal that takes writes but refuses deletes (as a full disk may
    refuse the one and not yet the other)."""

    shared = False

    def __init__(self) -> None:
        self.refuse = True

    def create(self, session, kind, used_wall) -> None:
        pass

    def delete(self, session_id) -> None:
        if self.refuse:
            raise StateError("state.sqlite3: the disk it is on is full")


def test_an_eviction_whose_delete_is_refused_keeps_the_session_and_fails_nothing():
    """The request that made room still succeeds; the session it would have
    evicted stays (in memory as on disk) until a delete goes through."""
    journal = _RefusingDeletes()
    store = SessionStore(journal=journal, max_sessions=1, idle_s=10.0)
    first = store.create(0.0)
    second = store.create(1.0)  # over the count: `first` would go, and cannot
    assert len(store) == 2 and store.evicted == 0
    assert store.get(first.id, 20.0, owner=None) is first  # idle past the limit: not expired either
    journal.refuse = False
    store.create(21.0)
    assert len(store) == 1 and store.evicted == 2
    assert second.id not in store._sessions


def test_a_full_disk_at_start_is_one_line_saying_so(tmp_path):
    with small_disk(tmp_path / "disk", "256k") as disk:
        fill(disk)
        path = disk / "state" / FILE_NAME
        with pytest.raises(StateError) as caught:
            StateDB(path)
        assert str(caught.value) == f"{path}: {FULL}"
