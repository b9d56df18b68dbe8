"""The checks in front of every route (app.py's ``guard``), as plain
functions of header values: the API key (``Authorization: Bearer``, or
Anthropic's ``X-Api-Key``), and the content type of a body.

A browser sends a cross-origin POST without asking first (no CORS
preflight) only when its content type is one an HTML form could send:
text/plain, application/x-www-form-urlencoded or multipart/form-data.
Refusing those keeps any web page a visitor opens from driving the server
(which allows every origin) through the visitor's browser; JSON bodies need
the preflight, which CORS decides."""

from __future__ import annotations

import hmac

FORM_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})


def bearer_matches(authorization: str, api_key: str) -> bool:
    """``Authorization: Bearer <api_key>``, the scheme in any case (RFC 9110
    says schemes are case-insensitive); the key is compared in constant time."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


def api_key_matches(value: str, api_key: str) -> bool:
    """``X-Api-Key: <api_key>`` (Anthropic's header for the key), compared
    in constant time."""
    return bool(value) and hmac.compare_digest(value.strip().encode(), api_key.encode())


def form_content_type(content_type: str) -> str | None:
    """The media type of ``content_type`` (lower case, parameters dropped)
    when it is one a browser posts cross-origin without a preflight; None
    otherwise (JSON, ``+json`` types, other types, or no Content-Type)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media if media in FORM_TYPES else None
