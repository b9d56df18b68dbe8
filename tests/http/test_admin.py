"""The admin routes (trioserve/http/admin.py): models loaded and unloaded
at run time while the others serve, behind their own key; every refusal
with its status and message, leaving the registry as it was."""

from __future__ import annotations

import threading
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import MAX_MODEL_LEN, MODEL_NAME, assert_error, kv_bytes, make_settings, read_sse, start_server
from tests.tiny_model import tiny_weights, train_tiny_tokenizer, write_gguf

TIMEOUT = 60
KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {KEY}"}
POOL = kv_bytes(1024)  # each tiny model's KV pool in these tests
ROPE = 2 * MAX_MODEL_LEN * 8 * 4  # and its RoPE tables: cos and sin, 256 positions x 8 frequencies (head size 16), float32


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = train_tiny_tokenizer()
    return write_gguf(tmp_path_factory.mktemp("admin") / "other.gguf", tiny_weights(tokenizer.get_vocab_size(), seed=7), tokenizer)


def admin_settings(model: Path, **more):
    return attrs.evolve(make_settings(model, kv_cache_bytes=POOL), admin_api_key=KEY, **more)


async def registry(client: httpx.AsyncClient) -> list[tuple[str, str]]:
    response = await client.get("/admin/models", headers=ADMIN)
    assert response.status_code == 200, response.text
    return [(m["name"], m["state"]) for m in response.json()["data"]]


async def greedy(client: httpx.AsyncClient, model: str) -> str:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


