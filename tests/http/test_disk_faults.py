"""The state store's faults on a real `trioserve serve` process (issue #49,
finding 9), made for real (tests/disk_faults.py): its disk full, its
write-ahead log made unwritable, an immutable -shm file beside it, and the
state file deleted or replaced under it.

For each, every write a user asks for is refused in its route's shape: a
503 `state_unavailable` JSON error for a session made, a buffered turn, a
buffered stored response and a delete; an error event, then [DONE], ending
a streamed turn; a `response.failed` event ending a streamed stored
response. The message says why (the disk is full, the file cannot be
written, is gone or was replaced) and that nothing changed; the session is
as it was, the process stays up, and once the disk can take writes again
the same session goes on (nothing half committed, the file intact after a
restart)."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
from pathlib import Path

import httpx
import pytest
import trio

from tests.disk_faults import fill, immutable, small_disk
from tests.http.conftest import assert_error, read_sse
from tests.http.test_durable import Server
from tests.http.test_responses import read_events
from trioserve.state.durable import FILE_NAME, StateDB
from trioserve.state.session_store import SessionStore

TIMEOUT = 120
NOTHING_CHANGED = "the state store could not keep this, so nothing changed: "
FULL = "the disk it is on is full (database or disk is full); free space there, then retry"
UNWRITABLE = "cannot be written: the disk failed, or the file was made unwritable (disk I/O error, SQLITE_IOERR_WRITE); make it writable, then retry"
AFTERWARDS = "while the server ran; the server writes nothing more there, and refuses every change until it is restarted (it then starts from what that path holds)"
TURN = {"messages": [{"role": "user", "content": "Tell me more"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
RESPONSE = {"input": "Say something", "max_output_tokens": 3, "temperature": 0}


async def _session_with_a_turn(client: httpx.AsyncClient) -> tuple[str, str]:
    """A session with one committed turn, and a stored response: their ids."""
    made = await client.post("/v1/sessions", json={"system": "Be brief."})
    assert made.status_code == 200, made.text
    sid = made.json()["id"]
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=TURN)).status_code == 200
    stored = await client.post("/v1/responses", json=RESPONSE)
    assert stored.status_code == 200, stored.text
    return sid, stored.json()["id"]


async def _refused_everywhere(server: Server, client: httpx.AsyncClient, sid: str, response_id: str, message: str) -> None:
    """Every write is refused with ``message`` in its route's shape, and
    nothing changed: the session, the stored response, the process."""
    before = (await client.get(f"/v1/sessions/{sid}")).json()
    message = NOTHING_CHANGED + message
    for response in (
        await client.post(f"/v1/sessions/{sid}/turns", json=TURN),
        await client.post("/v1/responses", json=RESPONSE),
        await client.post("/v1/responses", json={**RESPONSE, "previous_response_id": response_id}),
        await client.post("/v1/sessions", json={}),
        await client.delete(f"/v1/sessions/{sid}"),
        await client.delete(f"/v1/responses/{response_id}"),
    ):
        error = assert_error(response, 503, fragment=message, param=None, kind="server_error", code="state_unavailable")
        assert error["message"] == message, error
    # A streamed turn: its text, then the error event, then [DONE]: not cut,
    # and no chunk that says it finished.
    async with client.stream("POST", f"/v1/sessions/{sid}/turns", json={**TURN, "stream": True}) as response:
        sse = await read_sse(response)
    assert sse.payloads[-1] == "[DONE]" and sse.payloads[-2] == {"error": {"message": message, "type": "server_error", "param": None, "code": "state_unavailable"}}, sse.payloads[-3:]
    assert not any(c.get("finish_reason") for chunk in sse.chunks[:-1] for c in chunk["choices"]), sse.payloads
    # A streamed stored response: its text, then response.failed saying why.
    async with client.stream("POST", "/v1/responses", json={**RESPONSE, "stream": True}) as response:
        events = await read_events(response)
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed", last
    assert last["response"]["error"] == {"code": "state_unavailable", "message": message}, last
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    assert_error(await client.get(f"/v1/responses/{last['response']['id']}"), 404, fragment="no response", param=None, code="response_not_found")
    assert (await client.get(f"/v1/sessions/{sid}")).json() == before  # nothing half committed
    assert (await client.get(f"/v1/responses/{response_id}")).status_code == 200
    assert (await client.get("/health")).status_code == 200 and server.proc.returncode is None


async def _goes_on(client: httpx.AsyncClient, sid: str, turns: int) -> dict:
    """The same session takes a turn again (buffered and streamed), stored
    responses are kept again: the session as it now is."""
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=TURN)).status_code == 200
    async with client.stream("POST", f"/v1/sessions/{sid}/turns", json={**TURN, "stream": True}) as response:
        assert (await read_sse(response)).payloads[-1] == "[DONE]"
    stored = await client.post("/v1/responses", json=RESPONSE)
    assert stored.status_code == 200 and (await client.get(f"/v1/responses/{stored.json()['id']}")).status_code == 200
    session = (await client.get(f"/v1/sessions/{sid}")).json()
    assert session["turns"] == turns + 2 and len(session["messages"]) == 2 * (turns + 2), session
    return session


async def _after_restart(model: Path, state: Path, sid: str, session: dict) -> None:
    """Stopped and started again on the same state: the session as it was
    last answered, and the file intact."""
    check = sqlite3.connect(state / FILE_NAME)
    try:
        assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        check.close()  # the server's lock is its alone: another reader stops it starting
    again = Server(model, state)
    await again.start()
    try:
        async with httpx.AsyncClient(base_url=again.url, timeout=60) as client:
            assert (await client.get(f"/v1/sessions/{sid}")).json() == session
    finally:
        await again.stop(signal.SIGTERM)


async def test_a_full_disk_refuses_every_write_saying_so_and_the_server_goes_on_once_there_is_room(tiny_gguf, tmp_path):
    with small_disk(tmp_path / "disk", "1m") as disk:
        state = disk / "state"
        server = Server(tiny_gguf, state)
        with trio.fail_after(TIMEOUT):
            await server.start()
            try:
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                    sid, response_id = await _session_with_a_turn(client)
                    filler = fill(disk)
                    await _refused_everywhere(server, client, sid, response_id, f"{state / FILE_NAME}: {FULL}")
                    filler.unlink()
                    session = await _goes_on(client, sid, 1)
            finally:
                await server.stop(signal.SIGTERM)
            await _after_restart(tiny_gguf, state, sid, session)


async def test_an_unwritable_state_file_refuses_every_write_saying_so_until_it_is_writable(tiny_gguf, tmp_path):
    """Its write-ahead log made immutable (on the machine's own disk: a
    tmpfs lets an open file be written after chattr +i)."""
    state = tmp_path / "state"
    server = Server(tiny_gguf, state)
    with trio.fail_after(TIMEOUT):
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                sid, response_id = await _session_with_a_turn(client)
                with immutable(state / f"{FILE_NAME}-wal"):
                    await _refused_everywhere(server, client, sid, response_id, f"{state / FILE_NAME}: {UNWRITABLE}")
                session = await _goes_on(client, sid, 1)
        finally:
            await server.stop(signal.SIGTERM)
        await _after_restart(tiny_gguf, state, sid, session)


async def test_an_immutable_shm_file_cannot_take_the_server_down(tiny_gguf, tmp_path):
    """It did (SIGBUS at the next write, the -shm being mapped from the
    disk). The WAL index is in the process's memory now: no -shm file is
    made, and one put there, immutable, is never touched."""
    state = tmp_path / "state"
    shm = state / f"{FILE_NAME}-shm"
    server = Server(tiny_gguf, state)
    with trio.fail_after(TIMEOUT):
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                sid, _ = await _session_with_a_turn(client)
                made = shm.exists()  # by the server: with a mapped -shm, what follows was a SIGBUS
                if not made:
                    shm.write_bytes(b"\xff" * 32768)
                with immutable(shm):
                    session = await _goes_on(client, sid, 1)
                    assert server.proc.returncode is None
        finally:
            await server.stop(signal.SIGTERM)
        assert server.proc.returncode == 0 and not made
        await _after_restart(tiny_gguf, state, sid, session)


@pytest.mark.parametrize("what", ["file", "directory"])
async def test_a_state_file_deleted_under_the_server_is_noticed_and_refused(tiny_gguf, tmp_path, what):
    """Turns answered 200 into a deleted file, and every session was gone
    after a restart. Now each write is refused, saying so, from then on."""
    state = tmp_path / "state"
    server = Server(tiny_gguf, state)
    with trio.fail_after(TIMEOUT):
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                sid, response_id = await _session_with_a_turn(client)
                if what == "file":
                    (state / FILE_NAME).unlink()
                else:
                    shutil.rmtree(state)
                message = f"{state / FILE_NAME}: the state file was deleted {AFTERWARDS}"
                await _refused_everywhere(server, client, sid, response_id, message)
                await _refused_everywhere(server, client, sid, response_id, message)  # from then on
        finally:
            await server.stop(signal.SIGTERM)


async def test_a_state_file_replaced_under_the_server_is_refused_and_used_after_a_restart(tiny_gguf, tmp_path):
    state = tmp_path / "state"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = StateDB(elsewhere / FILE_NAME)
    SessionStore(journal=other).create(0.0, system="from the other file", session_id="sess-other", model="tiny")
    other.close()
    server = Server(tiny_gguf, state)
    with trio.fail_after(TIMEOUT):
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                sid, response_id = await _session_with_a_turn(client)
                os.replace(elsewhere / FILE_NAME, state / FILE_NAME)
                message = f"{state / FILE_NAME}: another file was put in the state file's place {AFTERWARDS}"
                await _refused_everywhere(server, client, sid, response_id, message)
        finally:
            await server.stop(signal.SIGTERM)
        again = Server(tiny_gguf, state)
        await again.start()
        try:
            async with httpx.AsyncClient(base_url=again.url, timeout=60) as client:
                other_session = (await client.get("/v1/sessions/sess-other")).json()
                assert other_session.get("system") == "from the other file", other_session
                assert (await client.get(f"/v1/sessions/{sid}")).status_code == 404
                assert (await client.post("/v1/sessions/sess-other/turns", json=TURN)).status_code == 200
        finally:
            await again.stop(signal.SIGTERM)

