"""Sessions and stored responses kept on disk (trioserve/state/durable.py):
`trioserve serve` as a real process keeps every committed turn and stored
response across SIGTERM and `kill -9`, and refuses a state file it cannot
use with one line naming it, leaving the file as it was."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http.test_drain import free_port, serve_command
from trioserve import cli
from trioserve.state.durable import FILE_NAME, SCHEMA_VERSION, StateDB, StateError
from trioserve.state.session import SessionNotFound, Turn
from trioserve.state.session_store import SessionStore

TIMEOUT = 120
USER = [{"role": "user", "content": "Tell me a story"}]


async def healthy(url: str, proc: trio.Process) -> None:
    """Poll ``url``/health until 200, failing at once if ``proc`` exits."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while True:
            assert proc.returncode is None, f"{proc.args[0]} exited with {proc.returncode}"
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.05)


class Server:
    """One `trioserve serve` process on the tiny model with --state-dir."""

    def __init__(self, model: Path, state: Path | str) -> None:
        """``state``: a --state-dir, or a postgresql:// --state-url."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        where = ("--state-url", state) if str(state).startswith("postgresql://") else ("--state-dir", str(state))
        self.command = serve_command(
            "--model", str(model), "--served-model-name", "tiny", "--dtype", "float32", "--port", str(self.port),
            "--kv-cache-bytes", "1MiB", *where, "--log-level", "warning",
        )  # fmt: skip
        self.proc: trio.Process | None = None

    async def start(self) -> None:
        self.proc = await trio.lowlevel.open_process(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await healthy(self.url, self.proc)

    async def stop(self, how: signal.Signals) -> None:
        self.proc.send_signal(how)
        await self.proc.wait()


async def turn(client: httpx.AsyncClient, session: str, text: str) -> str:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = await client.post(f"/v1/sessions/{session}/turns", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
async def test_sessions_and_stored_responses_survive_a_restart(tiny_gguf, tmp_path, how):
    state = tmp_path / "state"
    server = Server(tiny_gguf, state)
    with trio.fail_after(TIMEOUT):
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                made = await client.post("/v1/sessions", json={"system": "Be brief.", "seed": 5, "temperature": 0.7})
                session = made.json()["id"]
                for text in ("one", "two", "three"):
                    await turn(client, session, text)
                before = (await client.get(f"/v1/sessions/{session}")).json()
                first = (await client.post("/v1/responses", json={"input": "hello", "max_output_tokens": 4})).json()
                second = (await client.post("/v1/responses", json={"input": "again", "previous_response_id": first["id"], "max_output_tokens": 4})).json()
        finally:
            await server.stop(how)
        assert (state / FILE_NAME).exists()

        again = Server(tiny_gguf, state)
        await again.start()
        try:
            async with httpx.AsyncClient(base_url=again.url, timeout=60) as client:
                after = (await client.get(f"/v1/sessions/{session}")).json()
                for key in ("messages", "system", "settings", "seed", "draw_index", "turns", "usage", "model"):
                    assert after[key] == before[key], key
                assert (await client.get(f"/v1/responses/{second['id']}")).json() == second
                assert (await client.get(f"/v1/responses/{first['id']}")).json() == first
                chained = await client.post("/v1/responses", json={"input": "more", "previous_response_id": second["id"], "max_output_tokens": 2})
                assert chained.status_code == 200, chained.text
                # The session goes on from where it was: its next turn is the
                # one a stateless request with its whole history gets.
                history = [{"role": "system", "content": "Be brief."}, *after["messages"], {"role": "user", "content": "four"}]
                stateless = await client.post(
                    "/v1/chat/completions", json={"messages": history, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
                )
                assert await turn(client, session, "four") == stateless.json()["choices"][0]["message"]["content"]
        finally:
            await again.stop(signal.SIGTERM)


def _bad_newer(path: Path) -> None:
    StateDB(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()  # the last connection: its write-ahead log goes into the file


def _bad_bytes(path: Path) -> None:
    path.write_bytes(b"this is not a database\n" * 200)


def _bad_truncated(path: Path) -> None:
    db = StateDB(path)
    store = SessionStore(journal=db)
    for i in range(40):
        session = store.create(0.0, system="x" * 500)
        store.commit(store.begin(session.id, 0.0), Turn(({"role": "user", "content": "y" * 2000},), 1, 1, 1, 1), 0.0)
    db.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("spoil", "fragment"),
    [
        (_bad_bytes, "not a trioserve state database, or damaged"),
        (_bad_truncated, "damaged"),
        (_bad_newer, f"written by a newer trioserve (schema {SCHEMA_VERSION + 1}; this one reads up to {SCHEMA_VERSION})"),
    ],
    ids=["not-a-database", "truncated", "newer-version"],
)
async def test_a_state_file_that_cannot_be_used_is_one_line_and_left_alone(tiny_gguf, tmp_path, spoil, fragment):
    state = tmp_path / "state"
    state.mkdir()
    path = state / FILE_NAME
    spoil(path)
    for leftover in (state / f"{FILE_NAME}-wal", state / f"{FILE_NAME}-shm"):
        leftover.unlink(missing_ok=True)
    kept = path.read_bytes()
    command = Server(tiny_gguf, state).command
    with trio.fail_after(TIMEOUT):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    lines = [line for line in done.stderr.decode().splitlines() if not line.startswith(("Loading", "Building"))]
    assert done.returncode == 2, done.stderr.decode()
    assert lines == [lines[0]] and lines[0].startswith(f"trioserve: error: {path}: "), lines
    assert fragment in lines[0]
    assert path.read_bytes() == kept


async def test_a_state_database_that_cannot_be_reached_is_one_line_without_its_password(tiny_gguf):
    command = Server(tiny_gguf, "postgresql://someone:secret@127.0.0.1:1/state").command
    with trio.fail_after(TIMEOUT):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    lines = [line for line in done.stderr.decode().splitlines() if not line.startswith(("Loading", "Building"))]
    assert done.returncode == 2, done.stderr.decode()
    assert len(lines) == 1 and lines[0].startswith("trioserve: error: postgresql://someone@127.0.0.1:1/state: "), lines
    assert "cannot reach or use the database" in lines[0] and "secret" not in done.stderr.decode()


def test_a_state_url_of_another_kind_is_refused_without_echoing_it(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--state-url", "mysql://root:secret@db/state"])
    err = capsys.readouterr().err
    assert "--state-url: a state URL starts with postgresql:// (got mysql://)" in err and "secret" not in err


def test_a_read_only_state_file_is_refused_by_name(tmp_path):
    """Read-only by its mode, or for root (whom modes do not stop) marked
    immutable (`chattr +i`)."""
    path = tmp_path / FILE_NAME
    StateDB(path).close()
    kept = path.read_bytes()
    if os.geteuid() != 0:
        path.chmod(0o444)
    elif subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode != 0:
        pytest.skip("running as root on a file system without chattr +i: a read-only state file cannot be made here")
    try:
        with pytest.raises(StateError, match=f"^{path}: cannot be written"):
            StateDB(path)
        assert path.read_bytes() == kept
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], check=False)


def copy_of_state(path: Path, where: Path) -> StateDB:
    """What a process restarted after `kill -9` would read: the state file
    and its write-ahead log as they are on disk now, copied (the running
    store keeps them for itself: a second connection is refused)."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir()
    for name in (path.name, f"{path.name}-wal"):
        if (path.parent / name).exists():
            shutil.copyfile(path.parent / name, where / name)
    return StateDB(where / path.name)


