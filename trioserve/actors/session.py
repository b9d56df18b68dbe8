"""The session actor: one trio task per session with a turn under way. It
owns that turn from the moment the session is pinned until it is settled:
the turn's generation runs in the actor's nursery, and the actor alone
commits it or cancels it, exactly once.

    handler ──RunTurn(prepare, outcome, stream)──► SessionActor ──► engine
       ▲               Pull (one per chunk)            │
       └──── Answer | Opened, Chunk... | Failed ◄──────┘
                        (TurnLine)

`SessionActors.begin` pins the session in the store (a second turn is a
409 at once, never queued), opens the actor's inbox and its reply channel
and starts the actor in the nursery the app owns; the handler holds the
only other ends, as a `TurnLine`. The handler sends one `RunTurn`; a
buffered turn's whole answer comes back as one reply; a streamed turn
answers `Opened`, then one `Chunk` per `Pull`, so the body advances only as
fast as the client takes it, as a body generator in the handler would. The
handler leaves by hanging up its line (`TurnLine.hang_up`), which the actor
sees at once.

Commit point: the job calls ``on_final`` right before its final response is
made (the JSON body, or the last SSE chunk, made only once the client asked
for it); the actor commits there if the handler is still attached. Every
other ending (a refusal, an error, the handler closing its ends or going
quiet past ``pull_timeout_s``, the app stopping) cancels the turn: the
actor's nursery scope is cancelled, which closes the engine generation,
and the lease is let go in the actor's own task, once. A commit and a
cancel can meet only inside this actor (its listener and its turn share one
nursery, and both settle synchronously): whichever comes first ends the
lease, and the other finds it ended (the store's `TurnLease` check stays as
a second line of defence).

No HTTP here (the layers forbid it): answers and chunks are opaque to the
actor; the handler's ``prepare`` builds the job that makes them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Protocol

import attrs
import trio

from trioserve.actors.messages import deliver
from trioserve.errors import EngineClosed
from trioserve.state.session import Session, Turn, TurnLease
from trioserve.state.session_store import SessionStore


class Engine(Protocol):
    """What a session actor needs of the engine (trioserve.engine.Engine,
    a layer above the actors): to settle the KV a turn retained."""

    def settle_retained(self, owner: str, request_id: str, *, commit: bool) -> None: ...


class TurnJob(Protocol):
    """One turn's generation, as the HTTP layer builds it (its Connection,
    made with the ``on_final`` the actor gives ``prepare``: called with the
    final choice right before the final response is made)."""

    @property
    def request_id(self) -> str:
        """The engine request whose KV is kept for the session."""
        ...

    async def collect(self) -> object:
        """The whole answer (a JSON body, or an error response)."""
        ...

    async def open_stream(self) -> AsyncGenerator[bytes, None]:
        """Submit; raise the refusal, or give the stream's chunks."""
        ...


# -- the session actor's inbox ------------------------------------------------
@attrs.frozen
class RunTurn:
    """Run the pinned session's turn; what it produces goes back on the line."""

    prepare: Callable[[Session, Callable[[Any], Awaitable[None]]], Awaitable[TurnJob]]  # the generation, from the pinned session and the commit hook
    outcome: Callable[[Any], Turn]  # what the turn adds, from its final choice
    stream: bool


@attrs.frozen
class Pull:
    """The handler handed the last chunk on and wants the next."""


SessionMessage = RunTurn | Pull


# -- what the actor answers, on the line's reply channel ----------------------
@attrs.frozen
class Answer:
    """The whole response of a buffered turn (or the job's own error response)."""

    response: object


@attrs.frozen
class Opened:
    """The stream was accepted: its chunks follow, one per Pull; the channel
    closes after the last."""


@attrs.frozen
class Chunk:
    data: bytes


@attrs.frozen
class Failed:
    """The turn ended with ``error`` (a refusal, or a failure)."""

    error: Exception


TurnOutput = Answer | Opened | Chunk | Failed


