"""The write deadline, where the socket write happens (the transport): a
client that keeps its connection open but stops reading gets the connection
closed once a write has stalled for --write-timeout, which cancels its
request in the engine and frees its KV blocks, long before max_tokens; a
slow client that keeps reading is not cut. Against a real server on
127.0.0.1, with small socket buffers so that writes stall after a few KiB."""

from __future__ import annotations

import json

import attrs
import httpx
import trio

from tests.http.conftest import MODEL_NAME, eventually, make_settings, metrics, start_server
from tests.http.raw_client import RawClient, closed_by_server

JSON = {"Content-Type": "application/json"}


def stream_body(max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Tell me everything"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 5,  # ~1 KiB a chunk: the buffers fill within a few dozen tokens
        }
    ).encode()


async def test_a_client_that_never_reads_is_cut_and_its_request_cancelled(nursery, tiny_gguf, slow_steps):
    slow_steps(0.02)  # 220 tokens take over 4 s; the stall is noticed well before
    settings = attrs.evolve(make_settings(tiny_gguf), write_timeout_s=0.5, send_buffer_bytes=4096)
    url = await start_server(nursery, settings)
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as observer:
        before = await metrics(observer)
        async with await RawClient.connect(url, receive_buffer=4096) as client:
            body = stream_body(220)
            await client.send_head("POST", "/v1/chat/completions", JSON, body_length=len(body))
            await client.send_body(body)
            start = trio.current_time()

            async def cancelled():
                m = await metrics(observer)
                if m["finished"].get("cancelled", 0) == before["finished"].get("cancelled", 0) + 1 and m["running"] == 0 and m["kv_blocks_used"] == 0:
                    return None
                return f"finished {m['finished']}, running {m['running']}, kv_blocks_used {m['kv_blocks_used']}"

            await eventually(cancelled, timeout=30.0, what="the unread stream cancelled and its KV freed")
            elapsed = trio.current_time() - start
            received = await closed_by_server(client.stream, within=2.0)
        after = await metrics(observer)
    assert after["finished"].get("length", 0) == before["finished"].get("length", 0), "the stream ran to max_tokens"
    assert after["generated_tokens"] - before["generated_tokens"] < 200, after
    assert elapsed >= 0.5, f"cut after {elapsed:.2f} s, before the write timeout"
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received


async def test_a_slow_reader_within_the_deadline_gets_everything(nursery, tiny_gguf):
    settings = attrs.evolve(make_settings(tiny_gguf), write_timeout_s=1.0, send_buffer_bytes=4096)
    url = await start_server(nursery, settings)
    async with await RawClient.connect(url, receive_buffer=4096) as client:
        body = stream_body(60)
        await client.send_head("POST", "/v1/chat/completions", JSON, body_length=len(body))
        await client.send_body(body)
        received = bytearray()
        with trio.fail_after(20):
            while not received.endswith(b"0\r\n\r\n"):  # the chunked body's end
                await trio.sleep(0.05)  # a slow reader: each pause is well under the deadline
                data = await client.stream.receive_some(2048)
                assert data, f"the server closed a stream that was being read: {bytes(received[-300:])!r}"
                received += data
    assert b"data: [DONE]" in received
