"""LoRA adapters loaded, listed and unloaded at run time (vLLM's shape).

    GET    /v1/lora_adapters                       -> the adapters, each with its base model and state
    POST   /v1/lora_adapters  {"name", "path", "base_model"?}  -> the adapter, once resident
    DELETE /v1/lora_adapters/{name}?timeout_s=30   -> what the drain did

A request selects an adapter by its name in ``model``, as it would a model;
its rows run on the base model's engine with the adapter's low-rank
product added (models/lora_set.py), in the same steps as the base model's
and other adapters' rows. The registry (http/registry.py) does the work.
These routes are under /v1, so `--api-key` guards them."""

from __future__ import annotations

import math

from quart import Response, request

from trioserve.errors import RequestError
from trioserve.http.admin import MAX_NAME_CHARS, body_text
from trioserve.http.edge import ServerState, read_body
from trioserve.http.errors import HTTPError, error_response, json_response

DEFAULT_UNLOAD_TIMEOUT_S = 30.0


def _registry(state: ServerState):
    if state.registry is None or state.phase != "ok":
        raise HTTPError(503, f"the server is {state.phase}", kind="server_error", code=state.phase)
    return state.registry


def _timeout(text: str | None) -> float:
    if text is None:
        return DEFAULT_UNLOAD_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise RequestError(f"timeout_s: expected a number of seconds, 0 or more, got {text!r}", field="timeout_s")
    return value


def add_lora_routes(app, state: ServerState) -> None:
    @app.route("/v1/lora_adapters", methods=["GET"])
    async def list_adapters() -> Response:
        try:
            registry = _registry(state)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return json_response({"object": "list", "data": [a.describe() for a in registry.adapters.values()]})

    @app.route("/v1/lora_adapters", methods=["POST"])
    async def load_adapter() -> Response:
        try:
            registry = _registry(state)
            body = await read_body(state)
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            name = body_text(body, "name", limit=MAX_NAME_CHARS)
            path = body_text(body, "path")
            base = body_text(body, "base_model", required=False, limit=MAX_NAME_CHARS)
            adapter = await registry.load_adapter(name, path, base)
        except Exception as exc:  # noqa: BLE001 - a bad adapter, a taken name, a full base model: an error body
            return error_response(exc)
        return json_response(adapter.describe())

    @app.route("/v1/lora_adapters/<name>", methods=["DELETE"])
    async def unload_adapter(name: str) -> Response:
        try:
            registry = _registry(state)
            timeout_s = _timeout(request.args.get("timeout_s"))
            return json_response(await registry.unload_adapter(name, timeout_s))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
