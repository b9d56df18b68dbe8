"""The one place where errors become HTTP responses, in OpenAI's shape:
{"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import math

from quart import Response

from trioserve.state.durable import StateConflict, StateError
from trioserve.state.session import QuotaExceeded, SessionBusy, SessionNotFound

from trioserve.errors import ChatTemplateError, EngineClosed, EngineDead, QueueFull, RequestError, RequestTooLarge, TrioserveError


class HTTPError(TrioserveError):
    """An error with its status decided where it is raised (401, 404, 413...)."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
    ):
        self.status = status
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}  # sent with the response (Retry-After)
        super().__init__(message)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def to_response(exc: Exception) -> tuple[int, dict, dict[str, str]]:
    """(status, JSON body, extra headers) for any error a request can meet."""
    if isinstance(exc, HTTPError):
        return exc.status, error_body(str(exc), exc.kind, exc.param, exc.code), dict(exc.headers)
    if isinstance(exc, RequestTooLarge):
        return 400, error_body(str(exc), "invalid_request_error", exc.field, "context_length_exceeded"), {}
    if isinstance(exc, RequestError):
        return 400, error_body(str(exc), "invalid_request_error", exc.field), {}
    if isinstance(exc, SessionNotFound):
        return 404, error_body(str(exc), "invalid_request_error", None, "session_not_found"), {}
    if isinstance(exc, QuotaExceeded):
        return 429, error_body(str(exc), "rate_limit_error", None, "quota_exceeded"), {"Retry-After": str(math.ceil(exc.retry_after))}
    if isinstance(exc, SessionBusy):
        return 409, error_body(str(exc), "invalid_request_error", None, "session_busy"), {}
    if isinstance(exc, ChatTemplateError):  # the model's template refuses this conversation
        return 400, error_body(f"the chat template rejected the messages: {exc}", "invalid_request_error", "messages"), {}
    if isinstance(exc, QueueFull):
        retry = str(max(1, math.ceil(exc.retry_after)))
        return 429, error_body(str(exc), "rate_limit_error", None, "queue_full"), {"Retry-After": retry}
    if isinstance(exc, EngineDead):
        return 503, error_body(str(exc), "server_error", None, "engine_dead"), {}
    if isinstance(exc, EngineClosed):
        return 503, error_body(str(exc), "server_error", None, "shutting_down"), {}
    if isinstance(exc, StateConflict):  # another replica moved the session on meanwhile: nothing was committed here
        return 409, error_body(str(exc), "invalid_request_error", None, "state_conflict"), {}
    if isinstance(exc, StateError):  # the state file refused a write: nothing was committed
        return 503, error_body(f"the state store could not keep this, so nothing changed: {exc}", "server_error", None, "state_unavailable"), {}
    return 500, error_body(f"internal error: {type(exc).__name__}", "server_error"), {}


def json_response(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=status, headers=headers or {}, mimetype="application/json")


def error_response(exc: Exception) -> Response:
    status, body, headers = to_response(exc)
    return json_response(body, status, headers)
