"""One engine's fault stays in its engine (issue #49, finding 2): a model
whose step raises mid-stream beside a healthy one, on a real server.

The fault is real: the model's step raises on its device thread, where the
server's own actors run it. What raises is chosen at three places:
``inputs`` (building the step's tensors on the device, where a "meta"
device raised outside the handler that marked a fault fatal, and took
every model down), ``forward`` (inside the forward pass) and ``actor`` (the
worker actor itself, between steps: an exception that leaves the engine's
actors altogether). The faulty model is the one loaded without batch
invariance, so the healthy one runs beside it untouched.

Then: the faulty model's stream ends with an error event, its requests are
503 engine_dead, /health and /v1/models say it is dead, the healthy model
answers as before (sessions too), and the dead one is unloaded and loaded
again, and serves. Alone, a dead model makes /health 503.

And a load's options are checked as request fields are: 400 naming the option."""

from __future__ import annotations

import threading
from pathlib import Path

import attrs
import httpx
import pytest
import trio

import trioserve.models.step_runner as step_runner
from tests.http.conftest import MODEL_NAME, assert_error, kv_bytes, make_settings, read_sse, start_server
from tests.tiny_model import tiny_weights, train_tiny_tokenizer, write_gguf
from trioserve.actors.worker import HeapTrimmer
from trioserve.models.decoder import DecoderModel

TIMEOUT = 60
KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {KEY}"}
POOL = kv_bytes(1024)
FAULTY = {"batch_invariant": False}  # the options the faulty model is loaded with: what the injected fault keys on
MESSAGE = "injected: the device lost this step"


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = train_tiny_tokenizer()
    return write_gguf(tmp_path_factory.mktemp("fault") / "other.gguf", tiny_weights(tokenizer.get_vocab_size(), seed=7), tokenizer)


