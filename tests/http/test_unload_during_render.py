"""Unloading a model while one of its requests is in a chat-template render
that loops (#49), on a real server with two models: the render's child
process ends, the request gets its error, the unload completes, and the
other model serves all along.

The render runs in a child process killed at RENDER_TIMEOUT_S
(models/bounded.py); an unload gives the requests it ends STOP_GRACE_S to
finish (http/registry.py). The first is shorter than the second, so a
render that loops through an unload always ends within the unload's
grace, and the unload never leaves a render running for a model that is
gone: the test holds both constants to that, and runs with them as they
ship."""

from __future__ import annotations

import attrs
import httpx
import trio

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, start_server
from tests.http.test_unbounded import busy_children, spin_gguf  # noqa: F401 - the module's spin_gguf fixture, shared
from trioserve.http import registry
from trioserve.models import chat_template

GUARD_S = 120  # a hang guard, not a timing
KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {KEY}"}


def chat(model: str, content: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


async def test_unloading_a_model_ends_its_looping_render(nursery, tiny_gguf, spin_gguf):  # noqa: F811
    assert chat_template.RENDER_TIMEOUT_S < registry.STOP_GRACE_S  # what the unload relies on (see above)
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), admin_api_key=KEY))
    async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as client:
        with trio.fail_after(GUARD_S):
            loaded = await client.post("/admin/models/load", headers=ADMIN, json={"name": "spin", "path": str(spin_gguf)})
            assert loaded.status_code == 200, loaded.text  # its template passes the load check: it loops only on "spin"
            assert (await client.post("/v1/chat/completions", json=chat("spin", "hello"))).status_code == 200

            answers: list[httpx.Response] = []
            async with trio.open_nursery() as inner:

                async def spin() -> None:
                    answers.append(await client.post("/v1/chat/completions", json=chat("spin", "spin please")))

                inner.start_soon(spin)
                while not busy_children():  # the render loops in its child: now unload its model
                    await trio.sleep(0.05)
                assert (await client.post("/v1/chat/completions", json=chat(MODEL_NAME, "hello"))).status_code == 200
                unloading: list[httpx.Response] = []

                async def unload() -> None:
                    unloading.append(await client.post("/admin/models/unload", headers=ADMIN, json={"name": "spin", "timeout_s": 0}))

                inner.start_soon(unload)
                while not unloading:  # the other model serves, and routing to the one going away is refused, as the unload runs
                    ours = await client.post("/v1/chat/completions", json=chat(MODEL_NAME, "hello again"))
                    assert ours.status_code == 200, ours.text
                    if not unloading:
                        late = await client.post("/v1/chat/completions", json=chat("spin", "hello"))
                        assert late.status_code in (404, 503), late.text
                    await trio.sleep(0.2)

            (gone,) = unloading
            assert gone.status_code == 200, gone.text
            assert gone.json() == {"name": "spin", "unloaded": True, "requests_in_flight": 1, "requests_ended": 1}
            assert busy_children() == 0  # the render's child ended before the unload answered
            (answer,) = answers
            assert_error(
                answer, 400, param="messages",
                fragment=f"the chat template rejected the messages: rendering the chat template ran for more than {chat_template.RENDER_TIMEOUT_S:g} s and was stopped",
            )  # fmt: skip

            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL_NAME]
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await client.post("/v1/chat/completions", json=chat(MODEL_NAME, "hello"))).status_code == 200
            again = await client.post("/admin/models/load", headers=ADMIN, json={"name": "spin", "path": str(spin_gguf)})
            assert again.status_code == 200, again.text
            assert (await client.post("/v1/chat/completions", json=chat("spin", "hello"))).status_code == 200
    assert busy_children() == 0
