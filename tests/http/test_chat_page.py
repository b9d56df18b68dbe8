"""The chat page at / (trioserve/http/page.py, trioserve/http/static/chat.html).

Over plain HTTP: a browser's Accept gets the page with its
Content-Security-Policy (this origin only, the inline script and style by
their hashes), a JSON Accept gets the API index, and the page names no
other host.

In a real browser: Debian's chromium (`make test-tools` installs it where it
can), driven by Playwright's sync API in a thread of its own while the
server runs on the test's trio loop: one chromium for the session, each
test in a fresh context of it (its own storage, as a fresh profile). The page streams a reply (the same text the
API gives for the same request), keeps the conversation, stops a reply
mid-stream (the server counts it cancelled), asks for the API key once,
and shows a server error in the server's words. Each browser test saves a
screenshot under its tmp dir (and $TRIOSERVE_ARTIFACTS when set).
Without chromium or Playwright's driver these tests skip, saying why."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, start_server
from trioserve.config import EngineConfig, ServerSettings
from trioserve.http.page import PAGE

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
STEP_MS = 60_000  # Playwright's limit on every single wait, in ms (generous: the test machine may be busy)
TIMEOUT = 240  # seconds for a whole browser test


# -- plain HTTP -------------------------------------------------------------------


def csp_directives(header: str) -> dict[str, list[str]]:
    directives = {}
    for part in header.split(";"):
        name, *values = part.split()
        directives[name] = values
    return directives


def inline_sha256(html: str, tag: str) -> str:
    (body,) = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"


async def test_a_browser_gets_the_page_with_its_csp(server):
    async with httpx.AsyncClient(base_url=server, timeout=10) as client:
        for accept in (BROWSER_ACCEPT, "*/*", "text/html", None):
            headers = {"Accept": accept} if accept else {}
            response = await client.get("/", headers=headers)
            assert response.status_code == 200, (accept, response.text[:300])
            assert response.headers["content-type"] == "text/html; charset=utf-8", accept
            assert '<textarea id="prompt"' in response.text
            assert response.headers["vary"] == "Accept"
    html = response.text
    assert html == PAGE
    csp = csp_directives(response.headers["content-security-policy"])
    assert csp["default-src"] == ["'self'"]
    assert csp["connect-src"] == ["'self'"]
    assert csp["script-src"] == [inline_sha256(html, "script")], "the script's hash is not the one served"
    assert csp["style-src"] == [inline_sha256(html, "style")]
    for name, values in csp.items():
        for value in values:
            assert value in ("'self'", "'none'", "data:") or value.startswith("'sha256-"), f"{name} allows {value}"
    assert response.headers["x-content-type-options"] == "nosniff"


async def test_json_accept_gets_the_api_index(server):
    async with httpx.AsyncClient(base_url=server, timeout=10) as client:
        response = await client.get("/", headers={"Accept": "application/json"})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("application/json")
        assert response.headers["vary"] == "Accept"
        index = response.json()
        # JSON preferred over HTML by quality gets the index too; HTML preferred gets the page.
        assert (await client.get("/", headers={"Accept": "text/html;q=0.5, application/json"})).json() == index
        assert (await client.get("/", headers={"Accept": "application/json;q=0.5, text/html"})).text == PAGE
    from trioserve import __version__

    assert index["name"] == "trioserve" and index["version"] == __version__
    assert index["models"] == [{"id": MODEL_NAME, "state": "ready"}]
    assert index["api_key_required"] is False
    assert index["openai_base_url"] == f"{server}/v1"
    routes = {r["path"]: r["methods"] for r in index["routes"]}
    assert routes["/"] == ["GET"]
    assert routes["/v1/chat/completions"] == ["POST"]
    assert routes["/v1/models/{model_id}"] == ["GET"]
    assert routes["/health"] == ["GET"]
    assert "docs/api.md" in index["docs"]["files"]


@pytest.mark.parametrize("how", ["flag", "file"])
async def test_with_api_keys_the_page_loads_and_the_index_wants_a_key(nursery, tiny_gguf, tmp_path, how):
    if how == "flag":
        settings = make_settings(tiny_gguf, api_key="sesame")
    else:  # --api-keys-file alone (issue #49: the index said api_key_required false and listed the models)
        keys = tmp_path / "keys"
        keys.write_text("alice: sesame\n")
        settings = attrs.evolve(make_settings(tiny_gguf), api_keys_file=str(keys))
    url = await start_server(nursery, settings)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        page = await client.get("/", headers={"Accept": BROWSER_ACCEPT})
        assert page.status_code == 200 and page.text == PAGE
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = await client.get("/", headers={"Accept": "application/json", **headers})
            assert_error(refused, 401, fragment="missing or wrong API key", param=None, kind="authentication_error", code="invalid_api_key")
            assert set(refused.json()) == {"error"} and refused.headers["vary"] == "Accept"
        index = (await client.get("/", headers={"Accept": "application/json", "Authorization": "Bearer sesame"})).json()
        assert index["api_key_required"] is True and index["models"] == [{"id": MODEL_NAME, "state": "ready"}]
        assert (await client.get("/v1/models")).status_code == 401


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href", "action", "formaction", "poster", "data") and value is not None:
                self.urls.append((tag, name, value))


def test_the_page_names_no_other_host():
    assert "http://" not in PAGE and "https://" not in PAGE
    links = _Links()
    links.feed(PAGE)
    for tag, name, value in links.urls:
        assert not value.startswith("//") and "://" not in value, f"<{tag} {name}={value!r}>"
        assert value.startswith(("data:", "/", "#")), f"<{tag} {name}={value!r}>"
    assert "@import" not in PAGE and "url(" not in PAGE
    assert ".innerHTML" not in PAGE and "insertAdjacentHTML" not in PAGE and "document.write" not in PAGE


# -- in a real browser ----------------------------------------------------------


class Chromium:
    """One chromium under Playwright for the session, started and driven in
    a thread of its own (Playwright's sync API answers only the thread that
    started it): ``run(fn, *args)`` calls ``fn(browser, *args)`` there.
    Each test opens a fresh context in it (its own storage and cache, as a
    fresh profile had), so what one test's page kept no other sees."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="playwright")
        self._playwright = None
        self.browser = None

    def start(self) -> None:
        self._thread.submit(self._start).result()

    def _start(self) -> None:
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        self.browser = self._playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=STEP_MS)

    def run(self, fn: Callable[..., None], *args: object) -> None:
        """Blocking: call it in a worker thread."""
        self._thread.submit(fn, self.browser, *args).result()

    def close(self) -> None:
        def stop() -> None:
            if self.browser is not None:
                self.browser.close()
            if self._playwright is not None:
                self._playwright.stop()

        try:
            self._thread.submit(stop).result()
        finally:
            self._thread.shutdown()


