"""The HTTP transport (trioserve/http/transport.py) against hostile or
careless clients, on bare sockets so the test controls every write:

- an early response (401, 404, 405, 413, 415 answered before the request
  body arrived) leaves the connection usable for the next request;
- `Connection: close` and HTTP/1.0 close after the response; an idle
  kept-alive connection is closed after the keep-alive timeout; a body that
  stops arriving is closed after the read timeout;
- the drain on shutdown ends within its timeout even while a client holds a
  stream it never reads.

(The write deadline itself: test_write_timeout.py.)"""

from __future__ import annotations

import json

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import MODEL_NAME, assert_error, eventually, make_settings, metrics, start_server, wait_healthy
from tests.http.raw_client import RawClient, closed_by_server
from trioserve import cli
from trioserve.config import settings_from_env
from trioserve.http import serve
from trioserve.http.serve import serve_app

KEY = "sekret"
BODY_LIMIT = 1024
JSON = {"Content-Type": "application/json"}


def chat(text: str = "hi", **fields: object) -> bytes:
    return json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], **fields}).encode()


# (id, method, path, headers, body, status, fragment, kind, code): each is answered
# before the server has read the body (routing, the guard, or the length alone decide).
EARLY = [
    ("401", "POST", "/v1/chat/completions", {**JSON, "Authorization": "Bearer wrong"}, chat(), 401, "missing or wrong API key", "authentication_error", "invalid_api_key"),
    ("404", "POST", "/nope", JSON, chat(), 404, "no route POST /nope", "invalid_request_error", "not_found"),
    ("405", "PUT", "/health", JSON, chat(), 405, "PUT is not allowed on /health", "invalid_request_error", "method_not_allowed"),
    ("413", "POST", "/v1/chat/completions", {**JSON, "Authorization": f"Bearer {KEY}"}, chat("x" * 2 * BODY_LIMIT), 413, f"larger than {BODY_LIMIT} bytes", "invalid_request_error", "body_too_large"),
    ("415", "POST", "/v1/chat/completions", {"Content-Type": "text/plain", "Authorization": f"Bearer {KEY}"}, chat(), 415, "Content-Type: application/json", "invalid_request_error", "unsupported_media_type"),
]


async def early_then_body(client: RawClient, case) -> None:
    """Send the head, read the answer that comes before the body, then send
    the body in its own write (as httpx and the openai SDK do)."""
    _, method, path, headers, body, status, fragment, kind, code = case
    await client.send_head(method, path, headers, body_length=len(body))
    reply = await client.reply()
    assert_error(httpx.Response(reply.status, headers=reply.headers, content=reply.body), status, fragment=fragment, param=None, kind=kind, code=code)
    assert client.server_keeps_alive, f"{case[0]}: the server announced a close: {reply.headers}"
    await client.send_body(body)


async def test_early_responses_leave_the_connection_usable(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf, api_key=KEY, max_body_bytes=BODY_LIMIT))
    for case in EARLY:  # each on its own connection, followed by a request that must be answered
        async with await RawClient.connect(url) as client:
            await early_then_body(client, case)
            health = await client.request("GET", "/health")
            assert (health.status, health.json()) == (200, {"status": "ok"}), case[0]
            models = await client.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert models.status == 200 and models.json()["data"][0]["id"] == MODEL_NAME, case[0]
    async with await RawClient.connect(url) as client:  # all of them, one after another, on one connection
        for case in EARLY + EARLY:
            await early_then_body(client, case)
        ok = await client.request("POST", "/v1/chat/completions", json.loads(chat(max_tokens=2)), headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok


async def test_an_early_response_to_a_body_too_large_to_skip_closes(nursery, tiny_gguf):
    """A body bigger than the server will read past (256 KiB) is not waited
    for: the response says `Connection: close` and the connection ends."""
    url = await start_server(nursery, make_settings(tiny_gguf, max_body_bytes=BODY_LIMIT))
    async with await RawClient.connect(url) as client:
        await client.send_head("POST", "/v1/chat/completions", JSON, body_length=1 << 20)
        reply = await client.reply()
        assert reply.status == 413 and reply.headers.get("connection") == "close", reply
        await closed_by_server(client.stream, within=3.0)


async def test_connection_close_is_honoured(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf))
    async with await RawClient.connect(url) as client:
        reply = await client.request("GET", "/health", headers={"Connection": "close"})
        assert reply.status == 200 and reply.headers.get("connection") == "close", reply
        await closed_by_server(client.stream, within=2.0)
    async with await RawClient.connect(url) as client:  # also after a POST whose body was read
        reply = await client.request("POST", "/v1/chat/completions", json.loads(chat(max_tokens=2)), headers={"Connection": "close"})
        assert reply.status == 200, reply
        await closed_by_server(client.stream, within=2.0)


