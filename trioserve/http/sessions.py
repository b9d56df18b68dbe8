"""The /v1/sessions resource: stateful conversations over the same engine.

    POST   /v1/sessions                 {model?, system?, seed?, sampling defaults} -> the session
    POST   /v1/sessions/{id}/turns      {messages, stream?, per-turn overrides} -> a chat completion
    GET    /v1/sessions/{id}            history, settings, usage
    DELETE /v1/sessions/{id}

A turn pins the session, renders system + committed history + the new
messages through the chat template, and generates. Right before the final
response (the JSON body, or the last SSE chunk) it commits: the new messages
and the reply join the history, and the random stream's position moves on.
A disconnect, error or refusal before that point changes nothing, so a retry
starts from the same place; a disconnect after it does not undo the turn."""

from __future__ import annotations

import time
import weakref
from contextlib import aclosing

import attrs
import trio
from quart import Response

from trioserve.http.connection import Connection
from trioserve.http import openai
from trioserve.errors import RequestError
from trioserve.http.errors import HTTPError, error_response, json_response
from trioserve.types import SEED_LIMIT
from trioserve.http.schemas import CONSTRAINT_FIELDS, parse_chat_request, sampling_params
from trioserve.http.tools import compile_guides, message_dict, off_loop, render_prompt_ids
from trioserve.state.session_store import Session, SessionStore, Turn, TurnLease

# Chat fields a session keeps as defaults for its turns.
SETTINGS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "max_tokens", "max_completion_tokens", "stop", "logit_bias", "ignore_eos",
    "tools", "tool_choice", "parallel_tool_calls", *CONSTRAINT_FIELDS,
)  # fmt: skip
PLACEHOLDER = [{"role": "user", "content": "-"}]


def _check_settings(body: dict, engine) -> dict:
    """The session settings in ``body``, validated exactly as chat fields
    are, and refused now when no turn could ever run with them: a
    max_tokens that leaves no room for even a one-token prompt."""
    settings = {k: body[k] for k in SETTINGS if k in body}
    req = parse_chat_request({"messages": PLACEHOLDER, **settings})
    stats = engine.statistics()
    room = min(engine.max_model_len, stats.kv_blocks_total * stats.block_size) - 1
    for field in ("max_completion_tokens", "max_tokens"):
        value = getattr(req, field)
        if value is not None and value > room:
            raise RequestError(
                f"{field}: {value} can never fit; this server has room for at most {room} new tokens beside a turn's prompt",
                field=field,
            )
    return settings


def _session_seed(body: dict) -> int | None:
    """The session's seed: any integer the chat route accepts, folded into
    the engine's range the same way (so every turn accepts it)."""
    if body.get("seed") is None:
        return None
    req = parse_chat_request({"messages": PLACEHOLDER, "seed": body["seed"]})
    return req.seed % SEED_LIMIT