class TurnLine:
    """The handler's ends of one turn: the actor's inbox (bound 1: one
    RunTurn, then one Pull at a time) and the replies (bound 1: one output
    per RunTurn or Pull). The actor holds the other ends and this same
    line: `hang_up` is how it learns, at once, that the handler left."""

    def __init__(self, inbox: trio.MemorySendChannel[SessionMessage], replies: trio.MemoryReceiveChannel[TurnOutput]) -> None:
        self.inbox = inbox
        self.replies = replies
        self.attached = True

    def hang_up(self) -> None:
        """The handler is done (the client left, or took the whole
        response): close its ends. Synchronous, idempotent, never raises."""
        self.attached = False
        self.inbox.close()
        self.replies.close()


class SessionActor:
    """One turn of one session, from its pin to its settlement."""

    def __init__(self, lease: TurnLease, store: SessionStore, engine: Engine, pull_timeout_s: float, line: TurnLine) -> None:
        self.lease = lease
        self.line = line  # the handler's side: whether it is still there
        self.store = store
        self.engine = engine
        self.pull_timeout_s = pull_timeout_s  # the longest the actor waits for the handler to ask
        self.request_id: str | None = None  # the turn's engine request, once the job is built
        self._pulls = 0  # Pulls received and not yet answered
        self._pulled = trio.Event()

    @property
    def session(self) -> Session:
        return self.lease.session

    async def run(self, inbox: trio.MemoryReceiveChannel[SessionMessage], replies: trio.MemorySendChannel[TurnOutput]) -> None:
        """Serve one RunTurn, listening to ``inbox`` all along: when the
        handler closes its end, the turn is cancelled at once."""
        try:
            async with inbox, replies:
                order = None
                with trio.move_on_after(self.pull_timeout_s):
                    with contextlib.suppress(trio.EndOfChannel):
                        order = await inbox.receive()
                if not isinstance(order, RunTurn):
                    return  # the handler left (or never asked): nothing ran
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._turn, order, replies, nursery.cancel_scope)
                    await self._listen(inbox)
                    nursery.cancel_scope.cancel()  # the handler is gone: end the turn (closing its generation)
        finally:
            self._settle()  # unless the turn committed; runs once its generation is closed

    async def _listen(self, inbox: trio.MemoryReceiveChannel[SessionMessage]) -> None:
        """Count the handler's Pulls; return when its end closes (it left,
        or took the whole response) or when it breaks the protocol."""
        async for message in inbox:
            if not isinstance(message, Pull):
                return  # a second RunTurn: one actor runs one turn
            self._pulls += 1
            self._pulled.set()

    async def _turn(self, order: RunTurn, replies: trio.MemorySendChannel[TurnOutput], done: trio.CancelScope) -> None:
        try:
            await self._produce(order, replies)
        except Exception as exc:  # noqa: BLE001 - a failure of this turn only; the handler reports it
            self._settle()
            deliver(replies, Failed(exc))
        finally:
            done.cancel()  # the turn is over: stop listening

    async def _produce(self, order: RunTurn, replies: trio.MemorySendChannel[TurnOutput]) -> None:
        try:
            job = await order.prepare(self.session, lambda choice: self._commit(order, choice))
        except Exception as exc:  # noqa: BLE001 - a bad request: nothing was submitted
            self._settle()
            deliver(replies, Failed(exc))
            return
        self.request_id = job.request_id
        if not order.stream:
            answer = await job.collect()
            self._settle()  # after a commit, nothing; otherwise the turn failed (its answer says why)
            deliver(replies, Answer(answer))
            return
        try:
            body = await job.open_stream()
        except Exception as exc:  # noqa: BLE001 - refused (queue full, too long): an ordinary error response
            self._settle()
            deliver(replies, Failed(exc))
            return
        async with aclosing(body):
            # Start the body now (its first chunk is the role chunk, which
            # commits nothing): only a started generator's close closes its
            # engine request.
            pending: bytes | None = await anext(body)
            if not deliver(replies, Opened()):
                return
            while True:
                if not await self._wait_pull():
                    return  # the handler went quiet: cancelled on the way out
                if pending is None:
                    try:
                        pending = await anext(body)  # the final chunk commits first (on_final)
                    except StopAsyncIteration:
                        break
                if not deliver(replies, Chunk(pending)):
                    return  # the handler is gone: cancelled on the way out
                pending = None
        self._settle()  # the stream ended without committing (it failed): cancel before the end shows
        replies.close()

    async def _wait_pull(self) -> bool:
        """Take one Pull; False when none came within ``pull_timeout_s``."""
        with trio.move_on_after(self.pull_timeout_s):
            while self._pulls == 0:
                self._pulled = trio.Event()
                await self._pulled.wait()
            self._pulls -= 1
            return True
        return False

    async def _commit(self, order: RunTurn, choice: Any) -> None:
        """The final response is being made: the turn becomes history (on
        disk first, with a state store), and its KV the session's. Not if the
        handler left first: then the turn is cancelled on the way out, as if
        the client left a moment earlier."""
        if not self.line.attached:
            return
        pending = self.store.prepare_commit(self.lease, order.outcome(choice))  # StaleTurn if it ended already
        await durably(self.store.write, pending, self.store.journal is not None)
        self.store.apply(pending, trio.current_time())
        self.engine.settle_retained(self.session.id, self.request_id, commit=True)

    def _settle(self) -> None:
        """Cancel the turn unless it committed: nothing changes, and the KV
        held for it is let go. Only the first call does anything."""
        if self.store.cancel(self.lease, trio.current_time()) and self.request_id is not None:
            self.engine.settle_retained(self.session.id, self.request_id, commit=False)


