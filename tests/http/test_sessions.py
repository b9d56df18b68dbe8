"""Sessions over a real server with the tiny model: turns commit exactly when
their final response goes out, a cancelled turn changes nothing, seeded
sampling continues its stream across turns, and the errors a client can
cause come back with their status and message."""

from __future__ import annotations

import httpx
import trio

from tests.http.conftest import MAX_MODEL_LEN, assert_error, make_settings, read_sse, start_server
from tests.http.test_server import raw_post

TIMEOUT = 30.0


async def create(client, **body) -> str:
    response = await client.post("/v1/sessions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["id"]


async def turn(client, sid: str, content: str, **extra) -> dict:
    response = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": content}], **extra})
    assert response.status_code == 200, response.text
    return response.json()


async def test_turns_equal_stateless_chat_with_the_full_history(server):
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            sid = await create(client, system="Be brief.", temperature=0, max_tokens=6, ignore_eos=True)
            history = [{"role": "system", "content": "Be brief."}]
            for question in ("first question", "second one", "and a third"):
                reply = (await turn(client, sid, question))["choices"][0]["message"]["content"]
                history.append({"role": "user", "content": question})
                stateless = await client.post(
                    "/v1/chat/completions", json={"messages": history, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
                )
                assert stateless.json()["choices"][0]["message"]["content"] == reply
                history.append({"role": "assistant", "content": reply})
            state = (await client.get(f"/v1/sessions/{sid}")).json()
            sessions = (await client.get("/metrics")).json()["sessions"]
    assert sessions["active"] == 1 and sessions["turns_committed"] == 3 and sessions["turns_cancelled"] == 0
    assert state["turns"] == 3 and state["messages"] == history[1:]
    assert state["usage"]["completion_tokens"] == 18


async def test_a_cancelled_turn_changes_nothing_and_its_retry_matches(nursery, tiny_gguf, slow_steps):
    """Disconnect mid-stream: the history and draw position stay; the retry
    gives exactly what an uninterrupted turn gives (seeded sampling), and it
    continues the random stream the first turn left."""
    url = await start_server(nursery, make_settings(tiny_gguf))
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            settings = {"seed": 9, "temperature": 0.9, "max_tokens": 8, "ignore_eos": True}
            sid = await create(client, **settings)
            control = await create(client, **settings)
            first = await turn(client, sid, "hello there")
            await turn(client, control, "hello there")
            before = (await client.get(f"/v1/sessions/{sid}")).json()
            assert before["draw_index"] == 8 and before["turns"] == 1

            slow_steps(0.05)
            body = {"messages": [{"role": "user", "content": "tell me more"}], "stream": True}
            stream = await raw_post(url, f"/v1/sessions/{sid}/turns", body)
            async with stream:
                received = b""
                while received.count(b"data: ") < 3:  # the role chunk and two token chunks
                    data = await stream.receive_some()
                    assert data, f"the server closed the stream early: {received[-300:]!r}"
                    received += data
                assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
            # leaving the block closed the connection mid-stream
            for _ in range(100):
                state = (await client.get(f"/v1/sessions/{sid}")).json()
                if not state["busy"]:
                    break
                await trio.sleep(0.02)
            assert {k: state[k] for k in ("turns", "draw_index", "messages")} == {k: before[k] for k in ("turns", "draw_index", "messages")}

            retry = await turn(client, sid, "tell me more")
            uninterrupted = await turn(client, control, "tell me more")
            assert retry["choices"][0]["message"] == uninterrupted["choices"][0]["message"]
            assert first["choices"][0]["message"]["content"]
            assert (await client.get(f"/v1/sessions/{sid}")).json()["draw_index"] == 16


async def test_a_second_concurrent_turn_is_409(nursery, tiny_gguf, slow_steps):
    url = await start_server(nursery, make_settings(tiny_gguf))
    slow_steps(0.02)
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            sid = await create(client, max_tokens=40, ignore_eos=True, temperature=0)
            body = {"messages": [{"role": "user", "content": "go"}], "stream": True}
            async with client.stream("POST", f"/v1/sessions/{sid}/turns", json=body) as running:
                assert running.status_code == 200
                clash = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "me too"}]})
                assert_error(clash, 409, fragment="already has a turn running", param=None, code="session_busy")
                sse = await read_sse(running)
            assert sse.payloads[-1] == "[DONE]"
            assert (await client.get(f"/v1/sessions/{sid}")).json()["turns"] == 1


