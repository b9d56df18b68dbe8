"""--memory-budget counts a model's RoPE tables (#49): cos and sin, float32,
[positions, head_dim / 2] each, for min(the file's context length,
--max-model-len) positions. A tiny model whose file declares a million
positions fits the budget by its file and KV pool alone, but its tables
(64 MiB) do not: the load is refused with the numbers before anything of
it is made, and the served models are as they were. Served with a shorter
--max-model-len, the same file fits. On a real server."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import MAX_MODEL_LEN, MODEL_NAME, assert_error, kv_bytes, make_settings, start_server
from tests.tiny_model import set_gguf_u32

TIMEOUT = 60
GUARD_S = 600  # a hang guard for the process, not a timing
KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {KEY}"}
POOL = kv_bytes(1024)
FREQUENCIES = 8  # the tiny model's heads are 16 wide: 8 rotary frequencies
LONG = 1 << 20  # the positions the long file declares


def tables(positions: int) -> int:
    """cos and sin, positions x FREQUENCIES float32 values each."""
    return 2 * positions * FREQUENCIES * 4


@pytest.fixture(scope="module")
def long_gguf(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny model, its metadata saying it reads a million positions."""
    path = tmp_path_factory.mktemp("rope-budget") / "long.gguf"
    shutil.copyfile(tiny_checkpoints["gguf_f32"], path)
    return set_gguf_u32(path, "llama.context_length", LONG)


async def test_a_load_over_the_budget_by_its_rope_tables_is_refused(nursery, tiny_gguf, long_gguf):
    first = tiny_gguf.stat().st_size + POOL + tables(MAX_MODEL_LEN)  # the model served from the start, tables and all
    size = long_gguf.stat().st_size
    assert tables(LONG) == 64 << 20
    budget = first + size + POOL + tables(LONG) - 1  # one byte short of the long model's tables
    settings = attrs.evolve(make_settings(tiny_gguf, kv_cache_bytes=POOL), admin_api_key=KEY, memory_budget=budget)
    url = await start_server(nursery, settings)
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            listed = (await client.get("/admin/models", headers=ADMIN)).json()
            assert [(m["name"], m["memory_bytes"]) for m in listed["data"]] == [(MODEL_NAME, first)]

            refused = await client.post("/admin/models/load", headers=ADMIN, json={"name": "long", "path": str(long_gguf)})
            error = assert_error(refused, 400, fragment="", param="path", code="over_memory_budget")
            assert error["message"] == (
                f"loading 'long' needs {size + POOL + tables(LONG)} bytes "
                f"(weights {size} + KV pool {POOL} + RoPE tables {tables(LONG)}: cos and sin for {LONG} positions x {FREQUENCIES} frequencies, float32); "
                f"the served models take {first} of the {budget}-byte --memory-budget, leaving {budget - first}"
            )
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL_NAME]  # the name is free again

            # Served for 4096 positions, the same file's tables are 256 KiB: it fits, and serves.
            fits = await client.post(
                "/admin/models/load", headers=ADMIN, json={"name": "long", "path": str(long_gguf), "options": {"max_model_len": 4096}}
            )
            assert fits.status_code == 200, fits.text
            assert fits.json()["max_model_len"] == 4096
            listed = {m["name"]: m["memory_bytes"] for m in (await client.get("/admin/models", headers=ADMIN)).json()["data"]}
            assert listed == {MODEL_NAME: first, "long": size + POOL + tables(4096)}
            answer = await client.post("/v1/completions", json={"model": "long", "prompt": "Once upon", "max_tokens": 2})
            assert answer.status_code == 200, answer.text


def test_the_first_model_is_refused_at_start_up_too(long_gguf):
    """`trioserve serve` with the long model and a budget one byte short of
    its tables does not start: exit status 2 and the line saying why."""
    size = long_gguf.stat().st_size
    budget = size + POOL + tables(LONG) - 1
    command = [
        sys.executable, "-m", "trioserve.cli", "serve", "--model", str(long_gguf), "--dtype", "float32", "--port", "0",
        "--kv-cache-bytes", str(POOL), "--memory-budget", str(budget), "--served-model-name", MODEL_NAME, "--state-dir", "none",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", timeout=GUARD_S)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = (
        f"trioserve: error: loading '{MODEL_NAME}' needs {size + POOL + tables(LONG)} bytes "
        f"(weights {size} + KV pool {POOL} + RoPE tables {tables(LONG)}: cos and sin for {LONG} positions x {FREQUENCIES} frequencies, float32); "
        f"the served models take 0 of the {budget}-byte --memory-budget, leaving {budget}"
    )
    assert line in proc.stderr.splitlines(), proc.stderr[-3000:]