@pytest.fixture(scope="session")
def chromium() -> Chromium:
    """The chromium the browser tests share, once started under Playwright;
    or the test skips with the reason."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no {CHROMIUM} (Debian's chromium; `make test-tools` installs it as root)")
    try:
        from playwright.sync_api import Error
    except ImportError as exc:
        pytest.skip(f"playwright is not installed: {exc}")
    started = Chromium()
    try:
        started.start()
    except Error as exc:
        started.close()
        pytest.skip(f"chromium does not start under Playwright: {str(exc).splitlines()[0]}")
    yield started
    started.close()


@attrs.define
class Browser:
    """What a scenario gets: the page, the server's URL, and what the page
    logged (CSP violations and uncaught errors fail the test)."""

    page: object
    url: str
    console: list[str] = attrs.field(factory=list)

    def metrics(self) -> dict:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            response = client.get("/metrics")
            assert response.status_code == 200, response.text
            return response.json()

    def post(self, path: str, body: dict, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(base_url=self.url, timeout=60) as client:
            return client.post(path, json=body, headers=headers)

    def send(self, text: str) -> object:
        """Type ``text``, send it, and return the new reply's element."""
        page = self.page
        before = page.locator(".msg.assistant").count()
        page.fill("#prompt", text)
        page.click("#send")
        reply = page.locator(".msg.assistant").nth(before)
        reply.wait_for()
        return reply

    def wait_state(self, reply, *states: str, timeout_ms: int = STEP_MS) -> str:
        handle = reply.element_handle()
        self.page.wait_for_function(
            "([el, states]) => states.includes(el.dataset.state)", arg=[handle, list(states)], timeout=timeout_ms
        )
        return reply.get_attribute("data-state")

    def first_text(self, reply) -> str:
        """The reply's text when it is first seen streaming (read in the page, at that moment)."""
        seen = self.page.wait_for_function(
            "(el) => el.dataset.state === 'streaming' ? el.querySelector('.content').textContent : null", arg=reply.element_handle()
        )
        return seen.json_value()


