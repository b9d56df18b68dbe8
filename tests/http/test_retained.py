"""What the server keeps for a client is counted and kept compact (issue
30, items 1 and 2), through a real server on the tiny model in this
process, whose RSS the tests read:

- a session's settings and a stored response's record are kept as compact
  JSON text, counted against the history bytes: tools whose parsed tree
  holds many times their text (lists of empty lists) cost their text;
- tools, schemas and grammars have a bound on their total per request, not
  only each one (the 3.9 MiB body of 63 tools is a 400 naming tools);
- what would keep more than the tenant may keep in all is a 400 naming the
  field, and nothing is created;
- stored responses that echo big tools evict only their own tenant's."""

from __future__ import annotations

import json

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import assert_error, make_settings, start_server
from trioserve.http.schemas import MAX_REQUEST_CONSTRAINT_CHARS

TIMEOUT = 120
MIB = 1 << 20


def rss() -> int:
    """This process's resident memory, in bytes (the server runs in it)."""
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def empty_lists_tools(total_chars: int, count: int = 4) -> list[dict]:
    """``count`` tools whose schemas are enums of empty lists, about
    ``total_chars`` of compact JSON in all: ~20 bytes of Python objects
    per character once parsed."""
    per_tool = total_chars // count
    schema = {"type": "object", "properties": {"a": {"enum": [[]] * (per_tool // 3)}}}
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": schema}} for i in range(count)]


def flat(tools: list[dict]) -> list[dict]:
    """The same tools as the Responses API spells them (no "function" wrapper)."""
    return [{"type": "function", **t["function"]} for t in tools]


def size_of(tools: list[dict]) -> int:
    return sum(len(json.dumps(t["function"]["parameters"], separators=(",", ":"))) for t in tools)


async def test_the_issue_body_of_63_tools_is_refused_naming_tools(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf, max_body_bytes=8 * MIB))
    schema = {"type": "object", "properties": {"a": {"enum": [[]] * 21812}}}
    body = {"max_tokens": 4, "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": schema}} for i in range(63)]}
    before = rss()
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            for _ in range(2):
                refused = await client.post("/v1/sessions", json=body)
                assert_error(refused, 400, fragment=f"may total {MAX_REQUEST_CONSTRAINT_CHARS} characters in one request", param="tools")
            sessions = (await client.get("/metrics")).json()["sessions"]["active"]
    assert sessions == 0  # nothing created
    # Each body is parsed (and let go) once, its parse taking ~110 MB for a
    # moment: each kept its ~95 MB before, so two grew RSS by 190 MB and more.
    assert rss() - before < 150 * MIB, (before, rss())


async def test_session_settings_are_kept_as_their_text_and_counted(nursery, tiny_gguf):
    """8 sessions with ~240 KB of tools each: as parsed trees they held
    ~5 MB each (40 MB); as text, 8 x 240 KB."""
    url = await start_server(nursery, make_settings(tiny_gguf))
    tools = empty_lists_tools(MAX_REQUEST_CONSTRAINT_CHARS - 8000)
    size = size_of(tools)
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            made = await client.post("/v1/sessions", json={"tools": tools})  # one first: what any first request costs
            assert made.status_code == 200, made.text
            before = rss()
            for _ in range(8):
                assert (await client.post("/v1/sessions", json={"tools": tools})).status_code == 200
            grown = rss() - before
            read = await client.get(f"/v1/sessions/{made.json()['id']}")
            # A session with a small tool (the tiny model's context holds it): its turn runs from the kept text.
            small = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"enum": [[]]}}}}}]
            little = (await client.post("/v1/sessions", json={"tools": small, "temperature": 0})).json()["id"]
            turn = await client.post(f"/v1/sessions/{little}/turns", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            settings = (await client.get(f"/v1/sessions/{little}")).json()["settings"]
    assert grown < 20 * MIB, f"8 sessions of {size} bytes of tools grew RSS by {grown}"
    assert read.json()["settings"]["tools"] == tools  # given back as sent
    assert turn.status_code == 200, turn.text
    assert settings == {"tools": small, "temperature": 0}


async def test_what_a_tenant_may_not_keep_is_refused_before_anything_is_made(nursery, tiny_gguf):
    settings = attrs.evolve(make_settings(tiny_gguf, api_key=("alice", "bob")), tenant_history_bytes=100_000)
    url = await start_server(nursery, settings)
    tools = empty_lists_tools(200_000)
    alice = {"Authorization": "Bearer alice"}
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers=alice) as client:
            session = await client.post("/v1/sessions", json={"tools": tools})
            assert_error(session, 400, fragment="more than the 100000 this API key may keep in all; send less", param="tools")
            assert (await client.get("/metrics")).json()["sessions"]["active"] == 0
            stored = await client.post("/v1/responses", json={"input": "hi", "tools": flat(tools), "tool_choice": "none", "max_output_tokens": 1})
            assert_error(stored, 400, fragment="this stored response would keep", param="tools")
            unstored = await client.post("/v1/responses", json={"input": "hi", "tools": flat(tools), "tool_choice": "none", "max_output_tokens": 1, "store": False})
            assert unstored.status_code == 200, unstored.text  # nothing kept: nothing to refuse


