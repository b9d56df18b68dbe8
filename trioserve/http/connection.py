"""The connection actor: one per HTTP request, living in that request's
handler task (a session turn's lives in its session actor's task instead:
trioserve/actors/session.py). It submits the request's generations to the
engine and turns their events into one JSON body or a stream of SSE chunks.

Cancellation: when the client disconnects, hypercorn and quart-trio cancel
the handler (buffered) or close the body generator (streaming); either way
the `aclosing` blocks here close the engine's event streams, and the
scheduler drops the requests within one step."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
import contextlib
from contextlib import aclosing

import attrs
import trio
from quart import Response

from trioserve.http import openai
from trioserve.http.errors import HTTPError, error_response, json_response, to_response
from trioserve.http.in_flight import at_request_end
from trioserve.models.output_parser import OutputParser
from trioserve.types import FinalEvent, GenerateRequest, fold_seed


def seed_for(params, index: int):
    """Choice ``index`` of n: seed + index, so every choice is reproducible."""
    if params.seed is None or index == 0:
        return params
    return attrs.evolve(params, seed=fold_seed(params.seed + index))


class Connection:
    """One HTTP request's generations and their rendering: n choices of one
    prompt, or, for a completions request with a list of prompts, n of each
    (``more_prompts``: the second prompt on, as (text, ids, params)). Choice
    i is choice i % n of prompt i // n, OpenAI's numbering."""

    def __init__(self, state, engine, kind, prompt_ids, params, n, logprobs, *, prompt_text: str, echo: bool, more_prompts=()):
        self.state = state
        self.engine = engine
        self.kind = kind  # "chat" or "text"
        self.prompt_ids = prompt_ids
        self.params = params
        self.prompts = [(prompt_text, prompt_ids, params), *more_prompts]
        self.per_prompt = n
        self.n = n * len(self.prompts)
        self.logprobs = logprobs
        self.prompt_text = prompt_text
        self.echo = echo
        self.draw_start = 0  # a session turn continues its random stream
        self.retain: str | None = None  # a session turn's KV is held for the session
        self.guides: list | None = None  # one output constraint per choice (guided decoding)
        # The role chunk's content: "" (text may follow), None when the reply
        # can only be tool calls (a forcing tool_choice), as OpenAI sends.
        self.role_content: str | None = ""
        # Tools offered under auto: the reply may be text or a call, so each
        # choice's role chunk waits for its first output (content "" before
        # text, None before a call, as OpenAI sends). A session turn's goes
        # at once (its actor opens the stream on the role chunk).
        self.calls_possible = False
        self._text_offsets: dict[int, int] = {}  # streamed completions: each choice's next token's text_offset
        self._role_pending: set[int] = set()  # chat choices whose role chunk waits for their first output
        # Makes each chat choice's output parser (tool calls, reasoning), or None.
        self.parser_factory: Callable[[int], OutputParser | None] | None = None
        # Called with choice 0 right before its final response goes out
        # (the JSON body, or the last SSE chunk): a session commits there.
        self.on_final: Callable[[openai.Choice], None] | None = None
        self.id = openai.new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.request_id = f"{self.id}-0"  # choice 0's engine request
        self.created = openai.now()
        self.model = state.model_name

    @property
    def prompt_tokens(self) -> int:
        """Usage's prompt_tokens: every prompt's, once each (not per choice)."""
        return sum(len(ids) for _, ids, _ in self.prompts)

    @staticmethod
    def _cached(finals) -> int:
        """Usage's cached prompt tokens: those of each prompt's first choice."""
        return sum(final.usage.cached_tokens for final in finals)

    def _prompt_text(self, index: int) -> str:
        return self.prompts[index // self.per_prompt][0]

    def _request(self, index: int) -> GenerateRequest:
        guide = self.guides[index] if self.guides is not None else None
        _, ids, params = self.prompts[index // self.per_prompt]
        if index:
            return GenerateRequest(ids, seed_for(params, index % self.per_prompt), guide=guide)
        return GenerateRequest(self.prompt_ids, self.params, self.request_id, draw_start=self.draw_start, retain=self.retain, guide=guide)

    def _choice(self, index: int) -> openai.Choice:
        parser = self.parser_factory(index) if self.parser_factory is not None and self.kind == "chat" else None
        return openai.Choice(index, parser)

    async def _run_choice(self, index: int, choice: openai.Choice) -> None:
        async with aclosing(self.engine.generate(self._request(index))) as events:
            async for event in events:
                choice.add(event)

    async def respond(self, stream: bool, stream_options=None) -> Response:
        """One JSON body, or an SSE stream (with a usage chunk when asked)."""
        if stream:
            return await self.stream(bool(stream_options and stream_options.include_usage))
        return await self.collect()

    async def finished_choices(self) -> list[openai.Choice] | Response:
        """Every choice run to its end; or the error response when one was
        refused or failed."""
        choices = [self._choice(i) for i in range(self.n)]
        failure: list[Exception] = []
        try:
            async with trio.open_nursery() as nursery:
                for c in choices:
                    nursery.start_soon(self._run_choice, c.index, c)
        except* Exception as group:
            failure.append(group.exceptions[0])
        if failure:
            return self.refusal(failure[0])
        failed = [c for c in choices if c.final.finish_reason == "error"]
        if failed:
            return error_response(self.failure(failed[0].final))
        return choices

    def failure(self, final: FinalEvent) -> HTTPError:
        """The error a failed generation answers with (503 once the engine is dead)."""
        return HTTPError(503 if self.engine.statistics().dead else 500, final.error or "generation failed", kind="server_error")

    async def collect(self) -> Response:
        choices = await self.finished_choices()
        if isinstance(choices, Response):
            return choices
        if self.on_final is not None:
            self.on_final(choices[0])
        if self.kind == "chat":
            return json_response(openai.chat_body(self.id, self.created, self.model, choices, len(self.prompt_ids), self.engine.tokenizer, self.logprobs))
        body = openai.envelope("text_completion", self.id, self.created, self.model)
        body["choices"] = [
            {
                "index": c.index,
                "text": (self._prompt_text(c.index) if self.echo else "") + c.content,
                "logprobs": openai.completion_logprobs(self.engine.tokenizer, c.tokens, len(self._prompt_text(c.index)) if self.echo else 0) if self.logprobs else None,
                "finish_reason": c.final.finish_reason,
            }
            for c in choices
        ]
        body["usage"] = openai.usage_body(
            self.prompt_tokens, sum(c.final.usage.completion_tokens for c in choices),
            self._cached(c.final for c in choices if c.index % self.per_prompt == 0), 0,  # completions parse no reasoning
        )  # fmt: skip
        return json_response(body)

    async def stream(self, include_usage: bool) -> Response:
        # Submit the first choice now, so a refusal (queue full, too long) is
        # an ordinary error response rather than an error inside the stream;
        # once accepted, headers and the role chunk go out at once.
        try:
            body = await self.open_stream(include_usage)
        except Exception as exc:  # noqa: BLE001 - a refusal is an ordinary error response
            return self.refusal(exc)
        return sse_response(body)

    def refusal(self, exc: Exception) -> Response:
        """The error response for a refused request."""
        return error_response(exc)

    async def open_stream(self, include_usage: bool) -> AsyncGenerator[bytes, None]:
        """Submit the first choice; raise its refusal, or give the stream's
        chunks (an async generator: closing it cancels what still runs)."""
        first = self.engine.open_generation(self._request(0))
        events = await first.__aenter__()
        # A body that never starts (the client left while the head was
        # written) runs no cleanup of its own: when the request is over,
        # closing the generation tells the scheduler, which cancels the
        # request within a step. Harmless once the stream has ended.
        at_request_end(first.close)
        return self._sse(first, events, include_usage)

    async def _sse(self, first, events, include_usage: bool) -> AsyncIterator[bytes]:
        """Chunks for every choice, then usage and [DONE]. With n > 1 the
        choices stream one after another, each chunk carrying its index.
        ``first`` is the accepted first generation's context, entered already."""
        completion_tokens = 0
        firsts: list[FinalEvent] = []  # each prompt's first choice's end, for usage's cached tokens
        reasoning = 0  # usage's reasoning tokens, summed over the choices as each ends
        defer = self.kind == "chat" and self.calls_possible and self.role_content == "" and self.retain is None
        self._role_pending = set(range(self.n)) if defer else set()
        async with _entered(first):
            if self.kind == "chat" and not defer:
                for i in range(self.n):
                    yield openai.sse(openai.chat_chunk(self.id, self.created, self.model, i, {"role": "assistant", "content": self.role_content}))
            elif self.echo:
                for i in range(self.n):
                    yield openai.sse(openai.completion_chunk(self.id, self.created, self.model, i, self._prompt_text(i)))
            choice = self._choice(0)
            async for event in events:
                if isinstance(event, FinalEvent):
                    firsts.append(event)
                deltas = choice.add(event)
                if isinstance(event, FinalEvent):
                    reasoning += choice.reasoning_tokens
                if isinstance(event, FinalEvent) and event.finish_reason != "error" and self.on_final is not None:
                    self.on_final(choice)
                for chunk, done_tokens in self._render(choice, event, deltas):
                    completion_tokens += done_tokens
                    yield chunk
        for index in range(1, self.n):
            try:
                async with aclosing(self.engine.generate(self._request(index))) as more:
                    choice = self._choice(index)
                    async for event in more:
                        if isinstance(event, FinalEvent) and index % self.per_prompt == 0:
                            firsts.append(event)
                        deltas = choice.add(event)
                        if isinstance(event, FinalEvent):
                            reasoning += choice.reasoning_tokens
                        for chunk, done_tokens in self._render(choice, event, deltas):
                            completion_tokens += done_tokens
                            yield chunk
            except Exception as exc:  # noqa: BLE001 - refused or cut off after the stream began
                _, body, _ = to_response(exc)
                yield openai.sse(body)
                break
        if include_usage:
            kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            yield openai.sse(
                openai.usage_chunk(kind, self.id, self.created, self.model, self.prompt_tokens, completion_tokens, self._cached(firsts), reasoning)
            )
        yield openai.sse("[DONE]")

    def _render(self, choice: openai.Choice, event, deltas):
        """SSE chunks for one event of ``choice``, whose certain output is
        ``deltas``; each with the completion tokens it finishes."""
        chunks = list(self._chunks(choice, event, deltas))
        if chunks and choice.index in self._role_pending:  # this choice's first chunk: its role goes first
            self._role_pending.discard(choice.index)
            content = None if deltas and deltas[0].tool_call is not None else ""
            chunks.insert(0, (openai.sse(openai.chat_chunk(self.id, self.created, self.model, choice.index, {"role": "assistant", "content": content})), 0))
        return chunks

    def _chunks(self, choice: openai.Choice, event, deltas):
        tok = self.engine.tokenizer
        index = choice.index
        if isinstance(event, FinalEvent):
            if event.finish_reason == "error":
                _, body, _ = to_response(self.failure(event))
                yield openai.sse(body), event.usage.completion_tokens
                return
            if self.kind == "chat":
                for delta in deltas:
                    yield openai.sse(openai.chat_chunk(self.id, self.created, self.model, index, openai.delta_body(delta))), 0
                yield openai.sse(openai.chat_chunk(self.id, self.created, self.model, index, {}, choice.finish_reason)), event.usage.completion_tokens
            else:
                yield openai.sse(openai.completion_chunk(self.id, self.created, self.model, index, event.text, event.finish_reason)), event.usage.completion_tokens
            return
        if self.kind == "chat":
            lp = openai.chat_logprob_entries(tok, [event]) if self.logprobs else None
            bodies = [openai.delta_body(d) for d in deltas]
            if not bodies and (choice.parser is None or lp is not None):
                bodies = [{"content": ""}]  # every token has its chunk (and its logprobs) even while text is held back
            for i, body in enumerate(bodies):
                yield openai.sse(openai.chat_chunk(self.id, self.created, self.model, index, body, None, lp if i == 0 else None)), 0
        else:
            lp = None
            if self.logprobs:
                # Offsets count from the start of the choice's text, echoed prompt included, as buffered ones do.
                at = self._text_offsets.get(index, len(self._prompt_text(index)) if self.echo else 0)
                lp = openai.completion_logprobs(tok, [event], at)
                self._text_offsets[index] = at + len(lp["tokens"][0])
            yield openai.sse(openai.completion_chunk(self.id, self.created, self.model, index, event.text, None, lp)), 0


def sse_response(body: AsyncIterator[bytes]) -> Response:
    """A streaming response of SSE chunks, with no overall deadline."""
    response = Response(body, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
    response.timeout = None
    return response


@contextlib.asynccontextmanager
async def _entered(context):
    """Own the exit of an async context manager entered elsewhere."""
    try:
        yield
    except BaseException as exc:
        if not await context.__aexit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        await context.__aexit__(None, None, None)