async def test_unknown_deleted_and_bad_requests(server):
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            assert_error(await client.get("/v1/sessions/nope"), 404, fragment="no session 'nope'", param=None, code="session_not_found")
            sid = await create(client, max_tokens=2)
            gone = await client.delete(f"/v1/sessions/{sid}")
            assert gone.json() == {"id": sid, "object": "session.deleted", "deleted": True}
            assert_error(await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "x"}]}), 404, fragment="no session", param=None, code="session_not_found")
            assert_error(await client.post("/v1/sessions", json={"temperature": 9}), 400, fragment="temperature", param="temperature")
            sid = await create(client, max_tokens=2)
            wrong_role = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "assistant", "content": "x"}]})
            assert_error(wrong_role, 400, fragment="only user or tool messages", param="messages")
            too_long = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "word " * 400}]})
            assert_error(too_long, 400, fragment=f"the maximum model length is {MAX_MODEL_LEN}", param="messages", code="context_length_exceeded")
            state = (await client.get(f"/v1/sessions/{sid}")).json()
            assert state["turns"] == 0 and state["busy"] is False


async def test_sessions_take_any_seed_chat_takes_and_every_turn_runs(server):
    """A seed past 2**63, or negative, is folded as chat folds it, at
    create time, so no turn of that session is refused for it; and the
    turn equals stateless chat with that seed."""
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            for seed in (2**63, 2**64 + 5, -3):
                sid = await create(client, seed=seed, temperature=0.9, max_tokens=5, ignore_eos=True)
                described = (await client.get(f"/v1/sessions/{sid}")).json()
                assert 0 <= described["seed"] < 2**63
                first = await turn(client, sid, "hello")
                await turn(client, sid, "again")
                chat = await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hello"}], "seed": seed, "temperature": 0.9, "max_tokens": 5, "ignore_eos": True},
                )
                assert chat.status_code == 200, chat.text
                assert first["choices"][0]["message"]["content"] == chat.json()["choices"][0]["message"]["content"]


async def test_session_settings_no_turn_could_use_are_refused_at_create(server):
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            before = (await client.get("/metrics")).json()["sessions"]["active"]
            huge = await client.post("/v1/sessions", json={"max_tokens": 2**64})
            assert_error(huge, 400, fragment="max_tokens: 18446744073709551616 can never fit", param="max_tokens")
            edge = await client.post("/v1/sessions", json={"max_completion_tokens": MAX_MODEL_LEN})
            assert_error(edge, 400, fragment=f"at most {MAX_MODEL_LEN - 1} new tokens", param="max_completion_tokens")
            seed = await client.post("/v1/sessions", json={"seed": "7"})
            assert_error(seed, 400, fragment="expected an integer", param="seed")
            model = await client.post("/v1/sessions", json={"model": 5})
            assert_error(model, 400, fragment="model: expected a string", param="model")
            chat_model = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "model": ["tiny"]})
            assert_error(chat_model, 400, fragment="model", param="model")
            after = (await client.get("/metrics")).json()["sessions"]["active"]
            assert after == before  # nothing was created on refusal
            fits = await client.post("/v1/sessions", json={"max_tokens": MAX_MODEL_LEN - 1})
            assert fits.status_code == 200, fits.text


async def test_the_conversation_key_header(server):
    """X-Session-Id on creation becomes the session's id (so a load balancer
    can hash on it from the first request: docs/scaling.md); every session
    answer and every response carries its key; a bad or taken key is
    refused by name."""
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            made = await client.post("/v1/sessions", json={}, headers={"X-Session-Id": "user-7:chat.1"})
            assert made.status_code == 200 and made.json()["id"] == "user-7:chat.1"
            assert made.headers["X-Session-Id"] == "user-7:chat.1"
            turn = await client.post("/v1/sessions/user-7:chat.1/turns", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert turn.status_code == 200 and turn.headers["X-Session-Id"] == "user-7:chat.1"
            assert (await client.get("/v1/sessions/user-7:chat.1")).headers["X-Session-Id"] == "user-7:chat.1"
            plain = await client.post("/v1/sessions", json={})
            assert plain.headers["X-Session-Id"] == plain.json()["id"]
            taken = await client.post("/v1/sessions", json={}, headers={"X-Session-Id": "user-7:chat.1"})
            assert_error(taken, 409, fragment="a session 'user-7:chat.1' exists already", param="X-Session-Id", code="session_exists")
            # Many at once with one new key (their writes to the state file
            # overlap): exactly one makes it, every other is told it is taken.
            raced: list[httpx.Response] = []

            async def make() -> None:
                raced.append(await client.post("/v1/sessions", json={}, headers={"X-Session-Id": "raced"}))

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(make)
            assert sorted(r.status_code for r in raced) == [200] + [409] * 7, [r.text for r in raced]
            for lost in (r for r in raced if r.status_code == 409):
                assert_error(lost, 409, fragment="a session 'raced' exists already", param="X-Session-Id", code="session_exists")
            for bad in ("two words", "x" * 129, "semi;colon"):
                refused = await client.post("/v1/sessions", json={}, headers={"X-Session-Id": bad})
                assert_error(refused, 400, fragment="X-Session-Id: 1 to 128 letters, digits and ._:- expected", param="X-Session-Id")
            first = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
            assert first.headers["X-Session-Id"] == first.json()["id"]
            keyed = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}, headers={"X-Session-Id": "chain-9"})
            assert keyed.headers["X-Session-Id"] == "chain-9"
