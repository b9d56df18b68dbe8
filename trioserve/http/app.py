"""The quart-trio application: OpenAI-compatible routes over one engine.

`create_app(settings)` builds a fresh app (an app object can be served only
once). Its models' engines (the registry: http/registry.py) start in the
app's nursery before serving and stop after; so do the session actors
(trioserve/actors/session.py), inside the registry's block.
Each route module adds its routes (completions, sessions, embeddings,
responses, status); each request is handled by its own task: its route
reads the body into a job (http/job.py), and the connection
(http/connection.py) submits it to the engine and turns the events into
one JSON body or SSE chunks. A client disconnect cancels the handler, which
closes the engine's event stream, which cancels the request within one
engine step."""

from __future__ import annotations

import os
import signal
import sys

import trio
from quart import Response, g, request
from quart_trio import QuartTrio

from trioserve.actors.session import open_session_actors
from trioserve.config import ServerSettings, settings_from_env
from trioserve.errors import sole_error
from trioserve.http.admin import add_admin_routes
from trioserve.http.completions import add_completion_routes
from trioserve.http.edge import ServerState
from trioserve.http.embeddings import add_embedding_routes
from trioserve.http.errors import HTTPError, error_response
from trioserve.http.guard import allowed_origins, cors_origin, not_json, refused_content_type
from trioserve.http.in_flight import InFlight, at_request_end
from trioserve.http.lora import add_lora_routes
from trioserve.http.messages import add_message_routes
from trioserve.http.page import add_page_routes
from trioserve.http.registry import fix_mmap_threshold, load_startup_models, open_registry
from trioserve.http.rerank import add_rerank_routes
from trioserve.http.responses import add_response_routes
from trioserve.http.sessions import add_session_routes
from trioserve.http.tenants import MISSING_KEY, Tenants, TenantsError, TooManyInFlight
from trioserve.http.status import add_status_routes
from trioserve.http.tokenize import TOKENIZER_PATHS, add_tokenizer_routes
from trioserve.models.checkpoint import Checkpoint
from trioserve.state.durable import Rows, open_store

# A session actor waits this long past the write timeout for its handler to
# ask for the next chunk (a write takes at most the write timeout; past it
# the connection is aborted and the handler closes its ends anyway).
PULL_GRACE_S = 5.0


