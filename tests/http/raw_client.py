"""An HTTP/1.1 client on a bare TCP connection, for the transport tests.

No client library sits between the test and the socket, so the test decides
what goes out in which write (a request's head and body separately, a body
cut short), may stop reading, and sees exactly when the server closes. h11
keeps the client side of the protocol honest; every wait has a deadline."""

from __future__ import annotations

import json
import socket

import attrs
import h11
import trio

WAIT = 5.0  # seconds any single exchange may take before the test fails


@attrs.define
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


class RawClient:
    """One client connection. ``send_head`` / ``send_body`` put a request on
    the wire in separate writes; ``reply`` reads one whole response."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, url: str, *, receive_buffer: int | None = None) -> RawClient:
        host, port = url.removeprefix("http://").split(":")
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        if receive_buffer is not None:  # before connect, so the window is small from the start
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        with trio.fail_after(WAIT):
            await sock.connect((host, int(port)))
        return cls(trio.SocketStream(sock))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def send_head(self, method: str, path: str, headers: dict[str, str] | None = None, *, body_length: int | None = None) -> None:
        fields = [("Host", "test")]
        if body_length is not None:
            fields.append(("Content-Length", str(body_length)))
        fields += list((headers or {}).items())
        await self._send(h11.Request(method=method, target=path, headers=fields))

    async def send_body(self, data: bytes, *, end: bool = True) -> None:
        if data:
            await self._send(h11.Data(data=data))
        if end:
            await self._send(h11.EndOfMessage())
            self._next_cycle()

    async def request(self, method: str, path: str, body: object = None, headers: dict[str, str] | None = None) -> Reply:
        """A whole request in one go (head and JSON body), and its reply."""
        data = b"" if body is None else json.dumps(body).encode()
        fields = {"Content-Type": "application/json", **(headers or {})} if body is not None else dict(headers or {})
        await self.send_head(method, path, fields, body_length=len(data) if body is not None else None)
        await self.send_body(data)
        return await self.reply()

    async def _send(self, event) -> None:
        data = self.h11.send(event)
        if data:
            with trio.fail_after(WAIT):
                await self.stream.send_all(data)

    async def reply(self, *, timeout: float = WAIT) -> Reply:
        """Read one response (it may come before the request's body was sent)."""
        head = None
        body = bytearray()
        with trio.fail_after(timeout):
            while True:
                event = self.h11.next_event()
                if event is h11.NEED_DATA:
                    self.h11.receive_data(await self.stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    head = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise AssertionError("the server closed the connection instead of answering")
        self._next_cycle()
        headers = {k.decode().lower(): v.decode() for k, v in head.headers}
        return Reply(head.status_code, headers, bytes(body))

    def _next_cycle(self) -> None:
        """Both sides done and the connection kept: ready for the next request."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()

    @property
    def server_keeps_alive(self) -> bool:
        return self.h11.their_state is not h11.MUST_CLOSE


async def closed_by_server(stream: trio.SocketStream, *, within: float) -> bytes:
    """Read (and return) whatever still comes until the server closes the
    connection; fail if it is still open after ``within`` seconds."""
    received = bytearray()
    with trio.fail_after(within):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:  # a reset: closed as well
                return bytes(received)
            if not data:
                return bytes(received)
            received += data
