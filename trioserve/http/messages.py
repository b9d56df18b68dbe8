"""Anthropic's Messages API on the same engine as chat.

    POST /v1/messages               {model, max_tokens, messages, system?, tools?, tool_choice?, stream?, ...}
    POST /v1/messages/count_tokens  the same body, max_tokens not needed: {"input_tokens": N}

A body is read into the chat request it means by http/messages_request.py;
this module answers it. What the model produced comes back as content
blocks, built from the output parser's pieces in the order they come
(`ContentBlocks`): thinking (the reasoning channel, where the model has
one), text, and tool_use. Buffered and streamed replies are built by the
same code, so they hold the same blocks; a stream sends Anthropic's events
(message_start, a ping, each block's start, deltas and stop, message_delta
with the stop reason and usage, message_stop), each with its ``event:``
line. An error once the stream has begun is an ``error`` event.

Errors on these routes are in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``, with the status the
OpenAI routes give (http/errors.py decides it); those made before a route
runs (the API key, the content type, no such route) are reshaped on the
way out (`add_message_routes`' after-request hook).

Usage follows Anthropic's reading: ``input_tokens`` are the prompt tokens
computed for this request, ``cache_read_input_tokens`` those whose KV the
prefix cache already held; together they are the whole prompt, which is
what count_tokens reports.
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from quart import Response, request

from trioserve.errors import ChatTemplateError, RequestError
from trioserve.http import openai
from trioserve.http.connection import Connection
from trioserve.http.edge import ServerState, cache_salt, check_request_tokens, default_max_tokens, output_parsing, read_body, sampling_params, tenant
from trioserve.http.errors import json_response, to_response
from trioserve.http.job import GenerationJob, Prompt
from trioserve.http.messages_request import MessagesRequest, anthropic_field, parse_messages_request
from trioserve.http.tools import compile_guides, off_loop, render_prompt
from trioserve.models.chat_template import SpecialTextShield
from trioserve.models.output_parser import Delta
from trioserve.types import Event, FinalEvent

PATH = "/v1/messages"

# Anthropic's error types, by the status the error has here.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}  # fmt: skip


# --- errors


def error_body(status: int, error: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's error body for an error in OpenAI's shape (``error``:
    message, type, param, code) answered with ``status``. The message
    names the field (``param``) it is about."""
    message = str(error.get("message") or "")
    param = error.get("param")
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    kind = _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(exc: Exception) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, Anthropic's error body, headers) for any error a request can meet."""
    status, body, headers = to_response(exc)
    return status, error_body(status, body["error"]), headers


def anthropic_error_response(exc: Exception) -> Response:
    status, body, headers = anthropic_error(exc)
    return json_response(body, status, headers)