async def durably(write: Callable[[Any], None], item: Any, threaded: bool) -> None:
    """``write(item)``: in a thread when ``threaded`` (a state store's
    fsync, off the event loop), and once begun it runs to its end whatever
    is cancelled meanwhile (the commit may be on disk already, so what
    follows it must happen too: the caller's next lines have no checkpoint)."""
    if not threaded:
        write(item)
        return
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(write, item)


async def synced(store: SessionStore, session_id: str) -> None:
    """With a store shared by replicas (PostgreSQL), bring ``session_id``
    up to date from it before it is used here: made, continued or deleted
    by another replica since this one last looked. Nothing otherwise. The
    read runs in a thread; StateError when the store cannot be read."""
    if not store.shared:
        return
    row = await trio.to_thread.run_sync(store.journal.fetch, session_id)
    store.refresh(session_id, row, trio.current_time())


class SessionActors:
    """Starts one SessionActor per turn, in a nursery the app owns."""

    def __init__(self, nursery: trio.Nursery, store: SessionStore, *, pull_timeout_s: float) -> None:
        self._nursery = nursery
        self.store = store
        self.pull_timeout_s = pull_timeout_s
        self.closed = False

    def begin(self, session_id: str, now: float, engine: Engine, *, owner: str | None = None) -> TurnLine:
        """Pin ``session_id`` for a turn on ``engine`` (its model's) and
        start its actor; the handler's line to it. Raises SessionNotFound, SessionBusy (at once, never
        queued), or EngineClosed once the app is stopping."""
        if self.closed:
            raise EngineClosed("the server is shutting down")
        lease = self.store.begin(session_id, now, owner=owner)
        send, inbox = trio.open_memory_channel[SessionMessage](1)
        replies_send, replies = trio.open_memory_channel[TurnOutput](1)
        line = TurnLine(send, replies)
        actor = SessionActor(lease, self.store, engine, self.pull_timeout_s, line)
        try:
            self._nursery.start_soon(actor.run, inbox, replies_send, name=f"session {session_id}")
        except RuntimeError:  # the nursery is closed: the app is stopping
            self.store.cancel(lease, now)
            raise EngineClosed("the server is shutting down") from None
        return line


@contextlib.asynccontextmanager
async def open_session_actors(store: SessionStore, *, pull_timeout_s: float) -> AsyncIterator[SessionActors]:
    """Session actors for ``store``'s sessions. Leaving the
    block ends every running turn as a disconnect would: cancelled, nothing
    committed."""
    async with trio.open_nursery() as nursery:
        actors = SessionActors(nursery, store, pull_timeout_s=pull_timeout_s)
        try:
            yield actors
        finally:
            actors.closed = True
            nursery.cancel_scope.cancel()