async def test_http_1_0_without_keep_alive_closes(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf))
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(b"GET /health HTTP/1.0\r\nHost: test\r\n\r\n")
        received = await closed_by_server(stream, within=2.0)
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(b'{"status": "ok"}'), received


async def test_bytes_after_a_closing_request_are_dropped_not_a_400(nursery, tiny_gguf):
    """A closing request (HTTP/1.0, or `Connection: close`) followed by more
    bytes, in the same write or a later one, is answered as if they were not
    there, and the connection then closes (h11 calls them a protocol error;
    hypercorn answered that with an empty 400 in place of the response)."""
    url = await start_server(nursery, make_settings(tiny_gguf))
    host, port = url.removeprefix("http://").split(":")
    body = chat(max_tokens=3, ignore_eos=True)
    post = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    cases = [
        ("1.0 + CRLF, one write", [b"GET /health HTTP/1.0\r\nHost: test\r\n\r\n\r\n"]),
        ("1.0 + a second request", [b"GET /health HTTP/1.0\r\n\r\nGET /nope HTTP/1.0\r\n\r\n"]),
        ("close + CRLF, one write", [post + b"\r\n"]),
        ("close, then junk while it runs", [post, b"\r\n", b"garbage that is no request\r\n" * 100]),
    ]
    for name, writes in cases:
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(writes[0])
            for data in writes[1:]:
                await trio.sleep(0.02)
                try:
                    await stream.send_all(data)
                except trio.BrokenResourceError:
                    break  # answered and closed already: the rest is not wanted
            received = await closed_by_server(stream, within=30.0)
        head, _, answer = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), (name, received)
        assert received.count(b"HTTP/1.1") == 1, (name, received)
        if name.startswith("1.0"):
            assert json.loads(answer) == {"status": "ok"}, name
        else:
            assert json.loads(answer)["usage"]["completion_tokens"] == 3, name


async def test_idle_connections_are_closed_after_the_keep_alive_timeout(nursery, tiny_gguf):
    settings = attrs.evolve(make_settings(tiny_gguf), keep_alive_timeout_s=0.5)
    url = await start_server(nursery, settings)
    clients = [await RawClient.connect(url) for _ in range(10)]
    try:
        for client in clients:
            for _ in range(2):  # kept alive between requests in quick succession
                assert (await client.request("GET", "/health")).status == 200
        start = trio.current_time()
        for client in clients:
            await closed_by_server(client.stream, within=3.0)
        assert trio.current_time() - start >= 0.4, "closed before the keep-alive timeout"
        # A head that never completes on a used connection is cut by the same timer.
        async with await RawClient.connect(url) as client:
            assert (await client.request("GET", "/health")).status == 200
            await client.stream.send_all(b"GET /health HTTP/1.1\r\nHo")
            await closed_by_server(client.stream, within=3.0)
    finally:
        for client in clients:
            await client.aclose()


async def test_a_body_that_stops_arriving_is_closed_after_the_read_timeout(nursery, tiny_gguf):
    settings = attrs.evolve(make_settings(tiny_gguf), keep_alive_timeout_s=30.0, read_timeout_s=0.5)
    url = await start_server(nursery, settings)
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as observer:
        async with await RawClient.connect(url) as client:
            assert (await client.request("GET", "/health")).status == 200
            body = chat()
            await client.send_head("POST", "/v1/chat/completions", JSON, body_length=len(body))
            await client.send_body(body[:10], end=False)  # ...and nothing more
            start = trio.current_time()
            await closed_by_server(client.stream, within=3.0)
            assert trio.current_time() - start >= 0.4, "closed before the read timeout"
        m = await metrics(observer)
        assert m["running"] == 0 and m["waiting"] == 0, m


