"""The request guard in front of every route: the API key's scheme is
case-insensitive, and POST bodies sent with a content type a browser may send
cross-origin without a CORS preflight (text/plain, form encodings) are
refused with 415, so that a web page cannot drive the server from a
visitor's browser. The one exception is curl's: `curl -d '{...}'` labels
its JSON body application/x-www-form-urlencoded and sends no Origin (a
browser sends one with every POST); such a body is read as JSON when it
parses as a JSON object, and is the same 415 when it does not."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, start_server
from tests.http.raw_client import RawClient
from trioserve.http.guard import bearer_matches, form_content_type, refused_content_type

KEY = "sekret"
CHAT = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True}).encode()
CURL_FORM = "application/x-www-form-urlencoded"
NOT_JSON = f"request bodies must be JSON: send 'Content-Type: application/json' (got {CURL_FORM})"
# A body for each kind of JSON route, as `curl -d` would send it.
CURL_BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": json.dumps({"prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode(),
    "/v1/sessions": json.dumps({"system": "be brief", "max_tokens": 2}).encode(),
    "/v1/embeddings": json.dumps({"input": "hi"}).encode(),
    "/v1/messages": json.dumps({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode(),
    "/v1/responses": json.dumps({"input": "hi", "max_output_tokens": 2}).encode(),
}


async def curl_post(url: str, path: str, body: bytes, content_type: str | None = CURL_FORM, **extra: str):
    """POST ``body`` on a bare socket with exactly the headers `curl -d` sends
    (no Origin, the form type unless another or none is given)."""
    headers = {"User-Agent": "curl/7.88.1", "Accept": "*/*", **extra}
    if content_type is not None:
        headers["Content-Type"] = content_type
    async with await RawClient.connect(url) as client:
        await client.send_head("POST", path, headers, body_length=len(body))
        await client.send_body(body)
        return await client.reply(timeout=30)


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


async def test_curl_default_form_type_with_a_json_body_is_read_as_json(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf))
    for path, body in CURL_BODIES.items():
        reply = await curl_post(url, path, body)
        assert reply.status == 200, (path, reply.status, reply.body[:500])
        assert reply.headers["content-type"].startswith("application/json"), (path, reply.headers)
    answer = (await curl_post(url, "/v1/chat/completions", CHAT)).json()
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 2, answer
    # Read as JSON means validated as JSON: a wrong field is the field's 400, not a 415.
    wrong = await curl_post(url, "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}).encode())
    assert wrong.status == 400, wrong.body
    assert wrong.json()["error"] == {"message": "temperature: must be between 0 and 2, got 5", "type": "invalid_request_error", "param": "temperature", "code": None}


async def test_no_content_type_with_a_json_body_is_read_as_json(nursery, tiny_gguf):
    url = await start_server(nursery, make_settings(tiny_gguf))
    for path, body in CURL_BODIES.items():
        reply = await curl_post(url, path, body, content_type=None)
        assert reply.status == 200, (path, reply.status, reply.body[:500])
    # A body without a type that is not JSON stays what it was: the parser's 400.
    garbage = await curl_post(url, "/v1/chat/completions", b"a=1&b=2", content_type=None)
    assert garbage.status == 400, garbage.body
    assert garbage.json()["error"]["message"].startswith("the request body is not valid JSON: Expecting value: line 1 column 1"), garbage.body


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"a=1&b=2", NOT_JSON),
        (b"messages=hi&max_tokens=2", NOT_JSON),
        (b"[1, 2]", NOT_JSON),
        (b'"hi"', NOT_JSON),
        (b"null", NOT_JSON),
        # JSON with a mistake in it: the 415 says what the JSON reading met, too.
        (b'{"tools": [...]}', NOT_JSON + "; read as JSON, the body is not valid: Expecting value: line 1 column 12 (char 11)"),
        (b' {"unclosed": ', NOT_JSON + "; read as JSON, the body is not valid: Expecting value: line 1 column 15 (char 14)"),
    ],
)
async def test_curl_default_form_type_with_a_body_that_is_not_a_json_object_is_415(nursery, tiny_gguf, body, message):
    url = await start_server(nursery, make_settings(tiny_gguf))
    for path in CURL_BODIES:
        reply = await curl_post(url, path, body)
        assert reply.status == 415, (path, reply.status, reply.body[:500])
        error = reply.json()["error"]
        if path == "/v1/messages":  # Anthropic's shape there
            assert error == {"type": "invalid_request_error", "message": message}, error
        else:
            assert error == {"message": message, "type": "invalid_request_error", "param": None, "code": "unsupported_media_type"}, error


async def test_a_browser_page_gets_no_json_reading_of_a_form_body(nursery, tiny_gguf):
    """Any page can POST a form type cross-origin without a preflight (with
    fetch, any body at all), and its browser always sends Origin: that
    request stays refused before its body is read, whatever the body."""
    url = await start_server(nursery, make_settings(tiny_gguf))
    for origin in ("https://evil.example", "null", url):
        reply = await curl_post(url, "/v1/chat/completions", CHAT, Origin=origin)
        assert reply.status == 415, (origin, reply.body)
        assert reply.json()["error"]["message"] == NOT_JSON
    for content_type in ("text/plain", "multipart/form-data; boundary=x"):  # curl --data with -H, or -F: never read as JSON
        reply = await curl_post(url, "/v1/chat/completions", CHAT, content_type=content_type)
        assert reply.status == 415, (content_type, reply.body)
        assert reply.json()["error"]["message"] == f"request bodies must be JSON: send 'Content-Type: application/json' (got {content_type.split(';')[0]})"


def test_bearer_and_form_type_rules():
    assert bearer_matches("Bearer k", "k") and bearer_matches("  bearer   k ", "k") and bearer_matches("BEARER k", "k")
    assert not bearer_matches("Bearerk", "k") and not bearer_matches("Token k", "k") and not bearer_matches("Bearer K", "k")
    assert form_content_type("text/plain; charset=utf-8") == "text/plain"
    assert form_content_type("Multipart/Form-Data; boundary=--x") == "multipart/form-data"
    assert form_content_type("") is None and form_content_type("application/json") is None
    assert form_content_type("application/problem+json") is None and form_content_type("application/octet-stream") is None
    assert refused_content_type(CURL_FORM, None) is None and refused_content_type("Application/X-WWW-Form-Urlencoded; charset=utf-8", None) is None
    assert refused_content_type(CURL_FORM, "https://evil.example") == CURL_FORM and refused_content_type(CURL_FORM, "null") == CURL_FORM
    assert refused_content_type("text/plain", None) == "text/plain" and refused_content_type("multipart/form-data; boundary=x", None) == "multipart/form-data"
    assert refused_content_type("", None) is None and refused_content_type("application/json", "https://evil.example") is None
