"""LoRA adapters loaded, listed and unloaded at run time (vLLM's shape).

    GET    /v1/lora_adapters                       -> the adapters, each with its base model and state
    POST   /v1/lora_adapters  {"name", "path", "base_model"?}  -> the adapter, once resident
    DELETE /v1/lora_adapters/{name}?timeout_s=30   -> what the drain did

A request selects an adapter by its name in ``model``, as it would a model;
its rows run on the base model's engine with the adapter's low-rank
product added (models/lora_set.py), in the same steps as the base model's
and other adapters' rows. The registry (http/registry.py) does the work.
These routes are under /v1, so `--api-key` guards them. With API keys an
adapter belongs to the tenant that loaded it: no other sees it (listed,
routed to or unloaded: as if it were not there), each tenant holds at most
an even share of --max-loras, and no tenant is shown an adapter's path or
told why a path could not be read (one message for every path that holds
no adapter, so a key cannot map the server's directories). Adapters given
with --lora are the operator's, for everyone."""

from __future__ import annotations

import math

from quart import Response, request

import re
from pathlib import Path

from trioserve.errors import RequestError
from trioserve.http.admin import body_path, body_text
from trioserve.http.edge import ServerState, read_body, tenant
from trioserve.http.errors import HTTPError, error_response, json_response
from trioserve.models.lora import CONFIG_FILE, WEIGHTS_FILE

DEFAULT_UNLOAD_TIMEOUT_S = 30.0
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # what a URL path carries as it is (DELETE /v1/lora_adapters/{name})


def adapter_name(body: dict) -> str:
    name = body_text(body, "name")
    if not ADAPTER_NAME.fullmatch(name) or name in (".", ".."):
        raise RequestError(f"name: 1 to 64 letters, digits and ._- (it goes in URL paths), got {name[:70]!r}", field="name")
    return name


def _who(state: ServerState) -> str | None:
    """The request's tenant when the server has API keys; None without."""
    return tenant() if state.tenants.required else None


def _check_adapter_files(path: str) -> None:
    """For a tenant: the one refusal for any path that is not an adapter
    directory this server can read (missing, not a directory, no config or
    weights file, unreadable): never which of these."""
    where = Path(path)
    try:
        ok = where.is_dir() and (where / CONFIG_FILE).is_file() and (where / WEIGHTS_FILE).is_file()
    except OSError:
        ok = False
    if not ok:
        raise RequestError(f"path: no LoRA adapter this server can read at {path!r} (a PEFT directory with {CONFIG_FILE} and {WEIGHTS_FILE})", field="path")


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
        who = _who(state)
        return json_response({"object": "list", "data": [a.describe(with_path=who is None) for a in registry.visible_adapters(who)]})

    @app.route("/v1/lora_adapters", methods=["POST"])
    async def load_adapter() -> Response:
        try:
            registry = _registry(state)
            body = await read_body(state)
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            name = adapter_name(body)
            path = body_path(body, "path")
            base = body_text(body, "base_model", required=False, limit=256)
            who = _who(state)
            if who is None:
                adapter = await registry.load_adapter(name, path, base)
            else:
                _check_adapter_files(path)
                adapter = await registry.load_adapter(name, path, base, owner=who, tenants=len(state.tenants.names))
        except Exception as exc:  # noqa: BLE001 - a bad adapter, a taken name, a full base model: an error body
            return error_response(exc)
        return json_response(adapter.describe(with_path=who is None))

    @app.route("/v1/lora_adapters/<name>", methods=["DELETE"])
    async def unload_adapter(name: str) -> Response:
        try:
            registry = _registry(state)
            timeout_s = _timeout(request.args.get("timeout_s"))
            return json_response(await registry.unload_adapter(name, timeout_s, _who(state)))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
