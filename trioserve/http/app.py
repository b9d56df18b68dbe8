"""The quart-trio application: OpenAI-compatible routes over one engine.

`create_app(settings)` builds a fresh app (an app object can be served only
once). The engine starts in the app's nursery before serving and stops after.
Each request is handled by its own task (the connection): it validates the
body, submits to the engine, and turns events into one JSON body or SSE
chunks. A client disconnect cancels the handler, which closes the engine's
event stream, which cancels the request within one engine step."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import aclosing

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import RequestEntityTooLarge

from trioserve.actors.messages import FinalEvent, GenerateRequest
from trioserve.config import ServerSettings, settings_from_env
from trioserve.engine import Engine, open_engine
from trioserve.errors import EngineClosed, RequestError, RequestTooLarge
from trioserve.http import openai, prometheus
from trioserve.http.errors import HTTPError, to_response
from trioserve.http.write_timeout import WriteTimeout
from trioserve.http.schemas import parse_chat_request, parse_completion_request, sampling_params
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.sampling import SEED_LIMIT
from trioserve.progress import ProgressBar


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

    def ready(self) -> Engine:
        if self.phase == "draining":
            raise EngineClosed("the server is shutting down")
        if self.engine is None:
            raise HTTPError(503, "the model is still loading", kind="server_error", code="loading")
        return self.engine


async def _serve_engine(state: ServerState, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with state.engine_scope:
        async with open_engine(state.settings.engine, progress=ProgressBar("Loading weights")) as engine:
            tok = engine.tokenizer
            state.template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
            state.engine = engine
            state.phase = "ok"
            task_status.started()
            await trio.sleep_forever()


def _json(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=status, headers=headers or {}, mimetype="application/json")


def _error(exc: Exception) -> Response:
    status, body, headers = to_response(exc)
    return _json(body, status, headers)


async def _body(limit: int) -> object:
    try:
        raw = await request.get_data(cache=False)
    except RequestEntityTooLarge:
        raise HTTPError(413, f"the request body is larger than {limit} bytes", code="body_too_large") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"the request body is not valid JSON: {exc}") from exc


def _seed_for(params, index: int):
    """Choice ``index`` of n: seed + index, so every choice is reproducible."""
    if params.seed is None or index == 0:
        return params
    return attrs.evolve(params, seed=(params.seed + index) % SEED_LIMIT)


def create_app(settings: ServerSettings | None = None) -> QuartTrio:
    """A new app. Without ``settings``, they come from TRIOSERVE_* variables,
    so `hypercorn -k trio 'trioserve.http.app:create_app()'` is configurable."""
    settings = settings or settings_from_env(dict(os.environ))
    app = QuartTrio("trioserve")
    app.asgi_app = WriteTimeout(app.asgi_app, settings.write_timeout_s)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = 1
    state = ServerState(settings)
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
            given = request.headers.get("Authorization", "")
            if given != f"Bearer {settings.api_key}":
                return _error(HTTPError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", kind="authentication_error", code="invalid_api_key"))
        return None

    @app.after_request
    async def cors(response: Response) -> Response:
        response.headers["Access-Control-Allow-Origin"] = "*"
        response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        return response

    @app.errorhandler(413)
    async def too_large(_exc) -> Response:
        # Bodies are read inside the routes (see _body); this covers any other reader.
        return _error(HTTPError(413, f"the request body is larger than {settings.max_body_bytes} bytes", code="body_too_large"))

    @app.errorhandler(404)
    async def not_found(_exc) -> Response:
        return _error(HTTPError(404, f"no route {request.method} {request.path}", code="not_found"))

    @app.errorhandler(405)
    async def bad_method(_exc) -> Response:
        return _error(HTTPError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed"))

    @app.route("/health")
    async def health() -> Response:
        if state.engine is not None and state.engine.statistics().dead:
            return _json({"status": "dead", "cause": state.engine.statistics().dead}, 503)
        if state.phase != "ok":
            return _json({"status": state.phase}, 503)
        return _json({"status": "ok"})

    @app.route("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [_model_card(state)]})

    @app.route("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id != state.model_name:
            return _error(HTTPError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"))
        return _json(_model_card(state))

    @app.route("/metrics")
    async def metrics() -> Response:
        engine = state.engine
        if engine is None:
            return _json({"status": state.phase})
        return _json(_stats_body(engine))

    @app.route("/metrics/prometheus")
    async def metrics_prometheus() -> Response:
        if state.engine is None:
            return _error(HTTPError(503, "the model is still loading", kind="server_error", code="loading"))
        text = prometheus.render(state.engine.statistics(), state.model_name)
        return Response(text, mimetype="text/plain; version=0.0.4")

    @app.route("/v1/chat/completions", methods=["POST"])
    async def chat() -> Response:
        try:
            engine = state.ready()
            req = parse_chat_request(await _body(settings.max_body_bytes))
            _check_model(state, req.model)
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            prompt_ids = engine.tokenizer.encode(state.template.render(messages, add_generation_prompt=True))
            params = sampling_params(req, default_max_tokens=_default_max_tokens(engine, prompt_ids, "messages", settings.default_max_tokens))
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return _error(exc)
        job = _Job(state, engine, "chat", prompt_ids, params, req.n, req.logprobs, prompt_text="", echo=False)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await job.stream(include_usage)
        return await job.collect()

    @app.route("/v1/completions", methods=["POST"])
    async def completions() -> Response:
        try:
            engine = state.ready()
            req = parse_completion_request(await _body(settings.max_body_bytes))
            _check_model(state, req.model)
            prompts = _completion_prompts(engine, req.prompt)
            if len(prompts) != 1:
                raise HTTPError(400, "only one prompt per request is supported; send a string or one list of token ids", param="prompt")
            prompt_text, prompt_ids = prompts[0]
            params = sampling_params(req, default_max_tokens=_default_max_tokens(engine, prompt_ids, "prompt", settings.default_max_tokens))
        except Exception as exc:  # noqa: BLE001
            return _error(exc)
        job = _Job(state, engine, "text", prompt_ids, params, req.n, req.logprobs is not None, prompt_text=prompt_text, echo=req.echo)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await job.stream(include_usage)
        return await job.collect()

    return app


def _model_card(state: ServerState) -> dict:
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "trioserve"}
    if state.engine is not None:
        card["max_model_len"] = state.engine.max_model_len
    return card


def _check_model(state: ServerState, name: str | None) -> None:
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


def _completion_prompts(engine: Engine, prompt) -> list[tuple[str, list[int]]]:
    """(text, ids) of each prompt; token ids are checked before decoding."""
    if isinstance(prompt, str):
        return [(prompt, engine.tokenizer.encode(prompt))]
    if prompt and all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, engine.tokenizer.encode(p)))
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
        "finished": dict(s.finished),
        "queue_wait": lat(s.queue_wait),
        "ttft": lat(s.ttft),
        "inter_token": lat(s.inter_token),
        "end_to_end": lat(s.end_to_end),
        "dead": s.dead,
    }


class _Job:
    """One HTTP request's generations (n of them) and their rendering."""

    def __init__(self, state, engine, kind, prompt_ids, params, n, logprobs, *, prompt_text: str, echo: bool):
        self.state = state
        self.engine = engine
        self.kind = kind  # "chat" or "text"
        self.prompt_ids = prompt_ids
        self.params = params
        self.n = n
        self.logprobs = logprobs
        self.prompt_text = prompt_text
        self.echo = echo
        self.id = openai.new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = openai.now()
        self.model = state.model_name

    def _request(self, index: int) -> GenerateRequest:
        return GenerateRequest(self.prompt_ids, _seed_for(self.params, index))

    async def _run_choice(self, index: int, choice: openai.Choice) -> None:
        async with aclosing(self.engine.generate(self._request(index))) as events:
            async for event in events:
                choice.add(event)

    async def collect(self) -> Response:
        choices = [openai.Choice(i) for i in range(self.n)]
        failure: list[Exception] = []
        try:
            async with trio.open_nursery() as nursery:
                for c in choices:
                    nursery.start_soon(self._run_choice, c.index, c)
        except* Exception as group:
            failure.append(group.exceptions[0])
        if failure:
            return _error(failure[0])
        failed = [c for c in choices if c.final.finish_reason == "error"]
        if failed:
            return _error(HTTPError(503 if self.engine.statistics().dead else 500, failed[0].final.error or "generation failed", kind="server_error"))
        if self.kind == "chat":
            return _json(openai.chat_body(self.id, self.created, self.model, choices, len(self.prompt_ids), self.engine.tokenizer, self.logprobs))
        body = openai.envelope("text_completion", self.id, self.created, self.model)
        body["choices"] = [
            {
                "index": c.index,
                "text": (self.prompt_text if self.echo else "") + c.content,
                "logprobs": openai.completion_logprobs(self.engine.tokenizer, c.tokens, len(self.prompt_text) if self.echo else 0) if self.logprobs else None,
                "finish_reason": c.final.finish_reason,
            }
            for c in choices
        ]
        body["usage"] = openai.usage_body(len(self.prompt_ids), sum(c.final.usage.completion_tokens for c in choices))
        return _json(body)

    async def stream(self, include_usage: bool) -> Response:
        # Submit the first choice now, so a refusal (queue full, too long) is
        # an ordinary error response rather than an error inside the stream.
        first = aclosing(self.engine.generate(self._request(0)))
        events = await first.__aenter__()
        try:
            head = await events.__anext__()
        except BaseException as exc:
            await first.__aexit__(None, None, None)
            if isinstance(exc, Exception):
                return _error(exc)
            raise
        body = self._sse(first, head, include_usage)
        response = Response(body, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
        response.timeout = None
        return response

    async def _sse(self, first, head, include_usage: bool) -> AsyncIterator[bytes]:
        """Chunks for every choice, then usage and [DONE]. With n > 1 the
        choices stream one after another, each chunk carrying its index."""
        completion_tokens = 0
        async with first as events:
            if self.kind == "chat":
                for i in range(self.n):
                    yield openai.sse(openai.chat_chunk(self.id, self.created, self.model, i, {"role": "assistant", "content": ""}))
            elif self.echo:
                for i in range(self.n):
                    yield openai.sse(openai.completion_chunk(self.id, self.created, self.model, i, self.prompt_text))
            pending = [head]
            async for event in _chain(pending, events):
                for chunk, done_tokens in self._render(0, event):
                    completion_tokens += done_tokens
                    yield chunk
        for index in range(1, self.n):
            async with aclosing(self.engine.generate(self._request(index))) as more:
                async for event in more:
                    for chunk, done_tokens in self._render(index, event):
                        completion_tokens += done_tokens
                        yield chunk
        if include_usage:
            kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            yield openai.sse(openai.usage_chunk(kind, self.id, self.created, self.model, len(self.prompt_ids), completion_tokens))
        yield openai.sse("[DONE]")

    def _render(self, index: int, event):
        tok = self.engine.tokenizer
        if isinstance(event, FinalEvent):
            if event.finish_reason == "error":
                _, body, _ = to_response(HTTPError(500, event.error or "generation failed", kind="server_error"))
                yield openai.sse(body), event.usage.completion_tokens
                return
            if self.kind == "chat":
                if event.text:
                    yield openai.sse(openai.chat_chunk(self.id, self.created, self.model, index, {"content": event.text})), 0
                yield openai.sse(openai.chat_chunk(self.id, self.created, self.model, index, {}, event.finish_reason)), event.usage.completion_tokens
            else:
                yield openai.sse(openai.completion_chunk(self.id, self.created, self.model, index, event.text, event.finish_reason)), event.usage.completion_tokens
            return
        if self.kind == "chat":
            lp = openai.chat_logprob_entries(tok, [event]) if self.logprobs else None
            yield openai.sse(openai.chat_chunk(self.id, self.created, self.model, index, {"content": event.text}, None, lp)), 0
        else:
            lp = openai.completion_logprobs(tok, [event], 0) if self.logprobs else None
            yield openai.sse(openai.completion_chunk(self.id, self.created, self.model, index, event.text, None, lp)), 0


async def _chain(pending: list, events) -> AsyncIterator:
    for event in pending:
        yield event
    async for event in events:
        yield event

