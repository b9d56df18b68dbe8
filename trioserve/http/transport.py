"""The HTTP transport: hypercorn's trio server with the connection handling
adapted so that neither a careless client nor the app's own cancellation can
leave a connection stuck, and so that every wait on a client has a deadline.

What is adapted, and why (hypercorn 0.18, quart-trio 0.12; see
docs/architecture.md, "The HTTP transport layer"):

- Recycling runs shielded. hypercorn finishes a response inside the app's
  last ``send()``: ``H11Protocol.stream_send(StreamClosed)`` runs
  ``_maybe_recycle``, which first tells the app ``http.disconnect`` and then
  resets h11 and re-arms the keep-alive timer (or closes the connection).
  On that disconnect quart-trio (``TrioASGIHTTPConnection.handle_messages``)
  cancels the request's nursery, which the send still runs in, so the rest
  of the step is cancelled half-way: the connection then never answers
  again, is never closed by the idle timer, and ``Connection: close`` or
  HTTP/1.0 are not honoured. Here the step runs in a shielded scope
  (bounded by the write timeout; past it the connection is aborted).
- An early response (401, 404, 405, 413, 415 answered from the request's
  head alone) leaves the body still to come. Instead of closing, the rest
  of the body is read and dropped, then the connection is recycled, if the
  body declared a length of at most ``SKIP_LIMIT`` bytes; otherwise the
  response says ``Connection: close``.
- Writes have a deadline. hypercorn's ``TCPServer.protocol_send`` runs
  ``send_all`` under a shield, so nothing interrupts a write to a client
  that stopped reading, not the app's deadline nor the server's shutdown.
  Here each write may take at most the write timeout and may be
  cancelled; a write that did not finish leaves a response half sent, so
  the connection is aborted at once. The app then gets ``http.disconnect``
  and unwinds as on a client disconnect (quart-trio cancels the handler,
  which cancels the engine request and frees its KV).
- Reads have a deadline while a request is arriving. hypercorn's
  ``read_timeout`` bounds every read, including the silence of a client
  reading a long stream; here the read timeout applies only while a
  request body is due (a head is bounded by the keep-alive timer, which
  runs until a whole head has arrived).
- Bytes after a closing request are dropped. An HTTP/1.0 request or one
  with ``Connection: close`` ends the connection after its response; h11
  treats any byte after it (a stray CRLF) as a protocol error, and
  hypercorn then answers 400 instead of the response and never runs the
  handler, or runs it and loses its answer. Here the request is answered
  and what follows it is discarded (``_Closing``, ``_H11.handle``).
- ``serve_http`` is ``hypercorn.trio.run.worker_serve`` for plain TCP with
  this connection class (worker_serve names its own), and sets each
  connection's kernel send buffer.

HTTP/2 (prior knowledge only; there is no TLS here) keeps hypercorn's own
protocol and gets the write deadline."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import socket
from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import h11
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import EndBody, Response, StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr, repr_socket_addr, wrap_app

# The most request body read and dropped after an early response so that the
# connection can carry the next request (Go's net/http reads 256 KiB too).
SKIP_LIMIT = 256 * 1024


@attrs.frozen
class TransportLimits:
    """Deadlines on the client, in seconds, and the per-connection kernel
    send buffer in bytes (None: the kernel's autotuning). The keep-alive
    timeout is hypercorn's ``Config.keep_alive_timeout``."""

    write_timeout_s: float
    read_timeout_s: float
    send_buffer_bytes: int | None = None


def _declared_length(request: h11.Request) -> int | None:
    """The request body's Content-Length; None when chunked (unknown)."""
    for name, value in request.headers:
        if name == b"transfer-encoding":
            return None
    for name, value in request.headers:
        if name == b"content-length":
            return int(value)  # h11 has checked it is one well-formed number
    return 0


class _SkipBody:
    """Stands in for a finished request's stream while the rest of its body
    arrives after an early response: drops the body, then recycles."""

    def __init__(self, protocol: _H11) -> None:
        self.protocol = protocol

    async def handle(self, event) -> None:
        if isinstance(event, EndBody):
            await self.protocol._maybe_recycle()
        # Body: dropped. StreamClosed: nothing was started, nothing to end.


class _Closing(h11.Connection):
    """h11's server connection, except that once a closing request (HTTP/1.0,
    or ``Connection: close``) has arrived whole, whatever follows it is
    left unread instead of being an error: h11 raises on any byte there,
    and hypercorn answers that with a 400 in place of the response still
    being made (a trailing CRLF after the request was enough)."""

    def next_event(self):
        if self.their_state is h11.MUST_CLOSE:
            return h11.NEED_DATA  # the connection ends after our response
        return super().next_event()


class _H11(H11Protocol):
    """hypercorn's HTTP/1.1 protocol with its recycling step shielded from
    the app's cancellation, early responses' bodies skipped, and bytes
    after a closing request dropped."""

    def __init__(self, *args, write_timeout_s: float, abort: Callable[[], None]) -> None:
        super().__init__(*args)
        self.connection = _Closing(h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size)
        self.write_timeout_s = write_timeout_s
        self.abort = abort
        self.body_length: int | None = 0

    async def handle(self, event) -> None:
        if isinstance(event, RawData) and isinstance(self.connection, h11.Connection) and self.connection.their_state is h11.MUST_CLOSE:
            return  # after a closing request: dropped, not buffered (at most one read came with the request)
        await super().handle(event)

    async def _create_stream(self, request: h11.Request) -> None:
        self.body_length = _declared_length(request)
        await super()._create_stream(request)

    async def stream_send(self, event) -> None:
        if isinstance(event, StreamClosed):
            # Runs in the app's task, which quart-trio cancels as soon as this
            # step delivers http.disconnect: finish the step regardless.
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + self.write_timeout_s
                await super().stream_send(event)
            if scope.cancelled_caught:
                self.abort()  # the connection's state is unknown: end it
            return
        if isinstance(event, Response) and event.status_code >= 200 and self._body_left_unread():
            length = self.body_length
            if length is None or length > SKIP_LIMIT:
                event = dataclasses.replace(event, headers=[*event.headers, (b"connection", b"close")])
        await super().stream_send(event)

    def _body_left_unread(self) -> bool:
        return isinstance(self.connection, h11.Connection) and self.connection.their_state is h11.SEND_BODY

    async def _maybe_recycle(self) -> None:
        await self._close_stream()
        # No checkpoint from here until the stand-in is in place, so no part
        # of the body can slip past it.
        if (
            not self.context.terminated.is_set()
            and isinstance(self.connection, h11.Connection)
            and self.connection.our_state is h11.DONE
            and self.connection.their_state is h11.SEND_BODY
        ):
            self.stream = _SkipBody(self)
            return
        await super()._maybe_recycle()  # hypercorn's step; the stream is closed already


class TCPConnection(TCPServer):
    """One client connection: hypercorn's TCPServer with deadlines on
    writes (the write timeout, or the server's shutdown, interrupts a
    write and aborts the connection) and on reads while a request body is
    due, and with the shielded recycling of ``_H11``."""

    def __init__(self, app, config: Config, context: WorkerContext, state: ConnectionState, limits: TransportLimits, stream: trio.SocketStream) -> None:
        super().__init__(app, config, context, state, stream)
        self.limits = limits

    async def run(self) -> None:
        sock = self.stream.socket
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
            async with TaskGroup() as task_group:
                self._task_group = task_group
                args = (self.app, self.config, self.context, task_group, ConnectionState(self.state), False, client, server, self.protocol_send)
                self.protocol = ProtocolWrapper(*args, "http/1.1")
                # ProtocolWrapper builds hypercorn's H11Protocol by name; put ours in its place.
                self.protocol.protocol = _H11(*args, write_timeout_s=self.limits.write_timeout_s, abort=self.abort)
                await self.protocol.initiate()
                await self.idle_task.restart(task_group, self._idle_timeout)
                await self._read_data()
        except OSError:
            pass
        finally:
            await self._close()

    def abort(self) -> None:
        """Close the socket now, without a checkpoint: every task blocked on
        it wakes with ClosedResourceError (the reader then ends the
        connection and the app gets http.disconnect)."""
        self.stream.socket.close()

    async def protocol_send(self, event) -> None:
        """Carry out the protocol's events. A write gets the write timeout
        and, unlike hypercorn's, may be cancelled; a write that did not
        finish (timed out, failed, cancelled) aborts the connection, and the
        protocol learns it is closed (its app gets http.disconnect)."""
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        async with self.send_lock:
            written = False
            try:
                with trio.move_on_after(self.limits.write_timeout_s), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.stream.send_all(event.data)
                    written = True
            finally:
                if not written:  # timed out, failed or cancelled part-way: the response cannot go on
                    self.abort()
        if not written:
            await self.protocol.handle(Closed())

    async def _read_data(self) -> None:
        """Feed the protocol what the client sends until it closes; while a
        request body is due, a silence longer than the read timeout ends
        the connection."""
        while True:
            timeout = self.limits.read_timeout_s if self._body_due() else math.inf
            try:
                with trio.fail_after(timeout):
                    data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            await self.protocol.handle(RawData(bytes(data)))
            if data == b"":
                break
        await self.protocol.handle(Closed())

    def _body_due(self) -> bool:
        protocol = self.protocol.protocol
        return isinstance(protocol, _H11) and protocol._body_left_unread()

    async def _close(self) -> None:
        """hypercorn's close (EOF, then close), shielded so that a cancelled
        connection still releases its socket, and never beside a write."""
        with trio.CancelScope(shield=True):
            # While a write is under way there is no orderly EOF: just close.
            if not self.send_lock.locked():
                async with self.send_lock:  # free, so taken at once
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                        await self.stream.send_eof()
            await self.stream.aclose()


async def serve_http(
    app,
    config: Config,
    limits: TransportLimits,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an ASGI ``app`` on ``config.bind`` (plain TCP) until
    ``shutdown_trigger`` returns, then stop accepting, close idle
    connections, give busy ones ``config.graceful_timeout`` seconds, and
    run the app's shutdown. Reports the bound URLs through ``task_status``.
    Cancelled: every connection is cut (writes included) and the app's
    lifespan task is cancelled."""
    config.set_statsd_logger_class(StatsdLogger)
    app = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict = {}
    lifespan = Lifespan(app, config, lifespan_state)
    context = WorkerContext(None)

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()

        async with trio.open_nursery() as connections:
            listeners = []
            binds = []
            for sock in config.create_sockets().insecure_sockets:
                if limits.send_buffer_bytes is not None:  # accepted sockets inherit it
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                bind = repr_socket_addr(sock.family, sock.getsockname())
                binds.append(f"http://{bind}")
                await config.log.info(f"Running on http://{bind} (CTRL + C to quit)")
            task_status.started(binds)
            handler = partial(TCPConnection, app, config, context, ConnectionState(lifespan_state.copy()), limits)
            try:
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(partial(trio.serve_listeners, handler, listeners, handler_nursery=connections))
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
            finally:
                await context.terminated.set()  # idle keep-alive connections close now
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout

        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
