"""LoRA adapters between tenants (issue #49, finding 7), through the real
server on the tiny model with two API keys: an adapter belongs to the key
that loaded it (no other lists, uses or unloads it: it is not there for
them), each key holds at most its share of --max-loras, no key is shown a
path or told why a path held no adapter, the operator's --lora adapters
are everyone's (and no key unloads them); concurrent loads past
--max-loras are 400s, never 500s; names and paths are checked as request
fields."""

from __future__ import annotations

import attrs
import httpx
import trio

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, start_server
from tests.http.test_lora import adapters, load  # noqa: F401 - the module's adapters fixture, shared

TIMEOUT = 60
ALICE, BOB = "alice-key", "bob-key"


def client(url: str, key: str | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers={"Authorization": f"Bearer {key}"} if key else {})


async def complete(c: httpx.AsyncClient, model: str) -> httpx.Response:
    return await c.post("/v1/completions", json={"model": model, "prompt": "The quick", "max_tokens": 2, "temperature": 0})


async def test_an_adapter_is_its_tenants_alone(nursery, tiny_gguf, adapters, tmp_path):  # noqa: F811
    settings = attrs.evolve(make_settings(tiny_gguf, api_key=(ALICE, BOB), max_loras=3), loras=[("everyone", str(adapters["b"]))])
    url = await start_server(nursery, settings)
    with trio.fail_after(TIMEOUT):
        async with client(url, ALICE) as alice, client(url, BOB) as bob:
            mine = await load(alice, "mine", adapters["a"])
            assert mine.status_code == 200, mine.text
            assert mine.json()["shared"] is False and "path" not in mine.json()
            assert (await complete(alice, "mine")).status_code == 200

            # Bob: not listed, not routed to, not unloaded; the 404s read as for a name nobody loaded.
            listed = (await bob.get("/v1/lora_adapters")).json()["data"]
            assert [(a["name"], a["shared"]) for a in listed] == [("everyone", True)] and all("path" not in a for a in listed)
            assert "mine" not in [m["id"] for m in (await bob.get("/v1/models")).json()["data"]]
            assert "mine" in [m["id"] for m in (await alice.get("/v1/models")).json()["data"]]
            assert_error(await bob.get("/v1/models/mine"), 404, fragment="the model 'mine' does not exist", param="model", code="model_not_found")
            used = await complete(bob, "mine")
            error = assert_error(used, 404, fragment="the model 'mine' does not exist", param="model", code="model_not_found")
            assert error["message"] == (await complete(bob, "nobodys")).json()["error"]["message"].replace("nobodys", "mine")
            assert_error(await bob.delete("/v1/lora_adapters/mine", params={"timeout_s": "0"}), 404, fragment="no LoRA adapter 'mine'", param="name", code="adapter_not_found")
            assert (await complete(alice, "mine")).status_code == 200  # still hers, untouched

            # The operator's adapter: everyone's to use, no key's to unload.
            assert (await complete(bob, "everyone")).status_code == 200
            shared = await bob.delete("/v1/lora_adapters/everyone")
            assert_error(shared, 403, fragment="was loaded for every API key by the operator (--lora)", param="name", kind="permission_error", code="adapter_shared")

            # --max-loras 3, one the operator's: the two left are one per key, so Alice cannot take Bob's.
            more = await load(alice, "second", adapters["a"])
            assert_error(more, 400, fragment=f"this API key holds 1 adapters on '{MODEL_NAME}', its share (1) of --max-loras (3)", param="name", code="too_many_adapters")
            first = await load(bob, "bobs", adapters["a"])
            assert first.status_code == 200, first.text
            again = await load(bob, "bobs2", adapters["a"])
            assert_error(again, 400, fragment="this API key holds 1 adapters on", param="name", code="too_many_adapters")
            assert (await alice.delete("/v1/lora_adapters/mine")).status_code == 200
            assert (await load(alice, "third", adapters["a"])).status_code == 200  # her room again

            # Paths: one message whatever is (or is not) there.
            plain_dir = tmp_path / "plain"
            plain_dir.mkdir()
            a_file = tmp_path / "file"
            a_file.write_text("x")
            for path in (tmp_path / "missing", plain_dir, a_file, "/etc", "/proc/self"):
                refused = await bob.post("/v1/lora_adapters", json={"name": "probe", "path": str(path)})
                error = assert_error(refused, 400, fragment=f"path: no LoRA adapter this server can read at {str(path)!r}", param="path")
                assert "exist" not in error["message"] and "directory" not in error["message"].split("(")[0]


async def test_names_and_paths_are_checked_as_fields(nursery, tiny_gguf, adapters):  # noqa: F811
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), admin_api_key="root"))
    with trio.fail_after(TIMEOUT):
        async with client(url) as c:
            for name in ("a/b", "..", "with space", "x" * 65, "naïve"):
                refused = await c.post("/v1/lora_adapters", json={"name": name, "path": str(adapters["a"])})
                assert_error(refused, 400, fragment="name: 1 to 64 letters, digits and ._- (it goes in URL paths)", param="name")
            for path, fragment in (
                ("/tmp/a\x00b", "path: a path cannot hold a NUL character"),
                ("/" + "d/" * 3000, "path: a path is at most 4095 bytes, got 6001"),
                ("/tmp/" + "n" * 300, "path: a path's parts are at most 255 bytes each, one has 300"),
            ):
                assert_error(await c.post("/v1/lora_adapters", json={"name": "ok", "path": path}), 400, fragment=fragment, param="path")
                admin = await c.post("/admin/models/load", json={"name": "m2", "path": path}, headers={"Authorization": "Bearer root"})
                assert_error(admin, 400, fragment=fragment, param="path")


async def test_concurrent_loads_past_max_loras_are_400s(nursery, tiny_gguf, adapters):  # noqa: F811
    url = await start_server(nursery, make_settings(tiny_gguf, max_loras=2))
    answers: list[httpx.Response] = []
    with trio.fail_after(TIMEOUT):
        async with client(url) as c:

            async def one(i: int) -> None:
                answers.append(await load(c, f"a{i}", adapters["a"]))

            async with trio.open_nursery() as loads:
                for i in range(6):
                    loads.start_soon(one, i)
            assert sorted(r.status_code for r in answers) == [200, 200, 400, 400, 400, 400], [r.text for r in answers]
            for r in answers:
                if r.status_code == 400:
                    assert_error(r, 400, fragment="as many as --max-loras (2) allows", param="name", code="too_many_adapters")
            assert len((await c.get("/v1/lora_adapters")).json()["data"]) == 2
            assert (await complete(c, MODEL_NAME)).status_code == 200