async def test_a_stream_that_is_read_is_not_cut_by_the_read_timeout(nursery, tiny_gguf, slow_steps):
    """The read timeout covers a request still arriving, not the silence of
    a client that is reading a long response."""
    slow_steps(0.01)  # 100 tokens take over a second, longer than the read timeout
    settings = attrs.evolve(make_settings(tiny_gguf), read_timeout_s=0.3, keep_alive_timeout_s=0.3)
    url = await start_server(nursery, settings)
    async with await RawClient.connect(url) as client:
        reply = await client.request("POST", "/v1/chat/completions", json.loads(chat(max_tokens=100, ignore_eos=True, stream=True)))
        assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n"), reply.body[-200:]


# -- the drain ---------------------------------------------------------------------------------------


async def test_drain_ends_within_its_timeout_while_a_client_never_reads(tiny_gguf, slow_steps):
    """SIGTERM's drain (triggered here by an event instead of a signal) with
    one stream whose client never reads: the drain timeout passes, the
    stuck stream is cut, and serve_app returns soon after, even though the
    write timeout is far away."""
    slow_steps(0.02)  # 220 tokens take over 4 s: still running when the drain gives up
    drain_s = 1.0
    settings = attrs.evolve(
        make_settings(tiny_gguf), drain_timeout_s=drain_s, write_timeout_s=60.0, send_buffer_bytes=4096
    )
    shutdown = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as outer:
            done = trio.Event()

            async def server(task_status=trio.TASK_STATUS_IGNORED):
                try:
                    await serve_app(settings, shutdown_trigger=shutdown.wait, task_status=task_status)
                finally:
                    done.set()

            urls = await outer.start(server)
            url = next(u for u in urls if u.startswith("http://127.0.0.1:"))
            await wait_healthy(url)
            stuck = await RawClient.connect(url, receive_buffer=4096)
            async with stuck:  # closed on the way out, so a failure here cannot hang the test
                body = chat("Tell me everything", max_tokens=220, ignore_eos=True, stream=True, logprobs=True, top_logprobs=5)
                await stuck.send_head("POST", "/v1/chat/completions", JSON, body_length=len(body))
                await stuck.send_body(body)
                async with httpx.AsyncClient(base_url=url, timeout=5.0) as observer:

                    async def running():
                        m = await metrics(observer)
                        return None if m["running"] == 1 and m["generated_tokens"] >= 40 else f"running {m['running']}, {m['generated_tokens']} tokens"

                    await eventually(running, timeout=30.0, what="the unread stream generating")
                start = trio.current_time()
                shutdown.set()
                with trio.fail_after(drain_s + 3.0):
                    await done.wait()
                assert trio.current_time() - start >= drain_s * 0.9, "the drain did not wait for the stream"
                received = await closed_by_server(stuck.stream, within=2.0)
                assert b"[DONE]" not in received


# -- the settings --------------------------------------------------------------------------------------


def test_transport_options_reach_the_settings(monkeypatch):
    seen = []
    monkeypatch.setattr(serve, "run_server", lambda settings: seen.append(settings) or 0)
    args = ["serve", "--keep-alive-timeout", "2.5", "--read-timeout", "7", "--write-timeout", "3", "--send-buffer-bytes", "16KiB"]
    assert cli.main(args) == 0
    s = seen[-1]
    assert (s.keep_alive_timeout_s, s.read_timeout_s, s.write_timeout_s, s.send_buffer_bytes) == (2.5, 7.0, 3.0, 16384)
    assert cli.main(["serve", "--send-buffer-bytes", "auto"]) == 0 and seen[-1].send_buffer_bytes is None
    defaults = seen[-1]
    assert (defaults.keep_alive_timeout_s, defaults.read_timeout_s) == (5.0, 30.0)
    env = settings_from_env({"TRIOSERVE_KEEP_ALIVE_TIMEOUT": "1.5", "TRIOSERVE_READ_TIMEOUT": "4", "TRIOSERVE_SEND_BUFFER_BYTES": "auto"})
    assert (env.keep_alive_timeout_s, env.read_timeout_s, env.send_buffer_bytes) == (1.5, 4.0, None)
    assert settings_from_env({}).send_buffer_bytes == 64 * 1024


@pytest.mark.parametrize(("args", "message"), [(["--read-timeout", "0"], "argument --read-timeout: must be between"), (["--send-buffer-bytes", "big"], "argument --send-buffer-bytes: must be a size like")])
def test_bad_transport_options_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
