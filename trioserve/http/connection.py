"""The connection actor: one per HTTP request, living in that request's
handler task (a session turn's lives in its session actor's task instead:
trioserve/actors/session.py). It runs a `GenerationJob` (trioserve/http/job.py)
against the engine and hands what comes back to the job's renderer, which
makes one JSON body or a stream of SSE chunks in the job's shape:
`CompletionRender` (trioserve/http/completion_render.py) for chat, text and
session turns, `ResponseRender` (trioserve/http/responses.py) for responses.

Cancellation: when the client disconnects, hypercorn and quart-trio cancel
the handler (buffered) or close the body generator (streaming); either way
the generations are closed here (`aclosing`, or the body's ``finally``), and
the scheduler drops the requests within one step."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Protocol

import trio
from quart import Response

from trioserve.http import openai
from trioserve.http.completion_render import CompletionRender
from trioserve.http.errors import HTTPError, error_response
from trioserve.http.in_flight import at_request_end
from trioserve.http.job import GenerationJob
from trioserve.types import Event, FinalEvent


class Render(Protocol):
    """What a job's shape makes of its generations (`Connection` runs them)."""

    def seen(self, choice: openai.Choice, deltas: list) -> None:
        """A buffered choice's event was added: ``deltas`` is the output it made certain."""

    async def body(self, choices: list[openai.Choice]) -> Response:
        """The buffered response, once every choice ended well."""

    def refusal(self, exc: Exception) -> Response:
        """The error response for a request refused or failed before its response began."""

    def chunks(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The stream's chunks, given choice 0's accepted events (choices
        after the first are run with `Connection.generate`)."""


class Connection:
    """Runs one job's generations and answers with what its renderer makes
    (``render``: made with this connection).

    ``on_final`` is called with choice 0 right before its final response
    goes out (the JSON body, or the last SSE chunk): a session commits there."""

    def __init__(
        self,
        job: GenerationJob,
        engine,
        render: Callable[[Connection], Render] = CompletionRender,
        *,
        on_final: Callable[[openai.Choice], Awaitable[None]] | None = None,
    ) -> None:
        self.job = job
        self.engine = engine
        self.on_final = on_final
        self.render = render(self)  # the job's shape: what its generations become

    @property
    def request_id(self) -> str:
        return self.job.request_id

    def choice(self, index: int) -> openai.Choice:
        """A new choice ``index``, with its output parser when its shape has one."""
        return openai.Choice(index, self.job.parser(index))

    def generate(self, index: int) -> AsyncGenerator[Event, None]:
        """Choice ``index``'s events (close it to cancel the request)."""
        return self.engine.generate(self.job.request(index))

    def failure(self, final: FinalEvent) -> HTTPError:
        """The error a failed generation answers with: a 400 naming the field
        when the request's own constraint broke down, else 503 once the
        engine is dead, 500 before."""
        if final.error_field is not None:
            return HTTPError(400, final.error or "generation failed", param=final.error_field)
        return HTTPError(503 if self.engine.statistics().dead else 500, final.error or "generation failed", kind="server_error")

    async def final(self, choice: openai.Choice) -> None:
        """Choice ``choice``'s final response is about to be made (a
        session's turn commits here, durably, before it goes out)."""
        if self.on_final is not None and choice.index == 0:
            await self.on_final(choice)

    async def respond(self) -> Response:
        """One JSON body, or an SSE stream, as the job asks."""
        return await (self.stream() if self.job.stream else self.collect())

    async def _run_choice(self, choice: openai.Choice) -> None:
        async with aclosing(self.generate(choice.index)) as events:
            async for event in events:
                self.render.seen(choice, choice.add(event))

    async def finished_choices(self) -> list[openai.Choice] | Response:
        """Every choice run to its end; or the error response when one was
        refused or failed."""
        choices = [self.choice(i) for i in range(self.job.choices)]
        failure: list[Exception] = []
        try:
            async with trio.open_nursery() as nursery:
                for c in choices:
                    nursery.start_soon(self._run_choice, c)
        except* Exception as group:
            failure.append(group.exceptions[0])
        if failure:
            return self.render.refusal(failure[0])
        failed = [c for c in choices if c.final.finish_reason == "error"]
        if failed:
            return error_response(self.failure(failed[0].final))
        return choices

    async def collect(self) -> Response:
        """The buffered response: every choice run to its end, then one body."""
        choices = await self.finished_choices()
        if isinstance(choices, Response):
            return choices
        return await self.render.body(choices)

    async def stream(self) -> Response:
        # Submit the first choice now, so a refusal (queue full, too long) is
        # an ordinary error response rather than an error inside the stream;
        # once accepted, headers and the first chunks go out at once.
        try:
            body = await self.open_stream()
        except Exception as exc:  # noqa: BLE001 - a refusal is an ordinary error response
            return self.render.refusal(exc)
        return sse_response(body)

    async def open_stream(self) -> AsyncGenerator[bytes, None]:
        """Submit the first choice; raise its refusal, or give the stream's
        chunks (an async generator: closing it cancels what still runs)."""
        first = self.engine.open_generation(self.job.request(0))
        events = await first.submit()
        # A body that never starts (the client left while the head was
        # written) runs no cleanup of its own: when the request is over,
        # closing the generation tells the scheduler, which cancels the
        # request within a step. Harmless once the stream has ended.
        at_request_end(first.close)
        return self._body(first, events)

    async def _body(self, first, events) -> AsyncIterator[bytes]:
        """The renderer's chunks; the first generation is closed however the body ends."""
        try:
            async with aclosing(self.render.chunks(events)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            first.close()


def sse_response(body: AsyncIterator[bytes]) -> Response:
    """A streaming response of SSE chunks, with no overall deadline."""
    response = Response(body, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
    response.timeout = None
    return response