async def test_load_serve_and_unload_a_model_while_the_first_serves(nursery, tiny_gguf, other_gguf):
    url = await start_server(nursery, admin_settings(tiny_gguf))
    alone = await start_server(nursery, attrs.evolve(make_settings(other_gguf, kv_cache_bytes=POOL), served_model_name="other"))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            client.base_url = alone
            expected = await greedy(client, "other")
            client.base_url = url
            first = await greedy(client, MODEL_NAME)
            loaded = await client.post("/admin/models/load", headers=ADMIN, json={"name": "other", "path": str(other_gguf), "options": {"max_num_seqs": 2}})
            assert loaded.status_code == 200, loaded.text
            assert (loaded.json()["id"], loaded.json()["state"]) == ("other", "ready")
            assert await registry(client) == [(MODEL_NAME, "ready"), ("other", "ready")]
            assert await greedy(client, "other") == expected  # as the model answers served alone
            assert await greedy(client, MODEL_NAME) == first  # the first one unchanged
            listing = (await client.get("/admin/models", headers=ADMIN)).json()
            other = next(m for m in listing["data"] if m["name"] == "other")
            assert other["memory_bytes"] == other_gguf.stat().st_size + POOL + ROPE
            assert other["requests_in_flight"] == 0

            gone = await client.post("/admin/models/unload", headers=ADMIN, json={"name": "other"})
            assert gone.status_code == 200, gone.text
            assert gone.json() == {"name": "other", "unloaded": True, "requests_in_flight": 0, "requests_ended": 0}
            assert await registry(client) == [(MODEL_NAME, "ready")]
            refused = await client.post("/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 1})
            assert_error(refused, 404, fragment="the model 'other' does not exist", param="model", code="model_not_found")
            assert await greedy(client, MODEL_NAME) == first


async def stream(client: httpx.AsyncClient, model: str, max_tokens: int, started: trio.Event, out: list) -> None:
    body = {"model": model, "prompt": "Tell me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        started.set()
        out.append(await read_sse(response))


async def wait_running(client: httpx.AsyncClient, model: str) -> None:
    while True:
        stats = next(m for m in (await client.get("/admin/models", headers=ADMIN)).json()["data"] if m["name"] == model)
        if stats["running"] == 1:
            return
        await trio.sleep(0.01)


@pytest.mark.parametrize("timeout_s", [0, 60])
async def test_unload_drains_a_stream_in_flight(nursery, tiny_gguf, other_gguf, slow_steps, timeout_s):
    """With time to finish, the stream ends as it would have; with none, it
    ends with an error event. Either way the unload reports it, the model is
    gone, and the other model serves on."""
    url = await start_server(nursery, attrs.evolve(admin_settings(tiny_gguf), more_models=[("other", str(other_gguf))]))
    slow_steps(0.02)
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            out: list = []
            started = trio.Event()
            async with trio.open_nursery() as inner:
                inner.start_soon(stream, client, "other", 40, started, out)
                await started.wait()
                await wait_running(client, "other")
                results: list = []

                async def unload():
                    results.append(await client.post("/admin/models/unload", headers=ADMIN, json={"name": "other", "timeout_s": timeout_s}))

                inner.start_soon(unload)
                while ("other", "unloading") not in await registry(client):
                    await trio.sleep(0.005)
                if timeout_s:  # while it drains, the name is neither loadable again nor routable
                    again = await client.post("/admin/models/load", headers=ADMIN, json={"name": "other", "path": str(other_gguf)})
                    assert_error(again, 409, fragment="the model name 'other' is already unloading", param="name", code="model_exists")
                    twice = await client.post("/admin/models/unload", headers=ADMIN, json={"name": "other"})
                    assert_error(twice, 409, fragment="the model 'other' is unloading", param="name", code="model_busy")
                    late = await client.post("/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 1})
                    assert_error(late, 503, fragment="the model 'other' is being unloaded", param=None, kind="server_error", code="model_unloading")
            gone = results[0]
            assert gone.status_code == 200, gone.text
            assert gone.json()["requests_in_flight"] == 1
            sse = out[0]
            if timeout_s:
                assert gone.json()["requests_ended"] == 0
                assert sse.chunks[-1]["choices"][0]["finish_reason"] == "length"
            else:
                assert gone.json()["requests_ended"] == 1
                error = sse.chunks[-1]["error"]
                assert "the model 'other' was unloaded" in error["message"], error
                assert error["type"] == "server_error"
            assert sse.payloads[-1] == "[DONE]" or "error" in sse.chunks[-1]
            assert await registry(client) == [(MODEL_NAME, "ready")]
            stats = (await client.get("/metrics")).json()
            assert "models" not in stats  # one model again
            assert (await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})).status_code == 200


async def test_admin_refusals_leave_the_registry_unchanged(nursery, tiny_gguf, other_gguf, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    budget = tiny_gguf.stat().st_size + POOL + ROPE + 4096  # room for the first model and a few KiB more
    url = await start_server(nursery, admin_settings(tiny_gguf, memory_budget=budget))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            before = await registry(client)
            load = {"name": "other", "path": str(other_gguf)}

            missing_key = await client.post("/admin/models/load", json=load)
            assert_error(missing_key, 401, fragment="missing or wrong admin key", param=None, kind="authentication_error", code="invalid_admin_key")
            wrong_key = await client.post("/admin/models/load", json=load, headers={"Authorization": "Bearer nope"})
            assert_error(wrong_key, 401, fragment="missing or wrong admin key", param=None, kind="authentication_error", code="invalid_admin_key")

            over = await client.post("/admin/models/load", headers=ADMIN, json=load)
            assert_error(over, 400, fragment=f"loading 'other' needs {other_gguf.stat().st_size + POOL} bytes", param="path", code="over_memory_budget")
            assert f"of the {budget}-byte --memory-budget" in over.json()["error"]["message"]

            taken = await client.post("/admin/models/load", headers=ADMIN, json={"name": MODEL_NAME, "path": str(other_gguf)})
            assert_error(taken, 409, fragment=f"the model name '{MODEL_NAME}' is already served", param="name", code="model_exists")

            small = {"name": "bad", "path": str(corrupt), "options": {"kv_cache_bytes": "1KiB"}}
            broken = await client.post("/admin/models/load", headers=ADMIN, json=small)
            assert_error(broken, 400, fragment=f"loading 'bad' from {corrupt} failed:", param="path", code="load_failed")
            assert "\n" not in broken.json()["error"]["message"]
            nowhere = await client.post("/admin/models/load", headers=ADMIN, json={**small, "path": str(tmp_path / "none.gguf")})
            assert_error(nowhere, 400, fragment="failed:", param="path", code="load_failed")

            for body, field, fragment in (
                ({"path": str(other_gguf)}, "name", "name: expected a non-empty string"),
                ({"name": "x"}, "path", "path: expected a non-empty string"),
                ({**load, "options": {"port": 1}}, "options.port", "options.port: not a setting a load may choose"),
                ({**load, "options": {"kv_cache_bytes": "lots"}}, "options.kv_cache_bytes", "must be a size like 512MiB"),
                ({**load, "options": {"max_num_seqs": 0}}, "options.max_num_seqs", "options.max_num_seqs: expected a positive integer, got number 0"),
            ):
                refused = await client.post("/admin/models/load", headers=ADMIN, json=body)
                assert_error(refused, 400, fragment=fragment, param=field)
            unknown = await client.post("/admin/models/unload", headers=ADMIN, json={"name": "ghost"})
            assert_error(unknown, 404, fragment="the model 'ghost' does not exist", param="name", code="model_not_found")
            bad_timeout = await client.post("/admin/models/unload", headers=ADMIN, json={"name": MODEL_NAME, "timeout_s": -1})
            assert_error(bad_timeout, 400, fragment="timeout_s: expected a number of seconds, 0 or more", param="timeout_s")
            assert await registry(client) == before


async def test_a_second_load_of_a_name_still_loading_is_a_409(nursery, tiny_gguf, other_gguf, monkeypatch):
    """The name is taken from the moment a load is asked for: a second load
    of it waits for nothing and is refused; requests to it get 503 with
    Retry-After until it is ready."""
    from trioserve.http import registry as registry_module

    gate = trio.Event()
    gate.set()  # open for the first model, loaded at start-up
    real_serve = registry_module.Model.serve

    async def held_serve(self, named, *, task_status=trio.TASK_STATUS_IGNORED):
        await gate.wait()
        await real_serve(self, named, task_status=task_status)

    monkeypatch.setattr(registry_module.Model, "serve", held_serve)
    url = await start_server(nursery, admin_settings(tiny_gguf))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            gate = trio.Event()  # closed for the next load
            results: list = []

            async def first_load():
                results.append(await client.post("/admin/models/load", headers=ADMIN, json={"name": "other", "path": str(other_gguf)}))

            async with trio.open_nursery() as inner:
                inner.start_soon(first_load)
                while ("other", "loading") not in await registry(client):
                    await trio.sleep(0.01)
                again = await client.post("/admin/models/load", headers=ADMIN, json={"name": "other", "path": str(other_gguf)})
                assert_error(again, 409, fragment="the model name 'other' is already loading", param="name", code="model_exists")
                early = await client.post("/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 1})
                assert_error(early, 503, fragment="the model 'other' is still loading", param=None, kind="server_error", code="loading")
                assert early.headers["Retry-After"] == "5"
                listed = {m["id"]: m["state"] for m in (await client.get("/v1/models")).json()["data"]}
                assert listed == {MODEL_NAME: "ready", "other": "loading"}
                gate.set()
            assert results[0].status_code == 200, results[0].text
            assert await registry(client) == [(MODEL_NAME, "ready"), ("other", "ready")]


async def test_admin_routes_are_off_without_their_key(nursery, tiny_gguf):
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), api_key="user-key"))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            for method, path in (("GET", "/admin/models"), ("POST", "/admin/models/load"), ("POST", "/admin/models/unload")):
                response = await client.request(method, path, headers={"Authorization": "Bearer user-key"}, json={})
                assert_error(response, 404, fragment="the admin routes are off: start the server with --admin-api-key", param=None, code="admin_off")


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model of ~50 MB in float32: big enough to see in the RSS."""
    from tests.tiny_model import TINY

    tokenizer = train_tiny_tokenizer()
    shape = {**TINY, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4}
    return write_gguf(tmp_path_factory.mktemp("wide") / "wide.gguf", tiny_weights(tokenizer.get_vocab_size(), seed=3, shape=shape), tokenizer, shape=shape)


def device_threads() -> int:
    """Engines' device threads alive now (trioserve/actors/device.py)."""
    return sum(1 for t in threading.enumerate() if t.name == "trioserve-device")


