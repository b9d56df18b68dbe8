"""The checks in front of every route (app.py's ``guard``), as plain
functions of header values: the API key (``Authorization: Bearer``, or
Anthropic's ``X-Api-Key``; which tenant it is: http/tenants.py), the
content type of a body, and the origins CORS allows.

A browser sends a cross-origin POST without asking first (no CORS
preflight) only when its content type is one an HTML form could send:
text/plain, application/x-www-form-urlencoded or multipart/form-data.
Refusing those keeps any web page a visitor opens from driving the server
(which may allow other origins: --cors-origins) through the visitor's
browser; JSON bodies need the preflight, which CORS decides.

One exception, for curl: `curl -d '{...}'` labels its body
application/x-www-form-urlencoded. A request of that type without an
``Origin`` header (which a browser puts on every POST, a form's included, so
no page can leave it out) has its body read as JSON when it parses as a
JSON object (edge.read_body), as llama-server does; one that does not parse
is refused with the same 415."""

from __future__ import annotations

import hmac

from trioserve.http.errors import HTTPError

CURL_FORM = "application/x-www-form-urlencoded"  # what `curl -d` sends without -H 'Content-Type: ...'
FORM_TYPES = frozenset({"text/plain", CURL_FORM, "multipart/form-data"})


def bearer_matches(authorization: str, api_key: str) -> bool:
    """``Authorization: Bearer <api_key>``, the scheme in any case (RFC 9110
    says schemes are case-insensitive); the key is compared in constant time."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


def form_content_type(content_type: str) -> str | None:
    """The media type of ``content_type`` (lower case, parameters dropped)
    when it is one a browser posts cross-origin without a preflight; None
    otherwise (JSON, ``+json`` types, other types, or no Content-Type)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media if media in FORM_TYPES else None


def refused_content_type(content_type: str, origin: str | None) -> str | None:
    """The form type a POST is refused for before its body is read (415,
    `not_json`), or None to let it through: JSON, other types, no type, and
    curl's form default from a client that sent no ``Origin`` (not a web
    page), whose body read_body reads as JSON if it parses as an object."""
    media = form_content_type(content_type)
    if media == CURL_FORM and origin is None:
        return None
    return media


def not_json(media: str, why: str | None = None) -> HTTPError:
    """The 415 for a body sent as the form type ``media``; ``why``: what
    reading it as JSON met, for a body that looks like JSON with a mistake."""
    also = f"; read as JSON, the body is not valid: {why}" if why else ""
    return HTTPError(415, f"request bodies must be JSON: send 'Content-Type: application/json' (got {media}){also}", code="unsupported_media_type")


def allowed_origins(setting: str | None) -> frozenset[str]:
    """--cors-origins as a set: empty (no CORS), {"*"}, or origins as
    browsers send them (scheme://host[:port], no trailing slash)."""
    if not setting:
        return frozenset()
    return frozenset(o.strip().rstrip("/") for o in setting.split(",") if o.strip())


def cors_origin(allowed: frozenset[str], origin: str | None) -> str | None:
    """The Access-Control-Allow-Origin to answer a request from ``origin``
    with: "*" when every origin is allowed, the origin itself when listed,
    None (no CORS headers: the browser keeps the page out) otherwise."""
    if "*" in allowed:
        return "*"
    if origin is not None and origin in allowed:
        return origin
    return None
