"""What the server says about itself: GET /health, /v1/models,
/v1/models/{id}, /metrics (JSON) and /metrics/prometheus."""

from __future__ import annotations

from quart import Response

from trioserve.http import prometheus
from trioserve.http.edge import ServerState, tenant
from trioserve.http.errors import HTTPError, error_response, json_response


def add_status_routes(app, state: ServerState) -> None:
    @app.route("/health")
    async def health() -> Response:
        """200 ok while some model serves, listing the dead ones beside it
        ({"status": "ok", "dead": {name: cause}}); 503 dead (with the first
        cause, and each) once models are dead and none is ready, so a load
        balancer stops sending to a server that can answer nothing; 503
        loading or draining by the server's phase."""
        models = _models(state)
        dead = {m.name: m.dead for m in models if m.state == "dead"}
        if dead and not any(m.state == "ready" for m in models):
            return json_response({"status": "dead", "cause": next(iter(dead.values())), "dead": dead}, 503)
        if state.phase != "ok":
            return json_response({"status": state.phase}, 503)
        return json_response({"status": "ok", "dead": dead} if dead else {"status": "ok"})

    @app.route("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [m.card() for m in [*_models(state), *_adapters(state)]]})

    @app.route("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        found = next((m for m in [*_models(state), *_adapters(state)] if m.name == model_id), None)
        if found is None:
            return error_response(HTTPError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"))
        return json_response(found.card())

    @app.route("/metrics")
    async def metrics() -> Response:
        """The first model's statistics at the top (the whole body when one
        model is served), and with several, each model's under "models"."""
        ready = [m for m in _models(state) if m.engine is not None]
        if not ready:
            return json_response({"status": state.phase})
        body = _stats_body(ready[0].engine)
        if len(state.registry.models) > 1:
            body["models"] = {m.name: _stats_body(m.engine) for m in ready}
        body["sessions"] = state.sessions.stats()
        body["responses"] = {k: v for k, v in state.responses.stats().items() if k in ("active", "evicted")}  # stored ones
        return json_response(body)

    @app.route("/metrics/prometheus")
    async def metrics_prometheus() -> Response:
        ready = [m for m in _models(state) if m.engine is not None]
        if not ready:
            return error_response(HTTPError(503, "the model is still loading", kind="server_error", code="loading"))
        text = prometheus.render([(m.name, m.engine.statistics(), m.engine.config.batch_invariant) for m in ready])
        return Response(text, mimetype="text/plain; version=0.0.4")


def _adapters(state: ServerState) -> list:
    """The LoRA adapters the request's tenant sees: its own and the shared ones."""
    if state.registry is None:
        return []
    return state.registry.visible_adapters(tenant() if state.tenants.required else None)


def _models(state: ServerState) -> list:
    """Every model in the registry (loading, ready or unloading), in the order they were added."""
    return list(state.registry.models.values()) if state.registry is not None else []


def _stats_body(engine) -> dict:
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
