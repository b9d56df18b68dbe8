"""The request guard in front of every route: the API key's scheme is
case-insensitive, and POST bodies sent with a content type a browser may send
cross-origin without a CORS preflight (text/plain, form encodings) are
refused with 415, so that a web page cannot drive the server from a
visitor's browser."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, start_server
from trioserve.http.guard import bearer_matches, form_content_type

KEY = "sekret"
CHAT = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True}).encode()


async def test_the_bearer_scheme_is_case_insensitive(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf, api_key=KEY))
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        for value in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"bEaReR {KEY}"):
            response = await client.get("/v1/models", headers={"Authorization": value})
            assert response.status_code == 200, (value, response.text)
        for value in (f"Basic {KEY}", KEY, f"Bearer {KEY.upper()}", f"Bearer {KEY}x", "Bearer", ""):
            response = await client.get("/v1/models", headers={"Authorization": value})
            assert_error(response, 401, fragment="missing or wrong API key", param=None, kind="authentication_error", code="invalid_api_key")


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "TEXT/PLAIN"],
)
async def test_preflight_free_content_types_are_refused(nursery, tiny_gguf, content_type):
    url = await start_server(nursery, make_settings(tiny_gguf))
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/sessions"):
            response = await client.post(path, content=CHAT, headers={"Content-Type": content_type, "Origin": "https://evil.example"})
            assert_error(response, 415, fragment="Content-Type: application/json", param=None, code="unsupported_media_type")
            assert "access-control-allow-origin" not in response.headers  # no CORS without --cors-origins: the page cannot even read the refusal


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"])
async def test_json_and_missing_content_types_are_accepted(nursery, tiny_gguf, content_type):
    url = await start_server(nursery, make_settings(tiny_gguf))
    headers = {} if content_type is None else {"Content-Type": content_type}
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        response = await client.post("/v1/chat/completions", content=CHAT, headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2


def test_bearer_and_form_type_rules():
    assert bearer_matches("Bearer k", "k") and bearer_matches("  bearer   k ", "k") and bearer_matches("BEARER k", "k")
    assert not bearer_matches("Bearerk", "k") and not bearer_matches("Token k", "k") and not bearer_matches("Bearer K", "k")
    assert form_content_type("text/plain; charset=utf-8") == "text/plain"
    assert form_content_type("Multipart/Form-Data; boundary=--x") == "multipart/form-data"
    assert form_content_type("") is None and form_content_type("application/json") is None
    assert form_content_type("application/problem+json") is None and form_content_type("application/octet-stream") is None
