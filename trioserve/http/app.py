"""The quart-trio application: OpenAI-compatible routes over one engine.

`create_app(settings)` builds a fresh app (an app object can be served only
once). The engine starts in the app's nursery before serving and stops after;
so do the session actors (trioserve/actors/session.py), inside its block.
Each request is handled by its own task (the connection): it validates the
body, submits to the engine, and turns events into one JSON body or SSE
chunks. A client disconnect cancels the handler, which closes the engine's
event stream, which cancels the request within one engine step."""

from __future__ import annotations

import json
import os
import re
import sys

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import RequestEntityTooLarge

from trioserve.actors.session import SessionActors, open_session_actors
from trioserve.http.connection import Connection
from trioserve.config import ServerSettings, settings_from_env
from trioserve.engine import Engine, describe_compute, open_engine
from trioserve.errors import EngineClosed, RequestError, RequestTooLarge
from trioserve.http import openai, prometheus
from trioserve.http.embeddings import add_embedding_routes
from trioserve.http.errors import HTTPError, error_response, json_response
from trioserve.http.schemas import check_json_body, parse_chat_request, parse_completion_request, sampling_params, tools_offered
from trioserve.http.responses import add_response_routes
from trioserve.http.sessions import add_session_routes
from trioserve.http.tools import compile_guides, message_dict, off_loop, render_prompt_ids
from trioserve.http.guard import bearer_matches, form_content_type
from trioserve.http.in_flight import InFlight
from trioserve.models.output_parser import THINK_OPEN, OutputParser
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import Checkpoint
from trioserve.progress import ProgressBar

# A session actor waits this long past the write timeout for its handler to
# ask for the next chunk (a write takes at most the write timeout; past it
# the connection is aborted and the handler closes its ends anyway).
PULL_GRACE_S = 5.0