def test_every_change_is_in_the_file_when_the_call_returns(tmp_path):
    """Made, committed, deleted and evicted sessions, read back from the
    files (as a restarted process would) after each call."""
    path = tmp_path / FILE_NAME
    store = SessionStore(journal=StateDB(path), max_sessions=2)

    def on_disk() -> dict[str, list]:
        return {row["id"]: [m["content"] for m in row["messages"]] for row in copy_of_state(path, tmp_path / "copy").load()}

    a = store.create(0.0, system="s")
    assert on_disk() == {a.id: []}
    lease = store.begin(a.id, 1.0)
    pending = store.prepare_commit(lease, Turn(({"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}), 9, 3, 5, 2))
    assert on_disk() == {a.id: []}  # laid out, not written
    store.write(pending)
    assert on_disk() == {a.id: ["q", "r"]}  # on disk before it shows in memory
    assert a.messages == []
    store.apply(pending, 2.0)
    assert a.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]
    row = copy_of_state(path, tmp_path / "copy").load()[0]
    assert (row["seed"], row["draw_index"], row["turns"], row["prompt_tokens"], row["completion_tokens"]) == (9, 3, 1, 5, 2)
    b = store.create(3.0)
    c = store.create(4.0)  # over max_sessions: a, the least recently used, is evicted
    assert set(on_disk()) == {b.id, c.id}
    store.delete(b.id, 5.0)
    assert set(on_disk()) == {c.id}
    restored = SessionStore()
    assert restored.restore(copy_of_state(path, tmp_path / "copy").load(), 0.0) == 1 and restored.get(c.id, 0.0).id == c.id


async def kill_during_turn(server: Server, session: str, kill_after: int) -> bool:
    """Stream one turn and `kill -9` the server once ``kill_after`` SSE
    events have arrived (or when the stream ends first), reading on until
    the connection drops; True when the client saw the turn's final event
    (its finish_reason) before the kill."""
    body = {"messages": [{"role": "user", "content": f"turn after {kill_after}"}], "max_tokens": 8, "ignore_eos": True, "stream": True}
    seen_final = False
    events = 0
    killed = False
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async with client.stream("POST", f"/v1/sessions/{session}/turns", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if killed or not line.startswith("data: "):
                        continue
                    if '"finish_reason": "length"' in line:
                        seen_final = True
                    events += 1
                    if events >= kill_after:
                        server.proc.send_signal(signal.SIGKILL)
                        killed = True
    except httpx.TransportError:
        pass  # the connection died with the server
    finally:
        await server.stop(signal.SIGKILL)
    return seen_final


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kill_points=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=2))
async def test_a_kill_at_any_point_of_a_turn_keeps_whole_turns_in_order(tiny_gguf, tmp_path_factory, kill_points):
    """The server is killed after 1-12 events of a streamed turn (its role
    chunk, tokens, the final chunk, usage, [DONE]: before its commit, around
    it, after it). Each restart holds every turn the client saw end, plus at
    most the one it was killed in: never half a turn, never out of order."""
    state = tmp_path_factory.mktemp("crash")
    server = Server(tiny_gguf, state)
    with trio.fail_after(TIMEOUT):
        await server.start()
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            session = (await client.post("/v1/sessions", json={"seed": 3})).json()["id"]
            await turn(client, session, "first")
        users = ["first"]  # the user messages of the turns kept so far, in order
        for kill_after in kill_points:
            saw_it = await kill_during_turn(server, session, kill_after)
            server = Server(tiny_gguf, state)
            await server.start()
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                kept = (await client.get(f"/v1/sessions/{session}")).json()
            grew = kept["turns"] - len(users)
            assert grew in ((1,) if saw_it else (0, 1)), (kill_after, saw_it, kept["turns"], len(users))
            if grew:
                users.append(f"turn after {kill_after}")
            messages = kept["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant"] * kept["turns"]  # whole turns only
            assert [m["content"] for m in messages[::2]] == users  # in order
        await server.stop(signal.SIGTERM)



async def test_a_state_file_that_fails_a_commit_leaves_the_turn_uncommitted(tiny_gguf, tmp_path):
    """The state file stops taking writes mid-run (its connection closed
    under the store): the turn answers 503 saying so and the session is as
    it was; a new session is refused the same way. Nothing is half kept."""
    import json

    import attrs

    from tests.http.conftest import make_settings
    from tests.http.test_session_commit_points import call
    from trioserve.http.app import create_app

    app = create_app(attrs.evolve(make_settings(tiny_gguf), state_dir=str(tmp_path / "state")))
    turn_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with trio.fail_after(TIMEOUT):
        async with app.test_app():
            status, chunks = await call(app, "POST", "/v1/sessions", {})
            sid = json.loads(b"".join(chunks))["id"]
            assert (await call(app, "POST", f"/v1/sessions/{sid}/turns", turn_body))[0] == 200
            store = app.extensions["trioserve"].sessions
            store.journal._db.close()  # every later write fails
            status, chunks = await call(app, "POST", f"/v1/sessions/{sid}/turns", turn_body)
            error = json.loads(b"".join(chunks))["error"]
            assert status == 503 and error["code"] == "state_unavailable", (status, error)
            assert error["message"].startswith("the state store could not keep this, so nothing changed: ")
            session = store.get(sid, trio.current_time())
            assert session.turns == 1 and len(session.messages) == 2 and not session.busy
            status, chunks = await call(app, "POST", "/v1/sessions", {})
            assert status == 503 and json.loads(b"".join(chunks))["error"]["code"] == "state_unavailable"
            assert len(store) == 1


_SCHEMA_1 = """
CREATE TABLE sessions (id TEXT PRIMARY KEY, created REAL NOT NULL, system TEXT, defaults TEXT NOT NULL, seed INTEGER, model TEXT,
    draw_index INTEGER NOT NULL, turns INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    record TEXT, kind TEXT NOT NULL, used REAL NOT NULL);
CREATE TABLE messages (session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE, position INTEGER NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (session_id, position));
PRAGMA user_version = 1;
"""


def test_a_schema_1_file_is_migrated_keeping_every_row(tmp_path):
    """Version 1 (before tenants) wrote stored responses with kind
    'session': the migration tells them apart by their record and gives
    every row to the one tenant there was."""
    path = tmp_path / FILE_NAME
    old = sqlite3.connect(path)
    old.executescript(_SCHEMA_1)
    old.execute("INSERT INTO sessions VALUES ('sess-1', 1.0, 'Be brief.', '{}', 5, 'tiny', 2, 1, 3, 2, NULL, 'session', 9.0)")
    old.execute("INSERT INTO sessions VALUES ('resp_1', 2.0, NULL, '{}', NULL, 'tiny', 0, 0, 0, 0, '{\"id\": \"resp_1\"}', 'session', 8.0)")
    old.execute("INSERT INTO messages VALUES ('sess-1', 0, '{\"role\": \"user\", \"content\": \"hi\"}')")
    old.commit()
    old.close()
    db = StateDB(path)
    rows = {row["id"]: row for row in db.load()}
    assert rows["sess-1"]["kind"] == "session" and rows["resp_1"]["kind"] == "response"
    assert rows["sess-1"]["owner"] == rows["resp_1"]["owner"] == ""
    assert rows["sess-1"]["messages"] == [{"role": "user", "content": "hi"}] and rows["sess-1"]["seed"] == 5
    sessions, responses = SessionStore(), SessionStore(kind="response")
    assert sessions.restore(db.load(), 0.0) == 1 and responses.restore(db.load(), 0.0) == 1
    db.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_owners_are_kept(tmp_path):
    db = StateDB(tmp_path / FILE_NAME)
    store = SessionStore(journal=db)
    made = store.create(0.0, owner="alice")
    db.close()  # the file is one process's at a time
    again = SessionStore()
    again.restore(StateDB(tmp_path / FILE_NAME).load(), 0.0)
    assert again.get(made.id, 0.0, owner="alice").owner == "alice"
    with pytest.raises(SessionNotFound):
        again.get(made.id, 0.0, owner="bob")