class Fault:
    """A RuntimeError raised at ``where`` by the engine without batch
    invariance, on its ``after``-th step (or worker turn) from `arm`."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._lock = threading.Lock()
        self._left: int | None = None  # None: disarmed
        self.fired = 0

    def arm(self, after: int) -> None:
        with self._lock:
            self._left = after

    def disarm(self) -> None:
        with self._lock:
            self._left = None

    def hit(self) -> None:
        with self._lock:
            if self._left is None:
                return
            self._left -= 1
            if self._left > 0:
                return
            self._left = None
            self.fired += 1
        raise RuntimeError(MESSAGE)


@pytest.fixture(params=["inputs", "forward", "actor"])
def fault(request, monkeypatch) -> Fault:
    fault = Fault(request.param)
    if fault.where == "inputs":
        real_build = step_runner.build_step

        def build_step(chunks, block_size, device, *, fixed=False):
            if not fixed:
                fault.hit()
            return real_build(chunks, block_size, device, fixed=fixed)

        monkeypatch.setattr(step_runner, "build_step", build_step)
    elif fault.where == "forward":
        real_forward = DecoderModel.forward

        def forward(self, batch, cache):
            if not self.batch_invariant:
                fault.hit()
            return real_forward(self, batch, cache)

        monkeypatch.setattr(DecoderModel, "forward", forward)
    else:  # the worker actor asks its heap trimmer after every step it ran
        real_due = HeapTrimmer.due

        def due(self):
            fault.hit()  # only the faulty model steps while this is armed
            return real_due(self)

        monkeypatch.setattr(HeapTrimmer, "due", due)
    return fault


def admin_settings(model: Path, **engine):
    return attrs.evolve(make_settings(model, kv_cache_bytes=POOL, **engine), admin_api_key=KEY)


async def greedy(client: httpx.AsyncClient, model: str, max_tokens: int = 8) -> str:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


async def stream(client: httpx.AsyncClient, model: str, max_tokens: int):
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        return await read_sse(response)


async def load(client: httpx.AsyncClient, name: str, path: Path, options: dict | None = None) -> httpx.Response:
    return await client.post("/admin/models/load", headers=ADMIN, json={"name": name, "path": str(path), "options": options or {}})


async def cards(client: httpx.AsyncClient) -> dict[str, dict]:
    response = await client.get("/v1/models")
    assert response.status_code == 200, response.text
    return {card["id"]: card for card in response.json()["data"]}


async def test_a_fault_kills_only_its_engine(nursery, tiny_gguf, other_gguf, fault, capfd):
    url = await start_server(nursery, admin_settings(tiny_gguf))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            loaded = await load(client, "other", other_gguf, FAULTY)
            assert loaded.status_code == 200, loaded.text
            first = await greedy(client, MODEL_NAME, 24)
            other = await greedy(client, "other")

            # The fault: the other model's third step raises, mid-stream;
            # the healthy model streams beside it (where the fault can tell them apart).
            fault.arm(after=3)
            results: dict[str, object] = {}

            async def run(name: str) -> None:
                results[name] = await stream(client, name, 24)

            async with trio.open_nursery() as both:
                both.start_soon(run, "other")
                if fault.where != "actor":
                    both.start_soon(run, MODEL_NAME)
            assert fault.fired == 1
            fault.disarm()
            log = capfd.readouterr().err
            assert "the engine is dead" in log and f"RuntimeError: {MESSAGE}" in log and "Traceback" in log, log[-2000:]

            broken = results["other"]
            error = broken.chunks[-1]["error"]
            assert error["type"] == "server_error", error
            assert MESSAGE in error["message"], error
            text = "".join(c["choices"][0]["text"] for c in broken.chunks[:-1])
            assert 0 < len(text) < len(first), text  # tokens came, then the error
            if fault.where != "actor":
                assert results[MODEL_NAME].content() == first  # untouched by the fault beside it
                assert results[MODEL_NAME].chunks[-1]["choices"][0]["finish_reason"] == "length"

            # The dead model's requests: 503 engine_dead, buffered or streamed, every route.
            cause = "the model 'other' is dead: "
            body = {"model": "other", "prompt": "x", "max_tokens": 2}
            refused = await client.post("/v1/completions", json=body)
            error = assert_error(refused, 503, fragment=cause, param=None, kind="server_error", code="engine_dead")
            assert MESSAGE in error["message"] and "unloads it and loads it again" in error["message"], error
            chat = {"model": "other", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
            assert_error(await client.post("/v1/chat/completions", json=chat), 503, fragment=cause, param=None, kind="server_error", code="engine_dead")
            session = await client.post("/v1/sessions", json={"model": "other"})
            assert_error(session, 503, fragment=cause, param=None, kind="server_error", code="engine_dead")
            embed = await client.post("/v1/embeddings", json={"model": "other", "input": "x"})
            assert_error(embed, 503, fragment=cause, param=None, kind="server_error", code="engine_dead")

            # What the server says about itself.
            health = await client.get("/health")
            assert health.status_code == 200, health.text  # the healthy model still serves: keep sending
            assert health.json()["status"] == "ok" and MESSAGE in health.json()["dead"]["other"], health.text
            assert set(health.json()["dead"]) == {"other"}
            listed = await cards(client)
            assert (listed[MODEL_NAME]["state"], listed["other"]["state"]) == ("ready", "dead")
            assert MESSAGE in listed["other"]["cause"] and "cause" not in listed[MODEL_NAME]
            one = await client.get("/v1/models/other")
            assert one.json()["state"] == "dead", one.text
            admin = {m["name"]: m for m in (await client.get("/admin/models", headers=ADMIN)).json()["data"]}
            assert admin["other"]["state"] == "dead" and MESSAGE in admin["other"]["cause"]
            taken = await load(client, "other", other_gguf)
            assert_error(taken, 409, fragment="the model name 'other' is taken by a dead model; unload it first", param="name", code="model_exists")

            # The healthy model, its sessions and the shared routes go on.
            assert await greedy(client, MODEL_NAME, 24) == first
            made = await client.post("/v1/sessions", json={"model": MODEL_NAME, "system": "Be brief."})
            assert made.status_code == 200, made.text
            turn = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
            answered = await client.post(f"/v1/sessions/{made.json()['id']}/turns", json=turn)
            assert answered.status_code == 200, answered.text
            assert (await client.get("/metrics")).status_code == 200

            # A dead model is unloaded, loaded again (loads still work) and serves.
            gone = await client.post("/admin/models/unload", headers=ADMIN, json={"name": "other", "timeout_s": 5})
            assert gone.status_code == 200, gone.text
            assert (await client.get("/health")).json() == {"status": "ok"}
            again = await load(client, "other", other_gguf, FAULTY)
            assert again.status_code == 200, again.text
            assert again.json()["state"] == "ready"
            assert await greedy(client, "other") == other
            assert (await cards(client))["other"]["state"] == "ready"
            assert await greedy(client, MODEL_NAME, 24) == first


async def test_the_only_model_dead_fails_health(nursery, tiny_gguf, monkeypatch):
    """With no model left serving, /health is 503 dead (a load balancer
    stops sending here); unloaded and loaded again, the model serves."""
    fault = Fault("inputs")
    real_build = step_runner.build_step

    def build_step(chunks, block_size, device, *, fixed=False):
        fault.hit()
        return real_build(chunks, block_size, device, fixed=fixed)

    monkeypatch.setattr(step_runner, "build_step", build_step)
    url = await start_server(nursery, admin_settings(tiny_gguf))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            before = await greedy(client, MODEL_NAME)
            fault.arm(after=1)
            failed = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
            assert_error(failed, 503, fragment=MESSAGE, param=None, kind="server_error")
            health = await client.get("/health")
            assert health.status_code == 503, health.text
            body = health.json()
            assert body["status"] == "dead" and MESSAGE in body["cause"] and set(body["dead"]) == {MODEL_NAME}, body
            assert (await cards(client))[MODEL_NAME]["state"] == "dead"
            refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})  # the one model, not named
            assert_error(refused, 503, fragment=f"the model '{MODEL_NAME}' is dead", param=None, kind="server_error", code="engine_dead")

            gone = await client.post("/admin/models/unload", headers=ADMIN, json={"name": MODEL_NAME})
            assert gone.status_code == 200, gone.text
            again = await load(client, MODEL_NAME, tiny_gguf)
            assert again.status_code == 200, again.text
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert await greedy(client, MODEL_NAME) == before


BAD_OPTIONS = [
    ({"max_num_seqs": 2.5}, "options.max_num_seqs", "options.max_num_seqs: expected a positive integer, got number 2.5"),
    ({"max_num_seqs": "2.5"}, "options.max_num_seqs", "options.max_num_seqs: expected a positive integer, got '2.5'"),
    ({"max_num_seqs": 0}, "options.max_num_seqs", "options.max_num_seqs: expected a positive integer, got number 0"),
    ({"max_num_seqs": True}, "options.max_num_seqs", "options.max_num_seqs: expected a positive integer, got boolean True"),
    ({"max_num_seqs": None}, "options.max_num_seqs", "options.max_num_seqs: expected a positive integer, got null"),
    ({"kv_cache_bytes": True}, "options.kv_cache_bytes",
     'options.kv_cache_bytes: expected a positive whole number of bytes, or a size like "64MiB", got boolean True'),
    ({"kv_cache_bytes": "lots"}, "options.kv_cache_bytes", "options.kv_cache_bytes: must be a size like 512MiB or 2GiB, got 'lots'"),
    ({"kv_cache_bytes": 1}, "options.kv_cache_bytes", "kv_cache_bytes (1) is less than one block (2048 bytes)"),
    ({"prefix_cache": 1}, "options.prefix_cache", "options.prefix_cache: expected true or false, got number 1"),
    ({"max_step_ms": -1}, "options.max_step_ms", "options.max_step_ms: expected a number of milliseconds, 0 or more, got number -1"),
    ({"dtype": 16}, "options.dtype", "options.dtype: expected one of auto, bfloat16, float32, float16, got number 16"),
    ({"device": "meta"}, "options.device", "options.device: 'meta' cannot run a model (one of: cpu, cuda, or cuda:N)"),
    ({"device": "nonsense"}, "options.device", "options.device: 'nonsense' is not a torch device (one of: cpu, cuda, or cuda:N)"),
    ({"device": ["cpu"]}, "options.device", "options.device: expected a string, got array ['cpu']"),
]  # fmt: skip


async def test_load_options_are_checked_as_request_fields(nursery, tiny_gguf, other_gguf):
    """Each bad option is a 400 naming it, leaving nothing behind; the
    device must be one a model runs on here ("meta" holds no data)."""
    url = await start_server(nursery, admin_settings(tiny_gguf))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            for options, param, message in BAD_OPTIONS:
                refused = await load(client, "other", other_gguf, options)
                assert_error(refused, 400, fragment=message, param=param)
                assert set(await cards(client)) == {MODEL_NAME}, options  # nothing left behind
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await load(client, "other", other_gguf, {"max_num_seqs": 2, "device": "cpu", "kv_cache_bytes": "1MiB"})).status_code == 200
