"""The admin routes: models loaded and unloaded while the others serve.

    POST /admin/models/load    {"name", "path", "options"?}  -> the model's card, once it is ready
    POST /admin/models/unload  {"name", "timeout_s"?}        -> what the drain did
    GET  /admin/models                                       -> each model's state, memory, requests

They are off unless the server has `--admin-api-key` (404 saying how to
turn them on), and then need `Authorization: Bearer <that key>`: the
`--api-key` of the /v1 routes does not open them. The registry
(http/registry.py) does the work; this module reads bodies and answers."""

from __future__ import annotations

import math
import os

import attrs
from quart import Response, request

from trioserve.config import EngineConfig
from trioserve.engine import device_problem
from trioserve.errors import RequestError, sole_error
from trioserve.http.edge import ServerState, read_body
from trioserve.http.errors import HTTPError, error_response, json_response
from trioserve.http.guard import bearer_matches
from trioserve.option_kinds import BYTES, MILLISECONDS, POSITIVE_INT, SECONDS, SWITCH, TEXT
from trioserve.options import OPTIONS, Option

DEFAULT_UNLOAD_TIMEOUT_S = 30.0
MAX_NAME_CHARS = 256
# The engine settings a load may set for its model, by field name
# ("kv_cache_bytes": "64MiB", "max_num_seqs": 8); the rest are the server's.
LOAD_OPTIONS = {opt.name: opt for opt in OPTIONS if opt.field and opt.field.startswith("engine.") and opt.name not in ("model", "record_dir")}


def _admin_refusal(state: ServerState) -> HTTPError | None:
    key = state.settings.admin_api_key
    if not key:
        return HTTPError(404, "the admin routes are off: start the server with --admin-api-key to use them", code="admin_off")
    if not bearer_matches(request.headers.get("Authorization", ""), key):
        return HTTPError(401, "missing or wrong admin key (send 'Authorization: Bearer <admin key>')", kind="authentication_error", code="invalid_admin_key")
    return None


def body_text(body: dict, field: str, *, required: bool = True, limit: int | None = None) -> str | None:
    """A JSON body's string ``field``: non-empty, at most ``limit``
    characters; None when absent and not ``required``."""
    value = body.get(field)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"{field}: expected a non-empty string", field=field)
    if limit is not None and len(value) > limit:
        raise RequestError(f"{field}: at most {limit} characters", field=field)
    return value


PATH_MAX_BYTES = 4095  # Linux's PATH_MAX less its NUL: a longer path cannot name a file
NAME_MAX_BYTES = 255  # one component of a path, in bytes


def body_path(body: dict, field: str) -> str:
    """A JSON body's file-system path ``field``: a non-empty string with no
    NUL, short enough to name a file (400 naming the field otherwise: the
    OS would refuse it later, as an error of ours)."""
    path = body_text(body, field)
    if "\x00" in path:
        raise RequestError(f"{field}: a path cannot hold a NUL character", field=field)
    size = len(path.encode("utf-8", errors="surrogatepass"))
    if size > PATH_MAX_BYTES:
        raise RequestError(f"{field}: a path is at most {PATH_MAX_BYTES} bytes, got {size}", field=field)
    longest = max(len(part.encode("utf-8", errors="surrogatepass")) for part in path.split("/"))
    if longest > NAME_MAX_BYTES:
        raise RequestError(f"{field}: a path's parts are at most {NAME_MAX_BYTES} bytes each, one has {longest}", field=field)
    return path


