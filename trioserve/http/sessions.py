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
starts from the same place; a disconnect after it does not undo the turn.

The turn itself runs in its session's actor (trioserve/actors/session.py),
which generates, commits or cancels. This handler pins the session through
`SessionActors.begin` (409 at once when busy), hands the turn over
(`RunTurn`) and relays what the actor answers: the JSON body, or the SSE
chunks, each pulled when the last one has gone out. When the client leaves,
the handler hangs up its line to the actor (`TurnLine`: in the body's own
close, or at the end of the request when the body never started) and the
actor cancels the turn in its own task."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import trio
from quart import Response

from trioserve.actors.session import Answer, Chunk, Failed, Opened, Pull, RunTurn, TurnLine, TurnOutput, durably, synced
from trioserve.errors import EngineClosed, RequestError
from trioserve.http import openai
from trioserve.http.connection import Connection, sse_response
from trioserve.http.constraints import CONSTRAINT_FIELDS
from trioserve.http.edge import (
    AFFINITY_HEADER, ServerState, affinity_key, cache_salt, check_request_tokens, default_max_tokens, output_parsing, read_body, resolve_seed, sampling_params, tenant,
    with_affinity,
)  # fmt: skip
from trioserve.http.errors import HTTPError, error_response, json_response, to_response
from trioserve.http.in_flight import at_request_end
from trioserve.http.job import GenerationJob, Prompt
from trioserve.http.schemas import parse_chat_request
from trioserve.http.tools import compile_guides, message_dict, off_loop, render_prompt_ids
from trioserve.state.durable import StateConflict
from trioserve.state.session import Session, SessionBusy, SessionNotFound, Turn
from trioserve.state.session_store import SessionStore

# Chat fields a session keeps as defaults for its turns.
SETTINGS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "max_tokens", "max_completion_tokens", "stop", "logit_bias", "ignore_eos", "stop_token_ids",
    "tools", "tool_choice", "parallel_tool_calls", *CONSTRAINT_FIELDS,
)  # fmt: skip
PLACEHOLDER = [{"role": "user", "content": "-"}]


async def _check_settings(body: dict, engine) -> dict:
    """The session settings in ``body``, validated exactly as chat fields
    are (in a worker thread: tools and schemas can be large), and refused
    now when no turn could ever run with them: a max_tokens that leaves no
    room for even a one-token prompt."""
    settings = {k: body[k] for k in SETTINGS if k in body}
    req = await off_loop(parse_chat_request, {"messages": PLACEHOLDER, **settings})
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
    return resolve_seed(req.seed)