class ServerState:
    """What the routes share: the engine once it is up, and the server's phase."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: Engine | None = None
        self.template: ChatTemplate | None = None
        self.model_name = settings.served_model_name or settings.engine.model
        self.phase = "loading"  # loading -> ok -> draining; or dead
        self.created = openai.now()
        self.engine_scope = trio.CancelScope()
        self.requests = None  # the InFlight middleware, which counts HTTP requests in flight
        self.checkpoint: Checkpoint | None = None  # preloaded, or None to load settings.engine.model
        self.sessions = None  # the SessionStore, made with the session routes
        self.responses = None  # the stored responses (a SessionStore too), made with their routes
        self.turns: SessionActors | None = None  # starts session actors while the engine runs
        self.reasoning = False  # split <think> reasoning out of replies

    def parsers(self, job, tools, choice) -> None:
        """Give ``job``'s chat choices an output parser when there is
        anything to split out: tool calls (tools offered) or reasoning."""
        calls = tools_offered(tools, choice)
        job.calls_possible = calls
        if calls or self.reasoning:
            suffix = re.split("[-_]", job.id)[-1][:12]  # the id's random part (chatcmpl-..., resp_...)
            job.parser_factory = lambda i: OutputParser(tools=calls, reasoning=self.reasoning, call_id_prefix=f"call_{suffix}{i}")

    def ready(self) -> Engine:
        if self.phase == "draining":
            raise EngineClosed("the server is shutting down")
        if self.engine is None:
            raise HTTPError(503, "the model is still loading", kind="server_error", code="loading")
        return self.engine


async def _serve_engine(state: ServerState, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with state.engine_scope:
        progress = None if state.checkpoint is not None else ProgressBar("Loading weights")
        building = ProgressBar("Building the model", unit="layers")
        async with open_engine(state.settings.engine, checkpoint=state.checkpoint, progress=progress, build_progress=building) as engine:
            building.finish()
            tok = engine.tokenizer
            state.template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
            mode = state.settings.reasoning_parser
            state.reasoning = mode == "on" or (mode == "auto" and len(tok.encode(THINK_OPEN, add_bos=False)) == 1)
            # The session actors live inside the engine's block: when the app
            # stops, their turns end first (cancelled, nothing committed).
            pull_timeout_s = state.settings.write_timeout_s + PULL_GRACE_S
            async with open_session_actors(state.sessions, engine, pull_timeout_s=pull_timeout_s) as turns:
                state.turns = turns
                state.engine = engine
                print(f"trioserve: computing on {describe_compute(engine.compute)}", file=sys.stderr, flush=True)
                if engine.trace_path is not None:
                    print(f"trioserve: recording engine inputs to {engine.trace_path}", file=sys.stderr, flush=True)
                state.phase = "ok"
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    state.turns = None


async def _body(limit: int) -> object:
    """The request's JSON body, decoded and passed through check_json_body
    (no lone surrogates, bounded nesting), or an HTTPError/RequestError for
    the client. Bodies over 64 KiB are decoded in a thread (`off_loop`)."""
    try:
        raw = await request.get_data(cache=False)
    except RequestEntityTooLarge:
        raise HTTPError(413, f"the request body is larger than {limit} bytes", code="body_too_large") from None

    def decode() -> object:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge ints, deep nesting
            raise HTTPError(400, f"the request body is not valid JSON: {exc}") from exc
        check_json_body(body)
        return body

    return decode() if len(raw) <= 64 << 10 else await off_loop(decode)


def create_app(settings: ServerSettings | None = None, *, checkpoint: Checkpoint | None = None) -> QuartTrio:
    """A new app. Without ``settings``, they come from TRIOSERVE_* variables,
    so `hypercorn -k trio 'trioserve.http.app:create_app()'` is configurable.
    A ``checkpoint`` already loaded is served instead of loading one."""
    settings = settings or settings_from_env(dict(os.environ))
    app = QuartTrio("trioserve")
    # The write, read and keep-alive deadlines live in the transport
    # (trioserve/http/transport.py); this counts requests for the drain.
    in_flight = InFlight(app.asgi_app)
    app.asgi_app = in_flight
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = 1
    state = ServerState(settings)
    state.checkpoint = checkpoint
    state.requests = in_flight
    app.extensions["trioserve"] = state

    @app.before_serving
    async def start_engine() -> None:
        await app.nursery.start(_serve_engine, state)

    @app.after_serving
    async def stop_engine() -> None:
        state.engine_scope.cancel()

    @app.before_request
    async def guard():
        if request.method == "OPTIONS":
            return None
        if settings.api_key and request.path.startswith("/v1"):
            if not bearer_matches(request.headers.get("Authorization", ""), settings.api_key):
                return error_response(HTTPError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", kind="authentication_error", code="invalid_api_key"))
        if request.method == "POST":
            # A form-like type lets any web page post here cross-origin with no CORS preflight.
            refused = form_content_type(request.headers.get("Content-Type", ""))
            if refused is not None:
                return error_response(HTTPError(415, f"request bodies must be JSON: send 'Content-Type: application/json' (got {refused})", code="unsupported_media_type"))
        return None

    @app.after_request
    async def cors(response: Response) -> Response:
        response.headers["Access-Control-Allow-Origin"] = "*"
        response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
        if state.phase == "draining":
            # Send clients elsewhere rather than back on this connection: a
            # client reusing it from its pool would meet a bare disconnect
            # when the server goes instead of this 503.
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(413)
    async def too_large(_exc) -> Response:
        # Bodies are read inside the routes (see _body); this covers any other reader.
        return error_response(HTTPError(413, f"the request body is larger than {settings.max_body_bytes} bytes", code="body_too_large"))

    @app.errorhandler(404)
    async def not_found(_exc) -> Response:
        return error_response(HTTPError(404, f"no route {request.method} {request.path}", code="not_found"))

    @app.errorhandler(405)
    async def bad_method(_exc) -> Response:
        return error_response(HTTPError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed"))

    @app.route("/health")
    async def health() -> Response:
        if state.engine is not None and state.engine.statistics().dead:
            return json_response({"status": "dead", "cause": state.engine.statistics().dead}, 503)
        if state.phase != "ok":
            return json_response({"status": state.phase}, 503)
        return json_response({"status": "ok"})

    @app.route("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [_model_card(state)]})

    @app.route("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id != state.model_name:
            return error_response(HTTPError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"))
        return json_response(_model_card(state))

    @app.route("/metrics")
    async def metrics() -> Response:
        engine = state.engine
        if engine is None:
            return json_response({"status": state.phase})
        body = _stats_body(engine)
        body["sessions"] = state.sessions.stats()
        body["responses"] = {k: v for k, v in state.responses.stats().items() if k in ("active", "evicted")}  # stored ones
        return json_response(body)

    @app.route("/metrics/prometheus")
    async def metrics_prometheus() -> Response:
        if state.engine is None:
            return error_response(HTTPError(503, "the model is still loading", kind="server_error", code="loading"))
        text = prometheus.render(state.engine.statistics(), state.model_name, batch_invariant=state.engine.config.batch_invariant)
        return Response(text, mimetype="text/plain; version=0.0.4")

    @app.route("/v1/chat/completions", methods=["POST"])
    async def chat() -> Response:
        try:
            engine = state.ready()
            req = await off_loop(parse_chat_request, await _body(settings.max_body_bytes))
            _check_model(state, req.model)
            _check_n(engine, req.n)
            messages = map(message_dict, req.messages)  # made in the thread that renders them
            prompt_ids = await off_loop(render_prompt_ids, engine.tokenizer, state.template, messages, req.tools, req.tool_choice)
            params = sampling_params(req, default_max_tokens=_default_max_tokens(engine, prompt_ids, "messages", settings.default_max_tokens))
            guides = await compile_guides(engine, req, req.n)
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return error_response(exc)
        job = Connection(state, engine, "chat", prompt_ids, params, req.n, req.logprobs, prompt_text="", echo=False)
        job.guides = guides
        if req.tool_choice is not None and req.tool_choice.mode in ("required", "function"):
            job.role_content = None
        state.parsers(job, req.tools, req.tool_choice)
        return await job.respond(req.stream, req.stream_options)

    @app.route("/v1/completions", methods=["POST"])
    async def completions() -> Response:
        try:
            engine = state.ready()
            req = await off_loop(parse_completion_request, await _body(settings.max_body_bytes))
            _check_model(state, req.model)
            # A list of prompts is that many independent prompts, n choices
            # each; counted before any is tokenized.
            _check_n(engine, req.n, _prompt_count(req.prompt))
            prompts = await off_loop(_completion_prompts, engine, req.prompt, settings.allow_special_in_prompt)
            each = [
                (text, ids, sampling_params(req, default_max_tokens=_default_max_tokens(engine, ids, "prompt", settings.default_max_tokens)))
                for text, ids in prompts
            ]
            guides = await compile_guides(engine, req, req.n * len(prompts))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        (prompt_text, prompt_ids, params), *more = each
        job = Connection(
            state, engine, "text", prompt_ids, params, req.n, req.logprobs is not None, prompt_text=prompt_text, echo=req.echo, more_prompts=more
        )
        job.guides = guides
        return await job.respond(req.stream, req.stream_options)

    state.sessions = add_session_routes(
        app, state, lambda: _body(settings.max_body_bytes), _default_max_tokens, _check_model
    )
    add_embedding_routes(app, state, lambda: _body(settings.max_body_bytes), _check_model)
    state.responses = add_response_routes(app, state, lambda: _body(settings.max_body_bytes), _default_max_tokens, _check_model)
    return app


def _model_card(state: ServerState) -> dict:
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "trioserve"}
    if state.engine is not None:
        card["max_model_len"] = state.engine.max_model_len
        card["batch_invariant"] = state.engine.config.batch_invariant
        card["activations"] = state.engine.activations
        card["compute"] = state.engine.compute
    return card


def _check_model(state: ServerState, name: object) -> None:
    if name is not None and not isinstance(name, str):
        raise RequestError(f"model: expected a string, got {type(name).__name__}", field="model")
    if name is not None and name != state.model_name:
        raise HTTPError(404, f"the model {name!r} does not exist (this server serves {state.model_name!r})", param="model", code="model_not_found")


def _default_max_tokens(engine: Engine, prompt_ids: list[int], field: str, cap: int) -> int:
    """max_tokens for a request that did not send one: the rest of the
    context, but no more than ``cap`` nor than the whole KV pool can hold
    beside the prompt (admission reserves prompt + max_tokens)."""
    room = engine.max_model_len - len(prompt_ids)
    if room < 1:
        raise RequestTooLarge(
            f"the prompt has {len(prompt_ids)} tokens; the maximum model length is {engine.max_model_len}", field=field
        )
    stats = engine.statistics()
    pool_room = stats.kv_blocks_total * stats.block_size - len(prompt_ids)
    return max(1, min(room, cap, pool_room))


def _check_n(engine: Engine, n: int, prompts: int = 1) -> None:
    """n choices of each prompt are that many requests; more than the queue
    holds could never all be accepted, so say so instead of answering 429
    forever."""
    limit = engine.config.max_queue
    if n > limit:
        raise RequestError(f"n ({n}) is more than this server queues at once ({limit}, --max-queue)", field="n")
    if n * prompts > limit:
        raise RequestError(
            f"{prompts} prompts x n ({n}) = {n * prompts} choices, more than this server queues at once ({limit}, --max-queue)",
            field="prompt",
        )


def _prompt_count(prompt) -> int:
    """How many prompts a parsed `prompt` field holds: a string or one list
    of token ids is one."""
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def _completion_prompts(engine: Engine, prompt, special: bool) -> list[tuple[str, list[int]]]:
    """(text, ids) of each prompt; token ids are checked before decoding.
    Text is tokenized as text unless ``special`` (--allow-special-in-prompt):
    then special-token text becomes its id. Token ids are taken as sent.
    Blocking: the route runs it in a thread."""
    if isinstance(prompt, str):
        return [(prompt, engine.tokenizer.encode(prompt, special=special))]
    if prompt and all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, engine.tokenizer.encode(p, special=special)))
            continue
        ids = list(p)
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", field="prompt")
        out.append((engine.tokenizer.decode(ids), ids))
    return out


def _stats_body(engine: Engine) -> dict:
    s = engine.statistics()

    def lat(x):
        return {"count": x.count, "sum_s": x.total_s, "mean_s": x.mean_s}

    return {
        "running": s.running,
        "waiting": s.waiting,
        "kv_blocks_used": s.kv_blocks_used,
        "kv_blocks_total": s.kv_blocks_total,
        "kv_usage": s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
        "steps": s.steps,
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "speculative": {
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.draft_accepted,
            "acceptance_rate": s.draft_accepted / s.draft_tokens if s.draft_tokens else 0.0,
        },
        "finished": dict(s.finished),
        "queue_wait": lat(s.queue_wait),
        "ttft": lat(s.ttft),
        "inter_token": lat(s.inter_token),
        "end_to_end": lat(s.end_to_end),
        "dead": s.dead,
        "batch_invariant": engine.config.batch_invariant,
        "activations": engine.activations,  # what the 4-bit projections take (what --activations auto chose)
        "compute": engine.compute,  # device, dtype, kernels, the C kernels' instruction sets, threads
        "prefix_cache": None
        if s.prefix is None
        else {
            "query_tokens": s.prefix.query_tokens,
            "hit_tokens": s.prefix.hit_tokens,
            "hit_rate": s.prefix.hit_rate,
            "cached_blocks": s.prefix.cached_blocks,
            "idle_blocks": s.prefix.idle_blocks,
            "registered_tokens": s.prefix.registered_tokens,
            "evictions": s.prefix.evictions,
            "pinned_blocks": s.prefix.pinned_blocks,
            "pinned_owners": s.prefix.pinned_owners,
            "pin_evictions": s.prefix.pin_evictions,
        },
    }
