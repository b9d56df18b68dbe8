"""GET /: a chat page for a person in a browser, or an index of the API for
a program that asks for JSON.

The page is one static file shipped with the package (static/chat.html:
HTML, CSS and JavaScript, no build step, nothing fetched from elsewhere).
It talks to this server's own /v1 routes, so the route itself needs no API
key: the page asks for one when a /v1 request answers 401.

Its Content-Security-Policy allows this origin and nothing else, and runs
only the page's own inline script and style: their SHA-256 hashes are
computed here, once, from the file as shipped."""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from quart import Response, request

from trioserve import __version__
from trioserve.http.edge import ServerState
from trioserve.http.errors import HTTPError, error_response, json_response
from trioserve.http.tenants import MISSING_KEY

PAGE_FILE = "static/chat.html"
DOCS = ("README.md", "docs/running.md", "docs/api.md", "docs/configuration.md")


def inline_hash(html: str, tag: str) -> str:
    """The CSP source (``'sha256-...'``) of the one inline ``<tag>`` element
    of ``html``; a page with none or several is a packaging mistake."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    if len(bodies) != 1:
        raise RuntimeError(f"{PAGE_FILE}: expected one inline <{tag}>, found {len(bodies)}")
    digest = hashlib.sha256(bodies[0].encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode('ascii')}'"


def content_security_policy(html: str) -> str:
    """This origin only; the page's own script and style by hash; no
    plugins, no frames, no <base> or form targets elsewhere."""
    return "; ".join(
        (
            "default-src 'self'",
            f"script-src {inline_hash(html, 'script')}",
            f"style-src {inline_hash(html, 'style')}",
            "connect-src 'self'",
            "img-src 'self' data:",
            "object-src 'none'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )


PAGE = resources.files("trioserve.http").joinpath(PAGE_FILE).read_text(encoding="utf-8")
CSP = content_security_policy(PAGE)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
    "Vary": "Accept",
}


def wants_json(accept) -> bool:
    """Whether an Accept header (werkzeug's MIMEAccept) prefers JSON to
    HTML. A tie, ``*/*`` or no header at all gets the page."""
    return accept.best_match(["text/html", "application/json"]) == "application/json"


def route_list(app) -> list[dict]:
    """Every route the app serves, its parameters written ``{name}``, with
    its methods (HEAD and OPTIONS, which every route answers, left out)."""
    routes = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        methods = sorted(set(rule.methods or ()) - {"HEAD", "OPTIONS"})
        routes.append({"path": path, "methods": methods})
    return sorted(routes, key=lambda r: (r["path"], r["methods"]))


def api_index(app, state: ServerState, base_url: str) -> dict:
    """What GET / answers a program: the server, its models, its routes.
    With API keys (--api-key or --api-keys-file) only a caller with a key
    gets it (the route answers anyone else the 401 that /v1 gives)."""
    base = base_url.rstrip("/")
    registry = state.registry
    models = [{"id": m.name, "state": m.state} for m in registry.models.values()] if registry is not None else []
    return {
        "object": "trioserve.index",
        "name": "trioserve",
        "version": __version__,
        "status": state.phase,
        "models": models,
        "api_key_required": state.tenants.required,
        "openai_base_url": f"{base}/v1",
        "chat_page": f"{base}/",
        "routes": route_list(app),
        "docs": {"files": list(DOCS), "note": "in trioserve's source tree; docs/api.md lists every route and field"},
    }


def add_page_routes(app, state: ServerState) -> None:
    @app.route("/", methods=["GET"])
    async def index() -> Response:
        if wants_json(request.accept_mimetypes):
            tenants, headers = state.tenants, request.headers
            if tenants.required and tenants.identify(headers.get("Authorization", ""), headers.get("X-Api-Key", "")) is None:
                return error_response(HTTPError(401, MISSING_KEY, kind="authentication_error", code="invalid_api_key", headers={"Vary": "Accept"}))
            return json_response(api_index(app, state, request.host_url), headers={"Vary": "Accept"})
        return Response(PAGE, mimetype="text/html", headers=PAGE_HEADERS)