async def test_big_stored_responses_evict_only_their_own_tenants(nursery, tiny_gguf):
    """Item 2: responses echoing large tools fill the store; Bob's push out
    Bob's older ones, never Alice's."""
    settings = attrs.evolve(make_settings(tiny_gguf, api_key=("alice", "bob")), session_history_bytes=2 * MIB)
    url = await start_server(nursery, settings)
    tools = empty_lists_tools(200_000)
    ask = {"input": "hi", "tools": flat(tools), "tool_choice": "none", "max_output_tokens": 1}
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers={"Authorization": "Bearer alice"}) as alice, \
                httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers={"Authorization": "Bearer bob"}) as bob:  # fmt: skip
            hers = [(await alice.post("/v1/responses", json={"input": f"mine {i}", "max_output_tokens": 1})).json()["id"] for i in range(3)]
            his = []
            assert (await bob.post("/v1/responses", json=ask)).status_code == 200  # one first: what any first request costs
            before = rss()
            for _ in range(14):
                answer = await bob.post("/v1/responses", json=ask)
                assert answer.status_code == 200, answer.text
                his.append(answer.json()["id"])
            grown = rss() - before
            kept = [r for r in his if (await bob.get(f"/v1/responses/{r}")).status_code == 200]
            assert 0 < len(kept) < len(his) and kept == his[-len(kept):]  # his newest, within his share
            assert [(await alice.get(f"/v1/responses/{r}")).status_code for r in hers] == [200, 200, 200]
    # Each record echoes ~200 KB of tools: as parsed trees the kept ones held ~4 MB each.
    assert grown < 30 * MIB, f"14 stored responses grew RSS by {grown}"


@pytest.mark.parametrize(("route", "field"), [("/v1/chat/completions", "user"), ("/v1/sessions", "stop")])
async def test_health_is_answered_while_huge_bodies_are_checked(nursery, tiny_gguf, route, field):
    """Items 6 and 7: four 4 MiB bodies of 1.4 M empty lists in one field
    (`user`; a session's `stop`), sent at once, are each refused naming it;
    meanwhile /health is
    answered, more than once, before the last refusal: their decoding,
    checks and parsing run in worker threads (session routes too) and the
    check costs little (a scan of the raw text), so the event loop goes on
    serving."""
    url = await start_server(nursery, make_settings(tiny_gguf, max_body_bytes=8 * MIB))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: [[]] * 1_400_000}).encode()
    pending = 4
    answered_meanwhile = 0
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=httpx.Limits(max_connections=8)) as client:

            async def huge() -> None:
                nonlocal pending
                refused = await client.post(route, content=body, headers={"Content-Type": "application/json"})
                assert refused.status_code == 400 and refused.json()["error"]["param"].startswith(field), refused.text[:300]
                pending -= 1

            async with trio.open_nursery() as inner:
                for _ in range(4):
                    inner.start_soon(huge)
                await trio.sleep(0)
                while pending:
                    health = await client.get("/health")
                    assert health.status_code == 200
                    answered_meanwhile += bool(pending)
    assert answered_meanwhile >= 2, answered_meanwhile