def run_in_browser(browser, url: str, shots: Path, name: str, scenario: Callable[[Browser], None]) -> None:
    """Open ``url`` in a fresh context of ``browser`` and run ``scenario``; a
    screenshot of how the page ended is saved whatever happened. Blocking:
    runs in the Chromium's thread."""
    context = browser.new_context(viewport={"width": 1000, "height": 760})
    try:
        context.set_default_timeout(STEP_MS)
        page = context.new_page()
        tab = Browser(page, url)
        page.on("console", lambda m: tab.console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: tab.console.append(f"pageerror: {e}"))
        page.goto(url + "/", wait_until="load")
        try:
            scenario(tab)
        finally:
            save_screenshot(page, shots, name)
        problems = [c for c in tab.console if "Content Security Policy" in c or c.startswith("pageerror")]
        assert not problems, problems
    finally:
        context.close()


def save_screenshot(page, shots: Path, name: str) -> None:
    path = shots / f"chat-page-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    artifacts = os.environ.get("TRIOSERVE_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        copy = Path(artifacts) / path.name
        shutil.copyfile(path, copy)
        print(f"screenshot: {copy}")


async def in_browser(chromium: Chromium, url: str, tmp_path: Path, name: str, scenario: Callable[[Browser], None]) -> None:
    # Every wait in the scenario has Playwright's limit, so the thread ends by itself.
    with trio.fail_after(TIMEOUT):
        await trio.to_thread.run_sync(chromium.run, run_in_browser, url, tmp_path, name, scenario)


def wait_for(check: Callable[[], str | None], *, timeout: float, what: str) -> None:
    """Poll ``check`` (None when satisfied, else why not) from the browser's thread."""
    deadline = time.monotonic() + timeout
    why = "never checked"
    while time.monotonic() < deadline:
        why = check()
        if why is None:
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout} s: {why}")


def api_reply(browser: Browser, messages: list[dict], key: str | None = None, **fields) -> str:
    """What /v1/chat/completions answers, buffered, for the same request."""
    response = browser.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, **fields}, key)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"] or ""


async def test_the_page_streams_a_reply_and_keeps_the_conversation(nursery, tiny_gguf, slow_steps, chromium, tmp_path):
    slow_steps(0.05)  # 40 tokens take two seconds: the reply is seen growing
    url = await start_server(nursery, make_settings(tiny_gguf))
    first = "Tell me <b>a story</b> & <img src=x onerror=alert(1)>"
    second = "And another one"
    greedy = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}

    def scenario(b: Browser) -> None:
        page = b.page
        page.wait_for_function("document.getElementById('model').dataset.loaded === '1'")
        assert page.locator("#model option").all_text_contents() == [MODEL_NAME]
        page.fill("#temperature", "0")
        page.click("details.settings summary")
        page.fill("#max-tokens", "40")
        page.fill("#extra", '{"ignore_eos": true}')

        with page.expect_request("**/v1/chat/completions") as sent:
            reply = b.send(first)
        body = sent.value.post_data_json
        assert body["messages"] == [{"role": "user", "content": first}]
        assert body["stream"] is True and body["model"] == MODEL_NAME and body["temperature"] == 0 and body["max_tokens"] == 40
        assert body["ignore_eos"] is True

        # Streamed: text is seen before the reply is done, and it grows.
        partial = b.first_text(reply)
        assert b.wait_state(reply, "done") == "done"
        text = reply.locator(".content").text_content()
        assert text and text.startswith(partial) and len(text) > len(partial), (partial, text)
        # Only that reply is watched growing: the API's replies to compare with, and the
        # page's second reply (its request body and final text are what is checked), run at full speed.
        slow_steps(0)
        assert text == api_reply(b, [{"role": "user", "content": first}], **greedy)
        # The message went in as text: no element made of it.
        user_box = page.locator(".msg.user").first
        assert user_box.locator(".content").text_content() == first
        assert page.locator(".msg b, .msg img").count() == 0
        assert page.locator(".msg.assistant .reasoning").first.is_hidden()  # no reasoning channel from this model

        # The second request carries the whole conversation.
        with page.expect_request("**/v1/chat/completions") as sent:
            reply2 = b.send(second)
        history = [{"role": "user", "content": first}, {"role": "assistant", "content": text}, {"role": "user", "content": second}]
        assert sent.value.post_data_json["messages"] == history
        assert b.wait_state(reply2, "done") == "done"
        assert reply2.locator(".content").text_content() == api_reply(b, history, **greedy)
        assert "Done in" in page.text_content("#status")

    await in_browser(chromium, url, tmp_path, "stream", scenario)


