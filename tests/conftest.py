"""Fixtures shared across the test tree: the tiny random Llama of
tests/tiny_model.py, written once per session in every checkpoint format."""

from __future__ import annotations

import os
from pathlib import Path

# OpenMP threads that wait for work sleep instead of spinning (libgomp's
# default spins ~300,000 rounds after every parallel region). On a 2-core
# machine shared with other work, the spinning workers hold the cores that
# the computing thread and the other processes need, and every parallel
# region waits for a descheduled thread: with another test run beside it,
# tests/test_engine.py took 76-173 s here instead of 3 s, and
# tests/http/test_server.py 51 s instead of 7 s. On an idle machine it
# makes no difference (10 s either way). It changes no result (the same
# threads split the same work), only how an idle thread waits; set here,
# before torch loads, and inherited by every process a test starts. An
# explicit OMP_WAIT_POLICY is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The Triton kernels (trioserve/kernels/gpu) run under Triton's
# interpreter on a machine without a GPU. The variable is read when a kernel
# module is imported, so it is set here, before any test module loads.
# TRITON_INTERPRET=0 in the environment runs them natively (bench/gpu_check.sh).
if not os.environ.get("TRITON_INTERPRET"):
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest

from tests.tiny_model import build_tiny_checkpoints


@pytest.fixture(autouse=True)
def own_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's servers keep their durable state (--state-dir auto, the
    default) in a data directory of the test's own, never the user's."""
    data = tmp_path_factory.mktemp("data")
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    return data


@pytest.fixture(scope="session", autouse=True)
def _native_kernels_built() -> None:
    """Build (or find) the C kernels before the first test, so that no test
    with a deadline pays the compile: ~10-20 s on a slow 2-core machine with
    an empty cache (kernels/native_build.py)."""
    from trioserve.kernels import native, native_build

    native_build.library()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Paths of the untied tiny model by kind: "hf" (two shards and an index),
    "gguf_f32", "gguf_q8_0", "gguf_q4_1". Treat them as read-only."""
    return build_tiny_checkpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_checkpoints_tied(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same kinds for a model whose output head is its embedding (no
    lm_head.weight / output.weight in the files)."""
    return build_tiny_checkpoints(tmp_path_factory.mktemp("tiny-tied"), tie=True)


@pytest.fixture
def postgres():
    """A PostgreSQL server of this test's own (tests/postgres.py); skipped, saying why, where it cannot start."""
    from tests.postgres import Unavailable, start_postgres

    try:
        server = start_postgres()
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.remove()