def _on_these_routes(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


# --- the prompt


def prompt_ids(tokenizer, template, req: MessagesRequest) -> list[int]:
    """The prompt's token ids: the conversation rendered as chat renders it
    (http/tools.py), then the prefill, which the reply continues. Strings
    the request brought are tokenized as text. Blocking: run off the loop."""
    chat = req.chat
    shield = SpecialTextShield(tokenizer.special_tokens)
    text = render_prompt(template, req.messages, chat.tools, chat.tool_choice, hide=shield.hide)
    if req.prefill:
        text += shield.hide(req.prefill)
    return tokenizer.encode_rendered(text, shield.literals)


async def _prompt_ids(model, req: MessagesRequest) -> list[int]:
    try:
        return await off_loop(prompt_ids, model.engine.tokenizer, model.template, req)
    except ChatTemplateError as exc:
        raise RequestError(f"messages: the chat template rejected the conversation: {exc}", field="messages") from None


# --- the reply


def usage_body(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's usage: the prompt split into the tokens computed now
    and those read from the prefix cache; nothing is written to a cache on
    request (caching here is automatic)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


class ContentBlocks:
    """The reply's content blocks, built from the output parser's pieces as
    they come: text and thinking extend the open block of their kind or
    close it and start one; a tool call is a whole block. `feed` and
    `finish` return the stream events that say so; ``blocks``, finished,
    are the message's content. A reply with no block at all is one empty
    text block."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the block text is going into

    def _close(self) -> list[dict[str, Any]]:
        kind, self._open = self._open, None
        if kind is None:
            return []
        index = len(self.blocks) - 1
        events: list[dict[str, Any]] = []
        if kind == "thinking":  # Anthropic's streams end a thinking block with its signature; there is none here
            events.append({"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta", "signature": ""}})
        return events + [{"type": "content_block_stop", "index": index}]

    def _start(self, block: dict[str, Any], shown: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(block)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown}]

    def _extend(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open != kind:
            events += self._close()
            empty = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
            events += self._start(dict(empty), empty)
            self._open = kind
        block = self.blocks[-1]
        block[kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        if delta.tool_call is not None:
            call = delta.tool_call
            events = self._close()
            tool_id = "toolu_" + call.id.removeprefix("call_").replace("-", "_")
            block = {"type": "tool_use", "id": tool_id, "name": call.name, "input": json.loads(call.arguments)}
            events += self._start(block, {**block, "input": {}})
            index = len(self.blocks) - 1
            return events + [
                {"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                {"type": "content_block_stop", "index": index},
            ]
        if delta.reasoning:
            return self._extend("thinking", delta.reasoning)
        if delta.content:
            return self._extend("text", delta.content)
        return []

    def finish(self) -> list[dict[str, Any]]:
        events = self._close()
        if not self.blocks:
            events += self._start({"type": "text", "text": ""}, {"type": "text", "text": ""})
            events.append({"type": "content_block_stop", "index": 0})
        return events


def matched_stop(tokenizer, choice: openai.Choice, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended ``choice``, or None (it ended otherwise).
    The engine drops a stop string from the text but not its tokens, and
    the output ends at the first stop to complete: so the matched one is
    the stop found earliest in the text of every generated token."""
    if not stops or choice.final is None or choice.final.finish_reason != "stop":
        return None
    text = tokenizer.decode([t.token_id for t in choice.tokens])
    found = [(text.find(stop), len(stop), stop) for stop in stops if stop in text]
    return min(found)[2] if found else None


class MessageRender:
    """One Messages request's job rendered as a message, or its stream of
    events."""

    def __init__(self, conn: Connection, req: MessagesRequest) -> None:
        self.conn = conn
        self.job = conn.job
        self.req = req
        self.tokenizer = conn.engine.tokenizer
        self.content = ContentBlocks()

    def seen(self, choice: openai.Choice, deltas: list) -> None:
        for delta in deltas:
            self.content.feed(delta)

    def refusal(self, exc: Exception) -> Response:
        if isinstance(exc, RequestError):
            exc = anthropic_field(exc, self.req.origins)
        return anthropic_error_response(exc)

    def _ending(self, choice: openai.Choice) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of an ended choice."""
        if choice.final.finish_reason == "length":
            return "max_tokens", None
        if choice.parsed().tool_calls:
            return "tool_use", None
        stop = matched_stop(self.tokenizer, choice, self.req.stop_sequences)
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)

    def message(self, choice: openai.Choice | None = None) -> dict[str, Any]:
        """The message: as it starts (no ``choice`` yet), or ended."""
        job = self.job
        if choice is None:
            stop_reason, stop, usage = None, None, usage_body(job.prompt_tokens, 0, 0)
        else:
            stop_reason, stop = self._ending(choice)
            usage = usage_body(job.prompt_tokens, choice.final.usage.completion_tokens, choice.final.usage.cached_tokens)
        return {
            "id": job.id, "type": "message", "role": "assistant", "model": job.model,
            "content": [dict(block) for block in self.content.blocks] if choice is not None else [],
            "stop_reason": stop_reason, "stop_sequence": stop, "usage": usage,
        }  # fmt: skip

    async def body(self, choices: list[openai.Choice]) -> Response:
        self.content.finish()
        return json_response(self.message(choices[0]))

    @staticmethod
    def _event(payload: dict[str, Any]) -> bytes:
        return f"event: {payload['type']}\n".encode() + openai.sse(payload)

    async def chunks(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """message_start, a ping, each block's events as it grows, then
        message_delta and message_stop; or an error event where the reply
        failed after the stream began."""
        yield self._event({"type": "message_start", "message": self.message()})
        yield self._event({"type": "ping"})
        choice = self.conn.choice(0)
        try:
            async for event in events:
                for delta in choice.add(event):
                    for payload in self.content.feed(delta):
                        yield self._event(payload)
                if not isinstance(event, FinalEvent):
                    continue
                if event.finish_reason == "error":
                    _, body, _ = anthropic_error(self.conn.failure(event))
                    yield self._event(body)
                    return
                for payload in self.content.finish():
                    yield self._event(payload)
                ended = self.message(choice)
                delta = {"stop_reason": ended["stop_reason"], "stop_sequence": ended["stop_sequence"]}
                yield self._event({"type": "message_delta", "delta": delta, "usage": ended["usage"]})
                yield self._event({"type": "message_stop"})
        except Exception as exc:  # noqa: BLE001 - the stream has begun: the failure is its last event
            _, body, _ = anthropic_error(exc)
            yield self._event(body)


# --- the routes


def add_message_routes(app, state: ServerState) -> None:
    @app.route(PATH, methods=["POST"])
    async def create_message() -> Response:
        try:
            req = await off_loop(parse_messages_request, await read_body(state))
            chat = req.chat
            model = state.route(chat.model)
            engine = model.engine
            ids = await _prompt_ids(model, req)
            check_request_tokens(state, "messages", [ids], max_len=engine.max_model_len)
            try:
                params = sampling_params(chat, default_max_tokens=default_max_tokens(state, engine, ids, "messages"))
                guides = await compile_guides(engine, chat, 1)
            except RequestError as exc:
                raise anthropic_field(exc, req.origins) from None
            job = GenerationJob(
                id=f"msg_{secrets.token_hex(12)}", shape="message", model=model.name, created=openai.now(),
                prompts=[Prompt("", ids, params)], guides=guides, stream=chat.stream,
                adapter=model.adapter_key, cache_salt=cache_salt(), tenant=tenant() or None, **output_parsing(model, chat.tools, chat.tool_choice),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an Anthropic error body
            return anthropic_error_response(exc)
        return await Connection(job, engine, lambda conn: MessageRender(conn, req)).respond()

    @app.route(PATH + "/count_tokens", methods=["POST"])
    async def count_tokens() -> Response:
        try:
            req = await off_loop(functools.partial(parse_messages_request, counting=True), await read_body(state))
            ids = await _prompt_ids(state.route(req.chat.model), req)
        except Exception as exc:  # noqa: BLE001
            return anthropic_error_response(exc)
        return json_response({"input_tokens": len(ids)})

    @app.after_request
    async def anthropic_errors(response: Response) -> Response:
        """An error on these routes made in OpenAI's shape (before the route
        ran: the API key, the content type, no such route or method, the
        body's size; or by the connection) leaves in Anthropic's."""
        if not _on_these_routes(request.path) or response.status_code < 400 or response.mimetype != "application/json":
            return response
        try:
            body = json.loads(await response.get_data())
        except ValueError:
            return response
        if isinstance(body, dict) and isinstance(body.get("error"), dict) and body.get("type") != "error":
            response.set_data(json.dumps(error_body(response.status_code, body["error"]), ensure_ascii=False))
        return response
