"""OpenAI's Responses API on the same engine as chat.

    POST   /v1/responses          {input, instructions?, tools?, text?, previous_response_id?, stream?, ...}
    GET    /v1/responses/{id}     a stored response, as it was answered
    DELETE /v1/responses/{id}

A request body is read into the chat request it means by
http/responses_request.py. This module answers it: what the model produced
comes back as output items, built from the output parser's pieces in the
order they come (`OutputItems`): reasoning, message text and function
calls. Buffered and streamed bodies are built by the same code, so they
hold the same items with the same ids; a stream announces each item, its
text in deltas, and the response's end (`response.completed`, or
`response.incomplete` when ``max_output_tokens`` cut it off).

A stored response (``store``, on unless false) is a committed turn of the
same kind a session's is: kept in a `SessionStore` (the same bounds on
count, idleness and bytes as sessions), under its own id, with the whole
conversation it ends: the earlier responses' (through
``previous_response_id``), this input, and this output. It is kept right
before its final body or event goes out, never when the client left,
failed or was refused. ``instructions`` are not carried into later
responses (OpenAI's rule): each request brings its own. When it cannot be
kept (the state store refuses the write: a full disk, a state file gone),
nothing is kept and the client is told: a buffered request gets that error
(503 ``state_unavailable``) instead of its body, a stream a
``response.failed`` event carrying it instead of its last events."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Response

from trioserve.actors.session import durably, synced
from trioserve.errors import ChatTemplateError, RequestError
from trioserve.http import openai
from trioserve.http.connection import Connection
from trioserve.http.edge import ServerState, affinity_key, cache_salt, check_request_tokens, default_max_tokens, output_parsing, read_body, sampling_params, tenant, with_affinity
from trioserve.http.errors import HTTPError, error_response, json_response, to_response
from trioserve.http.job import GenerationJob, Prompt
from trioserve.http.responses_request import ResponsesRequest, input_messages, parse_responses_request, responses_field
from trioserve.http.schemas import parse_chat_request
from trioserve.http.structuring import short
from trioserve.http.tools import compile_guides, message_dict, off_loop, render_prompt_ids
from trioserve.models.output_parser import Delta
from trioserve.state.session import SessionNotFound, compact_json
from trioserve.state.session_store import SessionStore
from trioserve.types import Event, FinalEvent

# --- the output


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _part(kind: str, text: str) -> dict[str, Any]:
    """The content part of a message (output_text) or reasoning item."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


class OutputItems:
    """The response's output items, built from the output parser's pieces as
    they come: each piece either extends the open item (message text,
    reasoning) or closes it and starts the next. `feed` and `finish` return
    the stream events that say so (without sequence numbers); the items,
    finished, are the response's ``output``. Text that is only whitespace
    waits: it opens a message only if more text follows, or if the reply
    holds nothing else."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item text is going into
        self._text: list[str] = []  # the open item's text so far
        self._waiting = ""  # whitespace not yet in any message

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        text = "".join(self._text)
        self._text = []
        part = _part(item["type"], text)
        item["content"] = [part]
        if item["type"] == "message":
            item["status"] = status
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        return [
            {"type": done, **where, "text": text, **({"logprobs": []} if item["type"] == "message" else {})},
            {"type": "response.content_part.done", **where, "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": dict(item)},
        ]

    def _start(self, item: dict[str, Any]) -> list[dict]:
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events: list[dict] = [{"type": "response.output_item.added", "output_index": index, "item": dict(item)}]
        if item["type"] != "function_call":
            part = {"item_id": item["id"], "output_index": index, "content_index": 0, "part": _part(item["type"], "")}
            events.append({"type": "response.content_part.added", **part})
        return events

    def _extend(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            if kind == "message":
                events += self._start({"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []})
            else:
                events += self._start({"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": []})
        self._text.append(text)
        where = {"item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "message":
            return events + [{"type": "response.output_text.delta", **where, "delta": text, "logprobs": []}]
        return events + [{"type": "response.reasoning_text.delta", **where, "delta": text}]

    def feed(self, delta: Delta) -> list[dict]:
        if delta.tool_call is not None:
            self._waiting = ""  # whitespace before a call belongs to no message
            events = self._close("completed")
            call = delta.tool_call
            item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id, "name": call.name, "arguments": ""}
            events += self._start(item)
            self._open = None
            index = len(self.items) - 1
            item.update(arguments=call.arguments, status="completed")
            return events + [
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index, "delta": call.arguments},
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index, "name": call.name, "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": index, "item": dict(item)},
            ]  # fmt: skip
        if delta.reasoning:
            return self._extend("reasoning", delta.reasoning)
        if not delta.content:
            return []
        if (self._open is None or self._open["type"] != "message") and not delta.content.strip():
            self._waiting += delta.content
            return []
        text, self._waiting = self._waiting + delta.content, ""
        return self._extend("message", text)

    def finish(self, status: str) -> list[dict]:
        """Close what is open (``status`` "incomplete" when the reply was
        cut off); a reply with no items at all is one message, maybe empty."""
        events: list[dict] = []
        if self._waiting and self._open is not None and self._open["type"] == "message":
            events += self._extend("message", self._waiting)
        elif not self.items or (self._waiting and not any(item["type"] != "reasoning" for item in self.items)):
            events += self._extend("message", self._waiting)
        self._waiting = ""
        return events + self._close(status)

    def as_input(self) -> list[dict[str, Any]]:
        """The output as the input items a client would send back with it:
        messages and function calls (reasoning is never shown again)."""
        out: list[dict[str, Any]] = []
        for item in self.items:
            if item["type"] == "message":
                out.append({"type": "message", "role": "assistant", "content": item["content"]})
            elif item["type"] == "function_call":
                out.append({key: item[key] for key in ("type", "call_id", "name", "arguments")})
        return out


def as_history(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as a stored conversation keeps them: the messages their
    input items would become (so continuing with previous_response_id
    renders what sending the items back would); an output of reasoning
    only is an empty assistant message."""
    if not items:
        return [{"role": "assistant", "content": ""}]
    messages, _ = input_messages(items)
    return [message_dict(m) for m in parse_chat_request({"messages": messages}).messages]


