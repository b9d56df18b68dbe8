"""What the state file's EXCLUSIVE locking costs (issue #49, item 6): one
committed turn's transaction (the session's row updated, two messages
inserted, WAL, synchronous=FULL), timed per commit, side by side:

- ``shared``: as the state file was opened before: normal locking, the WAL
  index in a ``-shm`` file mapped from the disk;
- ``exclusive``: ``locking_mode=EXCLUSIVE``, the WAL index in the heap;
- ``StateDB``: the store itself (state/durable.py), exclusive, with its
  checks of the file and its log before and after each write.

The variants take turns, in rounds, each on its own file in DIR, so that
whatever else the machine does falls on all of them alike.

    .venv/bin/python bench/state_locking.py [--turns 200] [--rounds 5] [--dir DIR]

Put DIR on the disk the server's --state-dir would use; on a tmpfs (no
fsync) what is left is the locking and the checks themselves."""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from trioserve.state.durable import _SCHEMA, SCHEMA_VERSION, StateDB
from trioserve.state.session import Turn
from trioserve.state.session_store import SessionStore

MESSAGES = ({"role": "user", "content": "hello there " * 10}, {"role": "assistant", "content": "a reply of some length " * 8})


class Raw:
    """The store's transaction on a plain connection, in one locking mode."""

    def __init__(self, path: Path, exclusive: bool) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        if exclusive:
            self.db.execute("PRAGMA locking_mode = EXCLUSIVE")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = FULL")
        self.db.executescript(_SCHEMA + f"; PRAGMA user_version = {SCHEMA_VERSION};")
        self.db.execute("INSERT INTO sessions VALUES ('s', 0, NULL, '{}', 1, NULL, 0, 0, 0, 0, NULL, 'session', 0, '')")
        self.turns = 0

    def commit(self) -> None:
        self.turns += 1
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute("UPDATE sessions SET draw_index = ?, turns = ?, used = ? WHERE id = 's' AND turns = ?", (self.turns, self.turns, time.time(), self.turns - 1))
        for i, message in enumerate(MESSAGES):
            self.db.execute("INSERT INTO messages VALUES ('s', ?, ?)", (2 * self.turns + i, json.dumps(message)))
        self.db.execute("COMMIT")


class Store:
    """The same turn through a SessionStore on a StateDB."""

    def __init__(self, path: Path) -> None:
        self.store = SessionStore(journal=StateDB(path))
        self.session = self.store.create(0.0)
        self.turns = 0

    def commit(self) -> None:
        self.turns += 1
        self.store.commit(self.store.begin(self.session.id, 0.0), Turn(MESSAGES, 1, self.turns, 40, 30), 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200, help="commits per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    where = Path(tempfile.mkdtemp(prefix="trioserve-locking-", dir=args.dir))
    variants = {
        "shared": Raw(where / "shared.sqlite3", exclusive=False),
        "exclusive": Raw(where / "exclusive.sqlite3", exclusive=True),
        "StateDB": Store(where / "state.sqlite3"),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, variant in variants.items():
            for _ in range(args.turns):
                start = time.perf_counter()
                variant.commit()
                times[name].append(time.perf_counter() - start)
    print(f"{args.rounds} rounds of {args.turns} commits each, in {where}; files: {sorted(p.name for p in where.iterdir())}")
    for name, spent in times.items():
        spent.sort()
        print(f"{name:10} commit: p50 {statistics.median(spent) * 1e3:.3f} ms, p90 {spent[int(0.9 * len(spent))] * 1e3:.3f} ms, mean {statistics.fmean(spent) * 1e3:.3f} ms")
    db = variants["StateDB"].store.journal
    checks = []
    for _ in range(args.rounds * args.turns):
        start = time.perf_counter()
        db._check_files()  # before a write
        db._seen = db._signatures(db._seen)  # after it
        checks.append(time.perf_counter() - start)
    print(f"{'checks':10} per write: p50 {statistics.median(checks) * 1e3:.3f} ms (the file and its log looked at before and after; in StateDB's time)")


if __name__ == "__main__":
    main()
