"""The server at each instruction-set level of the C kernels
($TRIOSERVE_CPU_FEATURES), as a user runs it: `trioserve serve` in its own
process. It says at start, in one line, how it computes; the model card and
/metrics say the same; and the AVX2 kernels (what a laptop or a Zen 3 VM
runs) give the very tokens the native ones give, through the served path.

A level this CPU cannot run is skipped with the reason."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.tiny_model import TINY
from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels import native_build
from trioserve.kernels.cpu import default_threads, level_fits

ROOT = Path(__file__).resolve().parent.parent
START_S = 180.0  # a hang guard: the tiny model starts in ~3 s here


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m trioserve serve` on 127.0.0.1, stopped by `close`."""

    def __init__(self, model: Path, level: str, *extra: str, cpus: set[int] | None = None):
        """``cpus``: the only CPUs the server may run on (its affinity mask,
        as taskset or a container's cpuset would set it)."""
        self.port = _free_port()
        env = {**os.environ, CPU_FEATURES_ENV: level}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trioserve", "serve", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", *extra],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )  # fmt: skip
        self.lines: list[str] = []
        deadline = time.monotonic() + START_S
        while not any(line.startswith("trioserve: computing on") for line in self.lines):
            line = self.proc.stderr.readline()
            if not line:
                self.close()
                pytest.fail(f"the server ended before it said how it computes:\n{''.join(self.lines)}")
            self.lines.append(line)
            if time.monotonic() > deadline:
                self.close()
                pytest.fail(f"no start-up line within {START_S} s:\n{''.join(self.lines)}")
        self.url = f"http://127.0.0.1:{self.port}"
        while True:  # the line comes as the engine is ready; the socket may lag it
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                pytest.fail("the server said it was computing but /health never answered 200")
            time.sleep(0.1)

    def compute_line(self) -> str:
        return next(line for line in self.lines if line.startswith("trioserve: computing on")).strip()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()


def _threads(n: int) -> str:
    return f"{n} thread{'' if n == 1 else 's'}"


def _greedy(url: str) -> list[str]:
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert "choices" in reply, reply
    return reply["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def native_tokens(tiny_checkpoints) -> list[str]:
    """The native level's greedy tokens on the tiny Q4_1 model in float32
    (what the narrower levels compute), from one server for the module: the
    AVX2 levels' tests compare with the same tokens, so they need not start
    a native server each."""
    wide = Server(tiny_checkpoints["gguf_q4_1"], "native", "--dtype", "float32")
    try:
        wide_isa = native_build.library_at("native").trioserve_isa().decode()
        assert httpx.get(f"{wide.url}/v1/models", timeout=30).json()["data"][0]["compute"]["cpu_kernels"] == wide_isa
        return _greedy(wide.url)
    finally:
        wide.close()


@pytest.mark.parametrize("level", ["avx2", "avx2-vnni"])
def test_an_avx2_level_says_how_it_computes_and_serves_the_native_tokens(tiny_checkpoints, level, request):
    unfit = level_fits(level)
    if unfit:
        pytest.skip(f"{CPU_FEATURES_ENV}={level}: {unfit}")
    if native_build.library_at("native") is None or native_build.library_at(level) is None:
        pytest.skip("no C kernels here (no C compiler, or TRIOSERVE_NATIVE_KERNELS=0)")
    model = tiny_checkpoints["gguf_q4_1"]
    narrow = Server(model, level)
    try:
        # dtype auto at a narrower level is what that CPU would get: float32 (no native bf16).
        assert narrow.compute_line() == (
            f"trioserve: computing on cpu, float32, native kernels ({level}), int8 activations, {_threads(default_threads())}"
        )
        want = {"device": "cpu", "dtype": "float32", "kv_dtype": "float32", "kernels": "native", "cpu_kernels": level, "activations": "int8",
                "threads": default_threads(), "weights": {"layers": {"4-bit": 4 * TINY["num_hidden_layers"]}, "head": "4-bit"}}  # fmt: skip
        assert httpx.get(f"{narrow.url}/v1/models", timeout=30).json()["data"][0]["compute"] == want
        assert httpx.get(f"{narrow.url}/metrics", timeout=30).json()["compute"] == want
        narrow_tokens = _greedy(narrow.url)
    finally:
        narrow.close()
    assert request.getfixturevalue("native_tokens") == narrow_tokens  # the same bits, so the same greedy tokens


def test_serve_shows_the_model_being_built_layer_by_layer(tiny_checkpoints):
    """Packing a big file's codes takes a while (~50 s for an 8B model on
    two cores), so `trioserve serve` says how far the build is, between
    the loading lines and the start-up line, and how long it took."""
    server = Server(tiny_checkpoints["gguf_q4_1"], "native")
    try:
        layers = TINY["num_hidden_layers"]
        lines = [line.strip() for line in server.lines]
        built = [line for line in lines if line.startswith("Building the model")]
        assert built[:-1] == [f"Building the model: {i}/{layers} layers" for i in range(layers + 1)]
        assert re.fullmatch(r"Building the model: done in \d+\.\d s", built[-1])
        order = [next(i for i, line in enumerate(lines) if line.startswith(p)) for p in ("Loading weights: done", "Building the model: 0/", "trioserve: computing on")]
        assert order == sorted(order)
    finally:
        server.close()


def test_the_default_thread_count_is_the_cores_the_process_may_use(tiny_checkpoints):
    """Not the machine's count: a server confined to one CPU (taskset, a
    cgroup cpuset) computes on one thread, says so at start, and shows it in
    the model card and /metrics."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("this OS has no affinity masks (os.sched_setaffinity)")
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip(f"this process may use only CPU {mine}: there is no narrower mask to try")
    server = Server(tiny_checkpoints["gguf_q4_1"], "native", cpus={mine[-1]})
    try:
        assert server.compute_line().endswith(", 1 thread"), server.compute_line()
        assert httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["compute"]["threads"] == 1
        assert httpx.get(f"{server.url}/metrics", timeout=30).json()["compute"]["threads"] == 1
        assert len(_greedy(server.url)) == 12  # and it serves on that one thread
    finally:
        server.close()
    assert default_threads() == len(mine)  # this process's own mask is untouched