def usage_body(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    """The Responses API's usage object. cache_write_tokens are the prompt
    tokens computed this time (and so written into the KV cache)."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": prompt_tokens - cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


class ResponseRender:
    """One Responses request's job rendered as a response object or its
    stream of events, and kept in ``store`` when asked (with the whole
    conversation it continues: ``history``)."""

    def __init__(self, conn: Connection, req: ResponsesRequest, store: SessionStore, history: list[dict[str, Any]], owner: str) -> None:
        self.conn = conn
        self.owner = owner  # the tenant it is stored for
        self.job = conn.job
        self.req = req
        self.store = store
        self.history = history  # the earlier responses' conversation, then this input
        self.output = OutputItems()
        self.sequence = 0

    def seen(self, choice: openai.Choice, deltas: list) -> None:
        for delta in deltas:
            self.output.feed(delta)

    def resource(self, status: str, choice: openai.Choice | None = None, error: dict | None = None) -> dict[str, Any]:
        """The response object: in progress (no ``choice`` yet), or ended."""
        req, job = self.req, self.job
        params = job.prompts[0].params
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None
        if choice is not None and choice.final is not None:
            final = choice.final
            usage = usage_body(job.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens, choice.reasoning_tokens)
        return {
            "id": job.id, "object": "response", "created_at": job.created, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata, "model": job.model,
            "output": [dict(item) for item in self.output.items] if status != "in_progress" else [],
            "parallel_tool_calls": req.chat.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": params.temperature, "text": {"format": req.text_format},
            "tool_choice": req.tool_choice, "tools": list(req.tools), "top_p": params.top_p,
            "truncation": req.truncation, "usage": usage, "user": req.chat.user,
        }  # fmt: skip

    def _status(self, choice: openai.Choice) -> str:
        return "incomplete" if choice.final.finish_reason == "length" else "completed"

    async def _kept(self, choice: openai.Choice) -> dict[str, Any]:
        """The ended response's object, once its output is closed; kept in
        the store first when asked: the commit point (on disk, with a state
        store, before the body or the last event goes out)."""
        body = self.resource(self._status(choice), choice)
        if self.req.store:
            kept = self.store.prepare_create(
                trio.current_time(), created=self.job.created, session_id=self.job.id,
                messages=[*self.history, *as_history(self.output.as_input())], record=body, model=self.job.model,
                owner=self.owner,
            )  # fmt: skip
            await durably(self.store.write_create, kept, self.store.journal is not None)
            self.store.insert(kept, trio.current_time())
        return body

    def refusal(self, exc: Exception) -> Response:
        if isinstance(exc, RequestError):
            exc = responses_field(exc, [])
        return error_response(exc)

    async def body(self, choices: list[openai.Choice]) -> Response:
        self.output.finish(self._status(choices[0]))
        try:
            kept = await self._kept(choices[0])
        except Exception as exc:  # noqa: BLE001 - not kept (the state store refused it, or the quota filled meanwhile): its error, not the body
            return self.refusal(exc)
        return json_response(kept)

    def _event(self, payload: dict[str, Any]) -> bytes:
        payload = {**payload, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {payload['type']}\n".encode() + openai.sse(payload)

    async def chunks(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The response's events: created, in progress, each output item as
        it grows, then completed (or incomplete, or failed)."""
        yield self._event({"type": "response.created", "response": self.resource("in_progress")})
        yield self._event({"type": "response.in_progress", "response": self.resource("in_progress")})
        choice = self.conn.choice(0)
        async for event in events:
            deltas = choice.add(event)
            for delta in deltas:
                for payload in self.output.feed(delta):
                    yield self._event(payload)
            if not isinstance(event, FinalEvent):
                continue
            if event.finish_reason == "error":
                failure = self.conn.failure(event)
                error = {"code": failure.code or "server_error", "message": str(failure)}
                self.output.finish("incomplete")
                yield self._event({"type": "response.failed", "response": self.resource("failed", choice, error)})
                return
            closing = self.output.finish(self._status(choice))
            try:
                body = await self._kept(choice)
            except Exception as exc:  # noqa: BLE001 - not kept: the stream ends with why, never cut
                _, error, _ = to_response(exc)
                failed = {"code": error["error"]["code"] or "server_error", "message": error["error"]["message"]}
                yield self._event({"type": "response.failed", "response": self.resource("failed", choice, failed)})
                return
            for payload in closing:
                yield self._event(payload)
            yield self._event({"type": f"response.{body['status']}", "response": body})


def add_response_routes(app, state: ServerState) -> SessionStore:
    settings = state.settings
    store = SessionStore(
        max_sessions=settings.max_sessions, idle_s=settings.session_idle_s, max_history_bytes=settings.session_history_bytes,
        kind="response", quota=state.quota(settings.max_sessions, settings.session_history_bytes),
    )  # fmt: skip

    async def stored(response_id: str, param: str | None = "previous_response_id"):
        """The stored response, used now; else a 404 naming ``param`` (none
        when the id came in the path)."""
        try:
            await synced(store, response_id)  # stored by another replica, or deleted there
            return store.get(response_id, trio.current_time(), use=True, owner=tenant())
        except SessionNotFound:
            raise HTTPError(
                404, f"no response {short(response_id, 80)} (unknown, deleted, stored with store false, or evicted)",
                param=param, code="response_not_found",
            ) from None  # fmt: skip

    @app.route("/v1/responses", methods=["POST"])
    async def create_response() -> Response:
        try:
            req = await off_loop(parse_responses_request, await read_body(state))
            model = state.route(req.chat.model)
            engine = model.engine
            earlier = (await stored(req.previous_response_id)).messages if req.previous_response_id is not None else []
            history = [*earlier, *req.messages]
            head = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
            chat = req.chat
            try:
                prompt_ids = await off_loop(render_prompt_ids, engine.tokenizer, model.template, head + history, chat.tools, chat.tool_choice)
            except ChatTemplateError as exc:  # chat names messages; here they come from input (and earlier responses)
                raise RequestError(f"input: the chat template rejected the conversation: {exc}", field="input") from None
            check_request_tokens(state, "input", [prompt_ids], max_len=engine.max_model_len)
            try:
                params = sampling_params(chat, default_max_tokens=default_max_tokens(state, engine, prompt_ids, "input"))
                guides = await compile_guides(engine, chat, 1)
            except RequestError as exc:
                raise responses_field(exc, []) from None
            job = GenerationJob(
                id=_item_id("resp"), shape="response", model=model.name, created=openai.now(),
                prompts=[Prompt("", prompt_ids, params)], guides=guides, stream=chat.stream,
                adapter=model.adapter_key, cache_salt=cache_salt(chat.cache_salt), tenant=tenant() or None, **output_parsing(model, chat.tools, chat.tool_choice),
            )  # fmt: skip
            key = affinity_key() or job.id  # the chain's key: the client's, else this response's id
            owner = tenant()
            if req.store:  # a 429 or 400 now rather than a response that cannot be kept
                store.check_room(owner)
                tools = len(compact_json(list(req.tools)))
                store.check_keepable(owner, tools + sum(len(str(m.get("content") or "").encode()) for m in history), lambda: "tools" if tools else "input")
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return error_response(exc)
        answer = await Connection(job, engine, lambda conn: ResponseRender(conn, req, store, history, owner)).respond()
        return with_affinity(answer, key)

    @app.route("/v1/responses/<response_id>", methods=["GET"])
    async def read_response(response_id: str) -> Response:
        try:
            return with_affinity(json_response((await stored(response_id, None)).record), response_id)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    @app.route("/v1/responses/<response_id>", methods=["DELETE"])
    async def delete_response(response_id: str) -> Response:
        try:
            await stored(response_id, None)  # a 404 naming it when there is none
            await durably(store.write_delete, response_id, store.journal is not None)
            store.forget(response_id)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    return store