async def _serve_models(state: ServerState, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    try:
        await _run_models(state, task_status=task_status)
    except BaseExceptionGroup as group:  # a start-up model that failed to load: its own error, as one line
        raise sole_error(group) from None


async def _open_state(state: ServerState) -> Rows | None:
    """The durable state store (--state-dir or --state-url), opened and read
    back into the sessions and stored responses; None when state is kept
    in memory only."""
    settings = state.settings
    db = await trio.to_thread.run_sync(open_store, settings.state_dir, settings.state_url, os.environ)
    if db is None:
        return None
    rows = await trio.to_thread.run_sync(db.load)
    now = trio.current_time()
    for store in (state.sessions, state.responses):
        store.journal = db
        store.restore(rows, now)
    print(f"trioserve: state in {db.name} ({len(state.sessions)} sessions, {len(state.responses)} stored responses)", file=sys.stderr, flush=True)
    return db


async def _run_models(state: ServerState, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    db = await _open_state(state)
    try:
        await _serve_registry(state, task_status=task_status)
    finally:
        if db is not None:
            for store in (state.sessions, state.responses):
                store.journal = None
            db.close()


async def _serve_registry(state: ServerState, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with state.engine_scope:
        # The engines run in the registry's nursery; the session actors in
        # one inside it: when the app stops, their turns end first
        # (cancelled, nothing committed), then the engines.
        async with open_registry(state.settings) as registry:
            pull_timeout_s = state.settings.write_timeout_s + PULL_GRACE_S
            async with open_session_actors(state.sessions, pull_timeout_s=pull_timeout_s) as turns:
                state.turns = turns
                state.registry = registry
                try:
                    await load_startup_models(registry, state.checkpoint)
                    state.checkpoint = None  # the engine holds what it needs
                    state.phase = "ok"
                    task_status.started()
                    await trio.sleep_forever()
                finally:
                    state.turns = None


async def _reload_keys_on_hangup(tenants: Tenants) -> None:
    """Read --api-keys-file again at each SIGHUP; a file that cannot be
    used leaves the keys as they were, and says why on stderr."""
    try:
        receiver = trio.open_signal_receiver(signal.SIGHUP)
    except RuntimeError:  # not the main thread (an app embedded elsewhere): no signals here
        return
    with receiver as hangups:
        async for _ in hangups:
            try:
                tenants.reload()
            except TenantsError as exc:
                print(f"trioserve: {exc}; the API keys stay as they were", file=sys.stderr, flush=True)
            else:
                print(f"trioserve: API keys read again from {tenants.keys_file} ({len(tenants.names)} tenants)", file=sys.stderr, flush=True)


def create_app(settings: ServerSettings | None = None, *, checkpoint: Checkpoint | None = None) -> QuartTrio:
    """A new app. Without ``settings``, they come from TRIOSERVE_* variables,
    so `hypercorn -k trio 'trioserve.http.app:create_app()'` is configurable.
    A ``checkpoint`` already loaded is served instead of loading one."""
    settings = settings or settings_from_env(dict(os.environ))
    fix_mmap_threshold()  # so an unloaded model's memory goes back to the system (registry.release_memory)
    app = QuartTrio("trioserve")
    # The write, read and keep-alive deadlines live in the transport
    # (trioserve/http/transport.py); this counts requests for the drain.
    in_flight = InFlight(app.asgi_app)
    app.asgi_app = in_flight
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = 1
    state = ServerState(settings, checkpoint=checkpoint, requests=in_flight)
    app.extensions["trioserve"] = state

    @app.before_serving
    async def start_engine() -> None:
        await app.nursery.start(_serve_models, state)
        if settings.api_keys_file is not None:
            app.nursery.start_soon(_reload_keys_on_hangup, state.tenants)

    @app.after_serving
    async def stop_engine() -> None:
        state.engine_scope.cancel()

    tenants = state.tenants
    cors_origins = allowed_origins(settings.cors_origins)

    @app.before_request
    async def guard():
        if request.method == "OPTIONS":
            return None
        path = request.path
        keyed = path.startswith("/v1") or path in TOKENIZER_PATHS  # the API, and the tokenizer routes beside it
        if keyed or (path.startswith("/metrics") and not settings.metrics_public):
            headers = request.headers
            tenant = tenants.identify(headers.get("Authorization", ""), headers.get("X-Api-Key", ""))
            if tenant is None:
                return error_response(HTTPError(401, MISSING_KEY, kind="authentication_error", code="invalid_api_key"))
            g.tenant = tenant
            if keyed:
                try:
                    tenants.enter(tenant)
                except TooManyInFlight as exc:
                    return error_response(HTTPError(429, str(exc), kind="rate_limit_error", code="tenant_busy", headers={"Retry-After": "1"}))
                at_request_end(lambda: tenants.leave(tenant))
        if request.method == "POST":
            # A form-like type lets any web page post here cross-origin with no CORS preflight.
            refused = refused_content_type(request.headers.get("Content-Type", ""), request.headers.get("Origin"))
            if refused is not None:
                return error_response(not_json(refused))
        return None

    @app.after_request
    async def cors(response: Response) -> Response:
        origin = cors_origin(cors_origins, request.headers.get("Origin"))
        if origin is not None:  # only for the origins --cors-origins lists
            response.headers["Access-Control-Allow-Origin"] = origin
            if origin != "*":
                response.vary.add("Origin")
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type, X-Session-Id, X-Api-Key, Anthropic-Version"
            response.headers["Access-Control-Expose-Headers"] = "X-Session-Id"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
        if state.phase == "draining":
            # Send clients elsewhere rather than back on this connection: a
            # client reusing it from its pool would meet a bare disconnect
            # when the server goes instead of this 503.
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(413)
    async def too_large(_exc) -> Response:
        # Bodies are read inside the routes (edge.read_body); this covers any other reader.
        return error_response(HTTPError(413, f"the request body is larger than {settings.max_body_bytes} bytes", code="body_too_large"))

    @app.errorhandler(404)
    async def not_found(_exc) -> Response:
        return error_response(HTTPError(404, f"no route {request.method} {request.path}", code="not_found"))

    @app.errorhandler(405)
    async def bad_method(_exc) -> Response:
        return error_response(HTTPError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed"))

    add_page_routes(app, state)
    add_status_routes(app, state)
    add_admin_routes(app, state)
    add_lora_routes(app, state)
    add_completion_routes(app, state)
    state.sessions = add_session_routes(app, state)
    add_embedding_routes(app, state)
    add_rerank_routes(app, state)
    state.responses = add_response_routes(app, state)
    add_message_routes(app, state)
    add_tokenizer_routes(app, state)
    return app
