"""LoRA adapter files read as untrusted input, through POST
/v1/lora_adapters on a real server (#49): a FIFO or a link to /dev/zero in
a file's place, or a weights file past what the adapter can hold, is
refused at once with a 400, the server serves on, and a good adapter loads
after. Without API keys (the operator's server) the message says what is
wrong with which file; with keys, a tenant is told nothing of the server's
directories: what is not a readable adapter gets the one message for
every such path (http/lora.py), and a refusal past that names only the
file, never its directory."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import trio

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, start_server
from tests.lora_files import dev_zero_in_place, fifo_in_place, write_peft_adapter
from tests.tiny_model import TINY
from trioserve.models.files import MAX_JSON

TIMEOUT = 60  # a hang guard: every refusal here comes at once
TENANT = "tenant-key"
BOUND = (1 << 20) + 8 * 4 * 1024 * 2 + 1024 * 28  # rank 4, every module of the tiny model (tests/models/test_lora_files.py)


@pytest.fixture
def bad_adapters(tmp_path) -> dict[str, Path]:
    """Adapter directories with one file replaced, by what replaced it."""
    made = {name: write_peft_adapter(tmp_path / name, TINY, rank=4, extra_config={"target_modules": None}) for name in ("fifo", "zero", "big", "huge")}
    fifo_in_place(made["fifo"] / "adapter_config.json")
    dev_zero_in_place(made["zero"] / "adapter_model.safetensors")
    os.truncate(made["big"] / "adapter_model.safetensors", BOUND + 1)  # sparse: nothing is written, and nothing is read
    os.truncate(made["huge"] / "adapter_config.json", MAX_JSON + 1)
    made["good"] = write_peft_adapter(tmp_path / "good", TINY, rank=4)
    return made


async def try_all(url: str, key: str | None, adapters: dict[str, Path]) -> dict[str, httpx.Response]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers=headers) as client:
        with trio.fail_after(TIMEOUT):
            answers = {name: await client.post("/v1/lora_adapters", json={"name": name, "path": str(path)}) for name, path in adapters.items()}
            assert (await client.get("/health")).json() == {"status": "ok"}
            listed = (await client.get("/v1/lora_adapters")).json()["data"]
            assert [a["name"] for a in listed] == ["good"]
            done = await client.post("/v1/completions", json={"model": "good", "prompt": "Once", "max_tokens": 2})
            assert done.status_code == 200, done.text
            assert (await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once", "max_tokens": 2})).status_code == 200
    return answers


async def test_the_operator_is_told_which_file_and_what_it_is(nursery, tiny_gguf, bad_adapters):
    answers = await try_all(await start_server(nursery, make_settings(tiny_gguf)), None, bad_adapters)
    expected = {
        "fifo": "adapter 'fifo': adapter_config.json is a FIFO (named pipe), not a regular file",
        "zero": "adapter 'zero': adapter_model.safetensors is a character device, not a regular file",
        "big": f"adapter 'big': adapter_model.safetensors is {BOUND + 1} bytes, more than the {BOUND} trioserve reads for it "
        "(the most an adapter of rank 4 for every module of this model can hold)",
        "huge": f"adapter 'huge': adapter_config.json is {MAX_JSON + 1} bytes, more than the {MAX_JSON} trioserve reads for it",
    }
    for name, message in expected.items():
        error = assert_error(answers[name], 400, fragment=message, param="path")
        assert error["message"] == message
    assert answers["good"].status_code == 200, answers["good"].text


async def test_a_tenant_is_told_nothing_of_the_servers_directories(nursery, tiny_gguf, bad_adapters):
    answers = await try_all(await start_server(nursery, make_settings(tiny_gguf, api_key=(TENANT,))), TENANT, bad_adapters)
    for name in ("fifo", "zero"):  # not a readable adapter: the one message, whatever the reason
        path = str(bad_adapters[name])
        error = assert_error(answers[name], 400, fragment="", param="path")
        assert error["message"] == (
            f"path: no LoRA adapter this server can read at {path!r} (a PEFT directory with adapter_config.json and adapter_model.safetensors)"
        )
    for name, file in (("big", "adapter_model.safetensors"), ("huge", "adapter_config.json")):
        error = assert_error(answers[name], 400, fragment=f"adapter '{name}': {file} is ", param="path")
        assert str(bad_adapters[name].parent) not in error["message"]  # the file's name, not where it is
    assert answers["good"].status_code == 200, answers["good"].text
    assert "path" not in answers["good"].json()