async def test_unloading_gives_the_memory_back(nursery, tiny_gguf, wide_gguf):
    """This process's RSS (as /admin/models reports it) grows by most of the
    model's size when it loads and falls back when it is unloaded."""
    url = await start_server(nursery, admin_settings(tiny_gguf))
    size = wide_gguf.stat().st_size
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:

            async def rss() -> int:
                return (await client.get("/admin/models", headers=ADMIN)).json()["rss_bytes"]

            before = await rss()
            devices = device_threads()
            loaded = await client.post("/admin/models/load", headers=ADMIN, json={"name": "wide", "path": str(wide_gguf), "options": {"kv_cache_bytes": "1MiB"}})
            assert loaded.status_code == 200, loaded.text
            assert (await client.post("/v1/completions", json={"model": "wide", "prompt": "hi", "max_tokens": 2})).status_code == 200
            grown = await rss()
            assert grown - before > size // 2, (before, grown, size)
            gone = await client.post("/admin/models/unload", headers=ADMIN, json={"name": "wide"})
            assert gone.status_code == 200, gone.text
            # The pages go back as the unload's collection frees them; allow the system a moment.
            with trio.move_on_after(10):
                while (after := await rss()) - before >= (grown - before) // 4:
                    await trio.sleep(0.2)
    assert device_threads() == devices  # its device thread is gone too
    assert after - before < (grown - before) // 4, f"RSS {before} -> {grown} loaded -> {after} unloaded (model file {size} bytes)"


async def test_the_other_models_stream_on_while_one_loads(nursery, tiny_gguf, wide_gguf, slow_steps):
    """A load runs in its own engine's thread: a stream on the first model
    keeps getting tokens while it goes on, and the new model serves once
    it is ready."""
    url = await start_server(nursery, admin_settings(tiny_gguf))
    slow_steps(0.005)
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            out: list = []
            started = trio.Event()
            span: list[float] = []
            async with trio.open_nursery() as inner:
                inner.start_soon(stream, client, MODEL_NAME, 240, started, out)
                await started.wait()
                await wait_running(client, MODEL_NAME)
                span.append(trio.current_time())
                loaded = await client.post("/admin/models/load", headers=ADMIN, json={"name": "wide", "path": str(wide_gguf), "options": {"kv_cache_bytes": "1MiB"}})
                span.append(trio.current_time())
                assert loaded.status_code == 200, loaded.text
                done = out  # the stream may still be running: wait for it below
            sse = done[0]
            during = [t for t in sse.times if span[0] < t < span[1]]
            assert during, f"no token arrived during the {span[1] - span[0]:.2f} s load"
            assert sse.chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert (await client.post("/v1/completions", json={"model": "wide", "prompt": "hi", "max_tokens": 2})).status_code == 200
