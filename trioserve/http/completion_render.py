"""Chat and text completions as OpenAI renders them: one chat.completion or
text_completion body, or a stream of their chunks (then usage and [DONE]).
A session turn is a chat completion. The connection (connection.py) runs
the generations; this says what each event becomes.

A scored prompt (a PromptEvent, which comes before any token) becomes, for
an echoed completion with logprobs, the prompt's entries at the head of the
legacy logprobs (streamed: the echo chunk waits for it, so the prompt's
text and scores come together first), and for vLLM's prompt_logprobs field
that field: on each completion choice, at the top level of a chat body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from quart import Response

from trioserve.http import openai
from trioserve.http.errors import error_response, json_response, to_response
from trioserve.types import Event, FinalEvent, PromptEvent

if TYPE_CHECKING:
    from trioserve.http.connection import Connection


class CompletionRender:
    """The chat, text and turn shapes of one connection's job."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.job = conn.job
        self.tokenizer = conn.engine.tokenizer
        self.chat = self.job.shape != "text"  # chat and turn
        self._text_offsets: dict[int, int] = {}  # streamed completions: each choice's next token's text_offset
        self._role_pending: set[int] = set()  # chat choices whose role chunk waits for their first output
        self._scores: dict[int, object] = {}  # streamed: each prompt's scores (its first choice's PromptEvent), by that choice's index

    def seen(self, choice: openai.Choice, deltas: list) -> None:
        pass  # a buffered body is made from the finished choices alone

    def refusal(self, exc: Exception) -> Response:
        return error_response(exc)

    def _echoed(self, index: int) -> str:
        """What choice ``index``'s text starts with: its prompt when echoed."""
        return self.job.prompt(index).text if self.job.echo else ""

    def _echo_scores(self, index: int, choice: openai.Choice):
        """The prompt part of choice ``index``'s legacy logprobs (echo with
        logprobs): its ids, their scores and how many alternatives; else None."""
        if not (self.job.echo and self.job.logprobs) or choice.prompt is None:
            return None
        prompt = self.job.prompt(index)
        return prompt.ids, choice.prompt, prompt.params.top_logprobs

    def _logprobs(self, c: openai.Choice) -> dict | None:
        if not self.job.logprobs:
            return None
        return openai.completion_logprobs(self.tokenizer, c.scored, len(self._echoed(c.index)), self._echo_scores(c.index, c))

    def _cached(self, finals) -> int:
        """Usage's cached prompt tokens: those of each prompt's first choice."""
        return sum(final.usage.cached_tokens for final in finals)

    async def body(self, choices: list[openai.Choice]) -> Response:
        job = self.job
        for c in choices:  # a prompt is scored once, by its first choice (job.request): the others show its scores
            if c.prompt is None:
                c.prompt = choices[job.scorer(c.index)].prompt
        await self.conn.final(choices[0])
        if self.chat:
            return json_response(
                openai.chat_body(job.id, job.created, job.model, choices, job.prompt_tokens, self.tokenizer, job.logprobs, job.prompt_logprobs)
            )
        body = openai.envelope("text_completion", job.id, job.created, job.model)
        body["choices"] = [
            {
                "index": c.index,
                "text": self._echoed(c.index) + c.content,
                "logprobs": self._logprobs(c),
                "finish_reason": c.final.finish_reason,
            }
            for c in choices
        ]
        if job.prompt_logprobs is not None:  # vLLM's field, on each choice
            for entry, c in zip(body["choices"], choices, strict=True):
                entry["prompt_logprobs"] = openai.prompt_logprobs_body(self.tokenizer, c.prompt, job.prompt_logprobs) if c.prompt else None
        body["usage"] = openai.usage_body(
            job.prompt_tokens, sum(c.final.usage.completion_tokens for c in choices),
            self._cached(c.final for c in choices if c.index % job.n == 0), 0,  # completions parse no reasoning
        )  # fmt: skip
        return json_response(body)

    def _role_chunk(self, index: int, content: str | None) -> bytes:
        job = self.job
        return openai.sse(openai.chat_chunk(job.id, job.created, job.model, index, {"role": "assistant", "content": content}))

    async def chunks(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """Chunks for every choice, then usage and [DONE]. With n > 1 the
        choices stream one after another, each chunk carrying its index."""
        job, conn = self.job, self.conn
        completion_tokens = 0
        firsts: list[FinalEvent] = []  # each prompt's first choice's end, for usage's cached tokens
        reasoning = 0  # usage's reasoning tokens, summed over the choices as each ends
        # Tools offered under auto: the reply may be text or a call, so each
        # choice's role chunk waits for its first output (content "" before
        # text, None before a call, as OpenAI sends). A session turn's goes
        # at once (its actor opens the stream on the role chunk).
        defer = job.shape == "chat" and job.calls and not job.forced_call
        self._role_pending = set(range(job.choices)) if defer else set()
        if self.chat and not defer:
            for i in range(job.choices):
                yield self._role_chunk(i, None if job.forced_call else "")
        elif job.echo and not job.logprobs:  # with logprobs, each echo waits for its prompt's scores
            for i in range(job.choices):
                yield openai.sse(openai.completion_chunk(job.id, job.created, job.model, i, self._echoed(i)))
        for index in range(job.choices):
            choice = conn.choice(index)
            if index != job.scorer(index) and job.scorer(index) in self._scores:
                # Its prompt was scored by the prompt's first choice, streamed before it: the same scores head this one.
                for chunk, _ in self._render(choice, self._scores[job.scorer(index)], choice.add(self._scores[job.scorer(index)])):
                    yield chunk
            try:
                async with aclosing(self._events(index, events)) as stream:
                    async for event in stream:
                        if isinstance(event, FinalEvent) and index % job.n == 0:
                            firsts.append(event)
                        deltas = choice.add(event)
                        if isinstance(event, FinalEvent):
                            reasoning += choice.reasoning_tokens
                            if event.finish_reason != "error":
                                await conn.final(choice)
                        for chunk, done_tokens in self._render(choice, event, deltas):
                            completion_tokens += done_tokens
                            yield chunk
            except Exception as exc:  # noqa: BLE001 - a later choice refused, or cut off, after the stream began
                if index == 0:
                    raise  # the stream's own failure: the connection is cut, as for any broken body
                _, body, _ = to_response(exc)
                yield openai.sse(body)
                break
        if job.include_usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            yield openai.sse(openai.usage_chunk(kind, job.id, job.created, job.model, job.prompt_tokens, completion_tokens, self._cached(firsts), reasoning))
        yield openai.sse("[DONE]")

    async def _events(self, index: int, first: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """Choice ``index``'s events: the first's were accepted already; each
        later one is submitted now."""
        if index == 0:
            async for event in first:
                yield event
            return
        async with aclosing(self.conn.generate(index)) as more:
            async for event in more:
                yield event

    def _render(self, choice: openai.Choice, event, deltas):
        """SSE chunks for one event of ``choice``, whose certain output is
        ``deltas``; each with the completion tokens it finishes."""
        chunks = list(self._chunks(choice, event, deltas))
        if chunks and choice.index in self._role_pending:  # this choice's first chunk: its role goes first
            self._role_pending.discard(choice.index)
            content = None if deltas and deltas[0].tool_call is not None else ""
            chunks.insert(0, (self._role_chunk(choice.index, content), 0))
        return chunks

    def _completion_logprobs(self, index: int, token) -> dict:
        """A streamed completion's logprobs for one generated token. Offsets
        count from the start of the choice's text, echoed prompt included,
        by the tokens' own texts, as buffered ones do."""
        at = self._text_offsets.get(index, len(self._echoed(index)))
        lp = openai.completion_logprobs(self.tokenizer, [token], at)
        self._text_offsets[index] = at + len(lp["tokens"][0])
        return lp

    def _chunks(self, choice: openai.Choice, event, deltas):
        job, tok = self.job, self.tokenizer
        index = choice.index
        if isinstance(event, PromptEvent):
            self._scores[index] = event
            echo = self._echo_scores(index, choice)
            if echo is not None:
                lp = openai.completion_logprobs(tok, (), 0, echo)
                yield openai.sse(openai.completion_chunk(job.id, job.created, job.model, index, self._echoed(index), None, lp)), 0
            return
        if isinstance(event, FinalEvent):
            if event.finish_reason == "error":
                _, body, _ = to_response(self.conn.failure(event))
                yield openai.sse(body), event.usage.completion_tokens
                return
            stop = event.stop_token if job.logprobs else None  # the stop token's entry comes with the last chunk
            if self.chat:
                for delta in deltas:
                    yield openai.sse(openai.chat_chunk(job.id, job.created, job.model, index, openai.delta_body(delta))), 0
                lp = None if stop is None else openai.chat_logprob_entries(tok, [stop])
                yield openai.sse(openai.chat_chunk(job.id, job.created, job.model, index, {}, choice.finish_reason, lp)), event.usage.completion_tokens
            else:
                lp = None if stop is None else self._completion_logprobs(index, stop)
                yield openai.sse(openai.completion_chunk(job.id, job.created, job.model, index, event.text, event.finish_reason, lp)), event.usage.completion_tokens
            return
        if self.chat:
            lp = openai.chat_logprob_entries(tok, [event]) if job.logprobs else None
            bodies = [openai.delta_body(d) for d in deltas]
            if not bodies and (choice.parser is None or lp is not None):
                bodies = [{"content": ""}]  # every token has its chunk (and its logprobs) even while text is held back
            for i, body in enumerate(bodies):
                yield openai.sse(openai.chat_chunk(job.id, job.created, job.model, index, body, None, lp if i == 0 else None)), 0
        else:
            lp = self._completion_logprobs(index, event) if job.logprobs else None
            yield openai.sse(openai.completion_chunk(job.id, job.created, job.model, index, event.text, None, lp)), 0
