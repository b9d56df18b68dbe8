"""What a durable session commit costs (issue #28): the same committed turn
into a SessionStore with and without its SQLite journal (state/durable.py,
WAL, synchronous=FULL), timed per commit, and with a PostgreSQL one
(state/durable_pg.py) when --state-url names a database. The server runs
the durable write in a thread, off the event loop; this times the write
itself.

    .venv/bin/python bench/state_commit.py [--turns 300] [--dir DIR] [--state-url URL]

DIR is where the state file goes (default: a new directory under /tmp):
put it on the disk the server's --state-dir would use. URL is a database
it may write a `trioserve` schema into (as `serve --state-url` does)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from trioserve.state.durable import FILE_NAME, StateDB
from trioserve.state.session import Turn
from trioserve.state.session_store import SessionStore


def commits(store: SessionStore, turns: int) -> list[float]:
    session = store.create(0.0, system="Be brief.")
    times = []
    for i in range(turns):
        turn = Turn(({"role": "user", "content": "hello there " * 10}, {"role": "assistant", "content": "a reply of some length " * 8}), 1, i, 40, 30)
        lease = store.begin(session.id, 0.0)
        start = time.perf_counter()
        store.commit(lease, turn, 0.0)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--state-url", default=None)
    args = parser.parse_args()
    where = args.dir or Path(tempfile.mkdtemp(prefix="trioserve-state-"))
    stores = [("sqlite", str(where), SessionStore(journal=StateDB(where / FILE_NAME)))]
    if args.state_url:
        from trioserve.state.durable_pg import PostgresStateDB, safe_url

        stores.append(("postgres", safe_url(args.state_url), SessionStore(journal=PostgresStateDB(args.state_url))))
    stores.append(("memory", "no journal", SessionStore()))
    for label, place, store in stores:
        times = sorted(commits(store, args.turns))
        print(f"{label:8} commit: p50 {statistics.median(times) * 1e3:.3f} ms, p90 {times[int(0.9 * len(times))] * 1e3:.3f} ms ({args.turns} turns, {place})")


if __name__ == "__main__":
    main()