def add_session_routes(app, state, body_reader, default_max_tokens, check_model) -> SessionStore:
    settings = state.settings
    def forget(session_id: str) -> None:
        if state.engine is not None:
            state.engine.forget_retained(session_id)

    store = SessionStore(
        max_sessions=settings.max_sessions,
        idle_s=settings.session_idle_s,
        max_history_bytes=settings.session_history_bytes,
        on_remove=forget,
    )

    @app.route("/v1/sessions", methods=["POST"])
    async def create_session() -> Response:
        try:
            engine = state.ready()
            body = await body_reader()
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            check_model(state, body.get("model"))
            system = body.get("system")
            if system is not None and not isinstance(system, str):
                raise HTTPError(400, "system: expected a string", param="system")
            seed = _session_seed(body)
            defaults = _check_settings(body, engine)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        session = store.create(trio.current_time(), system=system, defaults=defaults, seed=seed, created=time.time())
        return json_response(_describe(session, state.model_name), 200)

    @app.route("/v1/sessions/<session_id>", methods=["GET"])
    async def read_session(session_id: str) -> Response:
        try:
            return json_response(_describe(store.get(session_id, trio.current_time()), state.model_name))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    @app.route("/v1/sessions/<session_id>", methods=["DELETE"])
    async def delete_session(session_id: str) -> Response:
        try:
            store.delete(session_id, trio.current_time())
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return json_response({"id": session_id, "object": "session.deleted", "deleted": True})

    @app.route("/v1/sessions/<session_id>/turns", methods=["POST"])
    async def turn(session_id: str) -> Response:
        lease: TurnLease | None = None  # set once this request has pinned the session
        try:
            engine = state.ready()
            body = await body_reader()
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            messages = body.get("messages")
            for message in messages if isinstance(messages, list) else ():  # other shapes: parse_chat_request says why
                if isinstance(message, dict) and message.get("role") not in ("user", "tool"):
                    raise HTTPError(400, "messages: a turn brings only user or tool messages; the session keeps the rest", param="messages")
            found = store.get(session_id, trio.current_time())
            defaults = found.defaults
            if any(k in body for k in CONSTRAINT_FIELDS):  # a turn's own constraint replaces the session's
                defaults = {k: v for k, v in defaults.items() if k not in CONSTRAINT_FIELDS}
            req = parse_chat_request({**defaults, **body})
            if req.n != 1:
                raise HTTPError(400, "n: a session turn has exactly one choice", param="n")
            lease = store.begin(session_id, trio.current_time())
            session = lease.session
            new = [message_dict(m) for m in req.messages]
            prompt_ids = await off_loop(render_prompt_ids, engine.tokenizer, state.template, session.conversation(new), req.tools, req.tool_choice)
            params = sampling_params(req, default_max_tokens=default_max_tokens(engine, prompt_ids, "messages", settings.default_max_tokens))
            restart = "seed" in body  # a new seed restarts the stream; otherwise it continues
            if not restart and session.seed is not None:
                params = _with_seed(params, session.seed)
            job = Connection(state, engine, "chat", prompt_ids, params, 1, req.logprobs, prompt_text="", echo=False)
            job.draw_start = 0 if restart else session.draw_index
            job.retain = session.id
            job.guides = await compile_guides(engine, req, 1)
            state.parsers(job, req.tools, req.tool_choice)
        except BaseException as exc:
            if lease is not None:
                store.cancel(lease, trio.current_time())  # nothing was submitted, so nothing is held
            if not isinstance(exc, Exception):
                raise  # cancelled (the client left while the turn was being set up)
            return error_response(exc)

        def commit(choice: openai.Choice) -> None:
            final = choice.final
            turn = Turn(
                messages=tuple(new) + (_history_message(choice.message()),),
                seed=final.seed,
                draw_end=final.draw_end,
                prompt_tokens=final.usage.prompt_tokens,
                completion_tokens=final.usage.completion_tokens,
            )
            store.commit(lease, turn, trio.current_time())  # StaleTurn (nothing changed) if this turn ended already
            engine.settle_retained(session.id, job.request_id, commit=True)  # its KV is the session's now

        def release() -> None:
            # Runs once the response is over, and perhaps again from the
            # garbage collector's finalizer, possibly after trio has stopped.
            # Only this turn's lease can end this turn, once: a late call
            # does nothing, whatever turn the session is running by then.
            if store.cancel(lease, _now(session.last_used)):
                engine.settle_retained(session.id, job.request_id, commit=False)

        job.on_final = commit
        if not req.stream:
            try:
                return await job.collect()
            finally:
                release()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            response = await job.stream(include_usage)
        except BaseException:
            release()  # cancelled while submitting: the turn never started
            raise
        if response.mimetype == "text/event-stream":
            # Release when the body ends, and also if it never starts (the
            # client left first): the generator is then only collected.
            # The finalizer is detached as soon as the body's own cleanup ran.
            def body_ended() -> None:
                release()
                finalizer.detach()

            wrapped = _then(response.response.iter, body_ended)
            finalizer = weakref.finalize(wrapped, release)
            response.response.iter = wrapped
        else:
            release()
        return response

    return store


def _history_message(message: dict) -> dict:
    """The reply as the history keeps it: content and calls, not reasoning."""
    kept = {"role": "assistant", "content": message["content"] or ""}
    if "tool_calls" in message:
        kept["tool_calls"] = message["tool_calls"]
    return kept


def _now(fallback: float) -> float:
    """The store's clock (trio's), or ``fallback`` outside a trio run."""
    try:
        return trio.current_time()
    except RuntimeError:
        return fallback


def _with_seed(params, seed: int):
    return attrs.evolve(params, seed=seed)


async def _then(body, after):
    """``body``'s chunks, then ``after()``, however the body ends; closing
    this generator closes ``body`` too (its engine request with it)."""
    try:
        async with aclosing(body):
            async for chunk in body:
                yield chunk
    finally:
        after()


def _describe(session: Session, model: str) -> dict:
    return {
        "id": session.id,
        "object": "session",
        "model": model,
        "created": int(session.created),
        "system": session.system,
        "settings": session.defaults,
        "seed": session.seed,
        "draw_index": session.draw_index,
        "turns": session.turns,
        "messages": session.messages,
        "usage": openai.usage_body(session.prompt_tokens, session.completion_tokens),
        "busy": session.busy,
    }