async def test_stop_cancels_the_request_on_the_server(nursery, tiny_gguf, slow_steps, chromium, tmp_path):
    slow_steps(0.05)  # 200 tokens would take ten seconds
    url = await start_server(nursery, make_settings(tiny_gguf))

    def scenario(b: Browser) -> None:
        page = b.page
        before = b.metrics()
        page.click("details.settings summary")
        page.fill("#max-tokens", "200")
        page.fill("#extra", '{"ignore_eos": true}')
        assert page.locator("#stop").is_disabled()
        reply = b.send("Tell me everything")
        assert b.wait_state(reply, "streaming") == "streaming"
        assert b.metrics()["running"] == 1
        page.click("#stop")
        assert b.wait_state(reply, "stopped") == "stopped"
        assert "Stopped" in reply.locator(".note").text_content()
        stopped_at = reply.locator(".content").text_content()

        def cancelled() -> str | None:
            now = b.metrics()
            gone = now["finished"].get("cancelled", 0) - before["finished"].get("cancelled", 0)
            if gone == 1 and now["running"] == 0 and now["kv_blocks_used"] == before["kv_blocks_used"]:
                return None
            return f"cancelled +{gone}, running {now['running']}, kv blocks {now['kv_blocks_used']}"

        wait_for(cancelled, timeout=30, what="the server cancelling the stopped reply")
        after = b.metrics()
        assert after["finished"].get("length", 0) == before["finished"].get("length", 0), after["finished"]
        assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
        assert reply.locator(".content").text_content() == stopped_at  # nothing more arrived

    await in_browser(chromium, url, tmp_path, "stop", scenario)


async def test_the_page_asks_for_the_api_key_once(nursery, tiny_gguf, chromium, tmp_path):
    url = await start_server(nursery, make_settings(tiny_gguf, api_key="sesame"))

    def scenario(b: Browser) -> None:
        page = b.page
        panel = page.locator("#key-panel")
        panel.wait_for(state="visible")  # /v1/models answered 401
        assert "missing or wrong API key" in page.text_content("#key-reason")
        page.fill("#key-input", "wrong")
        with page.expect_response("**/v1/models") as refused:
            page.click("#key-form button")
        assert refused.value.status == 401
        panel.wait_for(state="visible")
        page.fill("#key-input", "sesame")
        page.click("#key-form button")
        panel.wait_for(state="hidden")
        page.wait_for_function("document.getElementById('model').dataset.loaded === '1'")
        assert page.evaluate("localStorage.getItem('trioserve.api_key')") == "sesame"

        page.click("details.settings summary")
        page.fill("#max-tokens", "8")
        with page.expect_request("**/v1/chat/completions") as sent:
            reply = b.send("Hello")
        assert sent.value.headers["authorization"] == "Bearer sesame"
        assert b.wait_state(reply, "done", "error") == "done"

        # Kept: a reload asks for nothing.
        page.reload(wait_until="load")
        page.wait_for_function("document.getElementById('model').dataset.loaded === '1'")
        assert panel.is_hidden()
        page.click("details.settings summary")
        page.fill("#max-tokens", "8")
        reply = b.send("Hello again")
        assert b.wait_state(reply, "done", "error") == "done"

    await in_browser(chromium, url, tmp_path, "api-key", scenario)