def add_session_routes(app, state: ServerState) -> SessionStore:
    settings = state.settings

    def forget(session_id: str) -> None:
        for engine in state.engines():  # only its model's keeps anything for it; the others have nothing to drop
            engine.forget_retained(session_id)

    store = SessionStore(
        max_sessions=settings.max_sessions,
        idle_s=settings.session_idle_s,
        max_history_bytes=settings.session_history_bytes,
        on_remove=forget,
        quota=state.quota(settings.max_sessions, settings.session_history_bytes),
    )

    @app.route("/v1/sessions", methods=["POST"])
    async def create_session() -> Response:
        try:
            body = await read_body(state)
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            model = state.route(body.get("model"))
            engine = model.engine
            if engine.is_encoder:  # its turns could only fail: refused where the session would begin
                raise RequestError(f"model: {engine.encoder_routes()}, not sessions", field="model")
            system = body.get("system")
            if system is not None and not isinstance(system, str):
                raise HTTPError(400, "system: expected a string", param="system")
            seed = _session_seed(body)
            defaults = await _check_settings(body, engine)
            chosen = affinity_key()  # a client's own key becomes the session's id, so a load balancer can route its creation too
            key = None if chosen is None else scoped_id(chosen)  # its tenant's own: another's of that name is another session
            try:
                session = store.prepare_create(trio.current_time(), system=system, defaults=defaults, seed=seed, created=time.time(), model=model.name, session_id=key, owner=tenant())
            except ValueError:
                raise HTTPError(409, f"a session {chosen!r} exists already ({AFFINITY_HEADER})", param=AFFINITY_HEADER, code="session_exists") from None
            try:
                await durably(store.write_create, session, store.journal is not None)  # on disk (off the event loop) before it is answered
                store.insert(session, trio.current_time())
            except (StateConflict, ValueError):  # made meanwhile, by another request or another replica
                raise HTTPError(409, f"a session {chosen!r} exists already ({AFFINITY_HEADER})", param=AFFINITY_HEADER, code="session_exists") from None
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return with_affinity(json_response(_describe(session), 200), public_id(session.id))

    @app.route("/v1/sessions/<session_id>", methods=["GET"])
    async def read_session(session_id: str) -> Response:
        try:
            key = await _find(store, session_id)
            return with_affinity(json_response(_describe(store.get(key, trio.current_time(), owner=tenant()))), session_id)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)

    @app.route("/v1/sessions/<session_id>", methods=["DELETE"])
    async def delete_session(session_id: str) -> Response:
        try:
            key = await _find(store, session_id)
            store.check_delete(key, trio.current_time(), owner=tenant())
            await durably(store.write_delete, key, store.journal is not None)
            store.forget(key)
        except Exception as exc:  # noqa: BLE001
            return error_response(_as_sent(exc, session_id))
        return json_response({"id": session_id, "object": "session.deleted", "deleted": True})

    @app.route("/v1/sessions/<session_id>/turns", methods=["POST"])
    async def turn(session_id: str) -> Response:
        public, session_id = session_id, session_id  # the id as sent; session_id becomes the store's key below
        try:
            body = await read_body(state)
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            messages = body.get("messages")
            for message in messages if isinstance(messages, list) else ():  # other shapes: parse_chat_request says why
                if isinstance(message, dict) and message.get("role") not in ("user", "tool"):
                    raise HTTPError(400, "messages: a turn brings only user or tool messages; the session keeps the rest", param="messages")
            session_id = await _find(store, public)  # another replica may have made or continued it
            found = store.get(session_id, trio.current_time(), owner=tenant())
            model = state.route(found.model)  # the session's model runs its turns
            engine = model.engine
            defaults = found.defaults
            if any(k in body for k in CONSTRAINT_FIELDS):  # a turn's own constraint replaces the session's
                defaults = {k: v for k, v in defaults.items() if k not in CONSTRAINT_FIELDS}
            req = await off_loop(parse_chat_request, {**defaults, **body})  # tools and schemas can be large: not on the event loop
            if req.n != 1:
                raise HTTPError(400, "n: a session turn has exactly one choice", param="n")
            new = [message_dict(m) for m in req.messages]
            actors = state.turns
            if actors is None:
                raise EngineClosed("the server is shutting down")
            # Pins the session (a second turn is a 409 here, at once) and
            # starts its actor, which owns the turn from now on.
            salt, owner = cache_salt(req.cache_salt), tenant()  # here: the turn is prepared in its actor's task, outside the request
            line = actors.begin(session_id, trio.current_time(), engine, owner=owner)
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return error_response(_as_sent(exc, public))
        restart = "seed" in body  # a new seed restarts the stream; otherwise it continues
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def prepare(session: Session, on_final: Callable[[openai.Choice], Awaitable[None]]) -> Connection:
            """The turn's generation from the pinned session (in the actor's
            task); ``on_final`` commits it."""
            prompt_ids = await off_loop(render_prompt_ids, engine.tokenizer, model.template, session.conversation(new), req.tools, req.tool_choice)
            check_request_tokens(state, "messages", [prompt_ids], max_len=engine.max_model_len)
            params = sampling_params(
                req, default_max_tokens=default_max_tokens(state, engine, prompt_ids, "messages"), seed=req.seed if restart else session.seed
            )
            job = GenerationJob(
                id=openai.new_id("chatcmpl"), shape="turn", model=model.name, created=openai.now(),
                prompts=[Prompt("", prompt_ids, params)], logprobs=req.logprobs,
                guides=await compile_guides(engine, req, 1), stream=req.stream, include_usage=include_usage,
                draw_start=0 if restart else session.draw_index, retain=session.id,
                adapter=model.adapter_key, cache_salt=salt, tenant=owner or None, **output_parsing(model, req.tools, req.tool_choice),
            )  # fmt: skip
            return Connection(job, engine, on_final=on_final)

        def outcome(choice: openai.Choice) -> Turn:
            final = choice.final
            return Turn(
                messages=tuple(new) + (_history_message(choice.message()),),
                seed=final.seed,
                draw_end=final.draw_end,
                prompt_tokens=final.usage.prompt_tokens,
                completion_tokens=final.usage.completion_tokens,
            )

        # Hanging up is how the actor learns the client left: it then
        # cancels the turn in its own task. Runs when the body ends, and in
        # any case when the request is over (a body that never started runs
        # no cleanup of its own).
        at_request_end(line.hang_up)
        order = RunTurn(prepare, outcome, req.stream)
        try:
            first = await _ask(line, order)
        except BaseException:
            line.hang_up()  # cancelled: the client left while the turn was starting
            raise
        if isinstance(first, Opened):
            return with_affinity(sse_response(_relay(line)), public)
        line.hang_up()
        if isinstance(first, Answer):
            return with_affinity(first.response, public)
        if isinstance(first, Failed):
            return error_response(_as_sent(first.error, public))
        raise AssertionError(f"a session actor answered {first!r} first")

    return store