def load_config(base: EngineConfig, path: str, options: object) -> EngineConfig:
    """``base`` for the model at ``path`` with a load's ``options`` applied:
    each by its field name, a string read as its TRIOSERVE_* variable is
    (sizes like "64MiB"), a number or a boolean as it is, each checked as a
    request field is (`option_value`): a 400 naming the option."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise RequestError("options: expected an object of engine settings", field="options")
    given = {}
    for key, value in options.items():
        opt = LOAD_OPTIONS.get(key)
        if opt is None:
            raise RequestError(f"options.{key}: not a setting a load may choose (one of: {', '.join(sorted(LOAD_OPTIONS))})", field=f"options.{key}")
        try:
            given[key] = option_value(opt, value)
        except ValueError as exc:
            raise RequestError(f"options.{key}: {exc}", field=f"options.{key}") from None
    try:
        return attrs.evolve(base, model=path, **given)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"options: {exc}", field="options") from None


# What each kind of load option takes, as its 400 says it.
_EXPECTED = {
    POSITIVE_INT: "a positive integer",
    BYTES: 'a positive whole number of bytes, or a size like "64MiB"',
    SWITCH: "true or false",
    SECONDS: "a positive number of seconds",
    MILLISECONDS: "a number of milliseconds, 0 or more",
    TEXT: "a string",
}


def option_value(opt: Option, value: object) -> object:
    """A load option's value, checked as a request field is: a string read
    as its TRIOSERVE_* variable is, a JSON value of the option's own type
    (an integer is no float, a boolean no number), null only where the
    option's default is none; the device one a model can run on here.
    ValueError saying what it takes."""
    expected = _EXPECTED.get(opt.kind, "a string")
    if opt.choices:
        expected = f"one of {', '.join(opt.choices)}"
    if value is None:
        if opt.default is None:
            return None
        raise ValueError(f"expected {expected}, got null")
    if isinstance(value, str):
        try:
            parsed = opt.parse_variable(value)
        except ValueError:
            if opt.choices or opt.kind in (BYTES, SWITCH):
                raise  # their parsers say what they take
            raise ValueError(f"expected {expected}, got {value!r}") from None
    elif opt.kind is TEXT:
        raise ValueError(f"expected {expected}, got {_json_kind(value)} {value!r}")
    else:
        parsed = value
    if opt.kind is SWITCH:
        ok = isinstance(parsed, bool)
    elif opt.kind in (POSITIVE_INT, BYTES):
        ok = isinstance(parsed, int) and not isinstance(parsed, bool) and parsed > 0
    elif opt.kind in (SECONDS, MILLISECONDS):
        ok = isinstance(parsed, (int, float)) and not isinstance(parsed, bool) and math.isfinite(parsed)
        ok = ok and (parsed > 0 if opt.kind is SECONDS else parsed >= 0)
    else:
        ok = isinstance(parsed, str)
    if not ok:
        raise ValueError(f"expected {expected}, got {_json_kind(value)} {value!r}" if not isinstance(value, str) else f"expected {expected}, got {value!r}")
    if opt.name == "device":
        problem = device_problem(parsed)
        if problem is not None:
            raise ValueError(problem)
    return parsed


def _json_kind(value: object) -> str:
    """A value's JSON type, as a client wrote it."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _timeout(body: dict) -> float:
    value = body.get("timeout_s", DEFAULT_UNLOAD_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise RequestError(f"timeout_s: expected a number of seconds, 0 or more, got {value!r}", field="timeout_s")
    return float(value)


def _rss_bytes() -> int | None:
    """This process's resident memory, where /proc says it."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def add_admin_routes(app, state: ServerState) -> None:
    @app.route("/admin/models", methods=["GET"])
    async def list_models() -> Response:
        refused = _admin_refusal(state)
        if refused is not None:
            return error_response(refused)
        models = state.registry.stats() if state.registry is not None else []
        return json_response({"object": "list", "data": models, "memory_budget": state.settings.memory_budget, "rss_bytes": _rss_bytes()})

    @app.route("/admin/models/load", methods=["POST"])
    async def load() -> Response:
        try:
            refused = _admin_refusal(state)
            if refused is not None:
                raise refused
            registry = state.registry
            if registry is None or state.phase != "ok":
                raise HTTPError(503, f"the server is {state.phase}", kind="server_error", code=state.phase)
            body = await read_body(state)
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            name = body_text(body, "name", limit=MAX_NAME_CHARS)
            path = body_path(body, "path")
            config = load_config(state.settings.engine, path, body.get("options"))
            model = registry.reserve(name, config)  # 409 when taken; 400 over the memory budget
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an error body
            return error_response(exc)
        try:
            await registry.load(model)
        except Exception as exc:  # noqa: BLE001 - a missing, corrupt or unsupported file: the name is free again
            cause = sole_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
            if isinstance(cause, HTTPError) and cause.code == "over_memory_budget":
                return error_response(cause)  # the budget's refusal as reserve gives it, whether its RoPE tables or its file tipped it
            param = "path"
            if isinstance(cause, RequestError) and cause.field in LOAD_OPTIONS:  # an option that does not fit this model (a KV pool under one block)
                param = f"options.{cause.field}"
            return error_response(HTTPError(400, f"loading {name!r} from {path} failed: {_one_line(exc)}", param=param, code="load_failed"))
        return json_response(model.card())

    @app.route("/admin/models/unload", methods=["POST"])
    async def unload() -> Response:
        try:
            refused = _admin_refusal(state)
            if refused is not None:
                raise refused
            if state.registry is None:
                raise HTTPError(503, f"the server is {state.phase}", kind="server_error", code=state.phase)
            body = await read_body(state)
            if not isinstance(body, dict):
                raise HTTPError(400, "the request body must be a JSON object")
            name = body_text(body, "name")
            timeout_s = _timeout(body)
            return json_response(await state.registry.unload(name, timeout_s))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)


def _one_line(exc: BaseException) -> str:
    """An exception as one line (a group: its first leaf)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return " ".join(str(exc).split()) or type(exc).__name__