async def test_server_errors_are_shown_in_the_servers_words(nursery, tiny_gguf, chromium, tmp_path):
    url = await start_server(nursery, make_settings(tiny_gguf))

    def scenario(b: Browser) -> None:
        page = b.page
        page.fill("#temperature", "5")
        reply = b.send("Hello")
        assert b.wait_state(reply, "error", "done") == "error"
        refused = b.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "temperature": 5, "stream": True})
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert "temperature" in message
        assert reply.locator(".content").text_content() == message
        assert reply.get_attribute("role") == "alert"
        assert page.input_value("#prompt") == "Hello"  # back in the box, to send again
        assert "unsent" in page.locator(".msg.user").first.get_attribute("class")

        # An error event inside the stream: its message, as sent.
        words = "the engine failed <here> & stopped"
        stream = sse_body(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Half a"}}]},
            {"error": {"message": words, "type": "server_error", "param": None, "code": None}},
        )
        page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream))
        page.fill("#temperature", "1")
        reply = b.send("Hello")
        assert b.wait_state(reply, "error", "done") == "error"
        assert reply.locator(".content").text_content() == words

        # Once the server accepts the request again, the conversation goes on from before the failures.
        page.unroute("**/v1/chat/completions")
        page.click("details.settings summary")
        page.fill("#max-tokens", "4")
        with page.expect_request("**/v1/chat/completions") as sent:
            reply = b.send("Hello")
        assert sent.value.post_data_json["messages"] == [{"role": "user", "content": "Hello"}]
        assert b.wait_state(reply, "done", "error") == "done"

    await in_browser(chromium, url, tmp_path, "errors", scenario)


def sse_body(*payloads: dict) -> str:
    return "".join(f"data: {json.dumps(p)}\n\n" for p in payloads) + "data: [DONE]\n\n"


async def test_the_reasoning_channel_is_shown_folded(server, chromium, tmp_path):
    """The tiny model has no reasoning channel, so the server's stream is
    stood in for by one in its shape (role chunk, reasoning deltas, content
    deltas, finish), split at awkward places."""
    thinking = ["The user greets me", " <politely>.", "\nI answer & wave."]
    answer = ["Hello", " <there>", "!"]
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"reasoning_content": t}, "finish_reason": None}]} for t in thinking]
    chunks += [{"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]} for t in answer]
    chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    body = sse_body(*chunks).replace("\n\n", "\r\n\r\n", 2)  # CRLF line ends are read too

    def scenario(b: Browser) -> None:
        page = b.page
        page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, content_type="text/event-stream", body=body))
        reply = b.send("Hi")
        assert b.wait_state(reply, "done", "error") == "done"
        reasoning = reply.locator("details.reasoning")
        assert reasoning.is_visible() and reasoning.get_attribute("open") is None  # folded
        assert reasoning.locator("summary").text_content() == "Reasoning"
        assert reply.locator(".content").text_content() == "".join(answer)
        assert reasoning.locator(".reasoning-text").text_content() == "".join(thinking)
        reasoning.locator("summary").click()
        assert reasoning.locator(".reasoning-text").is_visible()
        # Only the answer joins the conversation.
        page.unroute("**/v1/chat/completions")
        page.click("details.settings summary")
        page.fill("#max-tokens", "4")
        with page.expect_request("**/v1/chat/completions") as sent:
            reply = b.send("Bye")
        assert sent.value.post_data_json["messages"][1] == {"role": "assistant", "content": "".join(answer)}
        assert b.wait_state(reply, "done", "error") == "done"

    await in_browser(chromium, server, tmp_path, "reasoning", scenario)


@pytest.mark.slow
async def test_the_page_streams_a_real_smollm2_reply(nursery, chromium, tmp_path):
    engine = EngineConfig(model="smollm2", max_num_seqs=2)
    settings = attrs.evolve(ServerSettings(engine=engine), host="127.0.0.1", port=0, log_level="warning")
    url = await start_server(nursery, settings)
    question = "What is the capital of France?"

    def scenario(b: Browser) -> None:
        page = b.page
        page.wait_for_function("document.getElementById('model').dataset.loaded === '1'")
        page.fill("#temperature", "0")
        page.click("details.settings summary")
        page.fill("#max-tokens", "24")
        reply = b.send(question)
        assert b.wait_state(reply, "done", "error", timeout_ms=90_000) == "done"
        text = reply.locator(".content").text_content()
        assert text.strip()
        model = page.input_value("#model")
        response = b.post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 24})
        assert response.status_code == 200, response.text
        assert text == (response.json()["choices"][0]["message"]["content"] or "")

    await in_browser(chromium, url, tmp_path, "smollm2", scenario)