async def _ask(line: TurnLine, order: RunTurn) -> TurnOutput:
    """Hand the turn to its actor; its first output."""
    try:
        await line.inbox.send(order)
        return await line.replies.receive()
    except (trio.BrokenResourceError, trio.EndOfChannel):  # the actor ended: the app is stopping
        return Failed(EngineClosed("the server is shutting down"))


async def _relay(line: TurnLine) -> AsyncIterator[bytes]:
    """The streamed turn's body: each chunk asked of the session actor when
    the last one has gone out. Closing it (the client left) hangs up, and
    the actor cancels the turn. A turn that fails once its stream began
    (its commit refused by the state store: a full disk, a state file gone)
    ends with an error event in the chat stream's shape, then [DONE]: the
    turn was cancelled, nothing committed."""
    try:
        while True:
            try:
                await line.inbox.send(Pull())
                out = await line.replies.receive()
            except (trio.BrokenResourceError, trio.EndOfChannel):
                return  # the actor is done: that was the last chunk
            if isinstance(out, Failed):
                _, body, _ = to_response(out.error)
                yield openai.sse(body)
                yield openai.sse("[DONE]")
                return
            assert isinstance(out, Chunk), out
            yield out.data
    finally:
        line.hang_up()


def _history_message(message: dict) -> dict:
    """The reply as the history keeps it: content and calls, not reasoning."""
    kept = {"role": "assistant", "content": message["content"] or ""}
    if "tool_calls" in message:
        kept["tool_calls"] = message["tool_calls"]
    return kept


def scoped_id(chosen: str) -> str:
    """The store's key for a session id a client chose (X-Session-Id): the
    tenant's name and the id, so each tenant has its own names (one cannot
    learn, take or lock out another's); the id itself without API keys.
    Ids the server makes are random and taken as they are."""
    owner = tenant()
    return f"{owner}/{chosen}" if owner else chosen


def public_id(key: str) -> str:
    """The id a client knows for the store's ``key`` (`scoped_id` undone:
    neither an id nor a tenant name holds a '/')."""
    return key.partition("/")[2] or key


async def _find(store: SessionStore, session_id: str) -> str:
    """The store's key for the id in a request's path: the tenant's own
    chosen id when there is one, else the id as it is (the server's random
    ids, and sessions from before ids were scoped; the owner check on each
    use keeps another tenant's out, as a 404)."""
    key = scoped_id(session_id)
    if key != session_id:
        await synced(store, key)
        if key in store:
            return key
    await synced(store, session_id)
    return session_id


def _as_sent(exc: BaseException, public: str) -> BaseException:
    """``exc`` with the store's key in its message shown as the id the client sent."""
    key = scoped_id(public)
    if key != public and isinstance(exc, (SessionBusy, SessionNotFound)) and repr(key) in str(exc):
        return type(exc)(str(exc).replace(repr(key), repr(public)))
    return exc


def _describe(session: Session) -> dict:
    return {
        "id": public_id(session.id),
        "object": "session",
        "model": session.model,
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
