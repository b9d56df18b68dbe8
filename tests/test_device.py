"""What --device cuda decides before any GPU work (issue #14): the dtype
auto stands for and the KV pool's size from the GPU's free memory. Both are
plain functions, so they are checked here without a GPU."""

from __future__ import annotations

import pytest
import torch

from trioserve.engine import GPU_KV_SHARE, kv_budget
from trioserve.errors import RequestError
from trioserve.kernels.cpu import auto_dtype, resolve_dtype


def test_auto_is_bfloat16_on_a_gpu_and_by_the_cpu_elsewhere():
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", "cuda:1") is torch.bfloat16
    assert resolve_dtype("auto", "cpu") is auto_dtype()
    assert resolve_dtype("float32", "cuda") is torch.float32
    with pytest.raises(RequestError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", "cuda")


def test_the_kv_pool_takes_at_most_its_share_of_a_gpus_free_memory():
    gib = 1 << 30
    cuda = torch.device("cuda")
    assert kv_budget(512 << 20, cuda, free_bytes=100 * gib) == 512 << 20  # what was asked fits
    assert kv_budget(200 * gib, cuda, free_bytes=100 * gib) == int(100 * gib * GPU_KV_SHARE)  # it does not: the share
    assert kv_budget(200 * gib, torch.device("cpu"), free_bytes=1) == 200 * gib  # a CPU's pool is what was asked


def test_the_gpu_check_says_there_is_no_gpu_and_exits_0():
    """bench/gpu_check.sh on this machine: one JSON line, nothing run."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/gpu_check.sh runs the real check")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(["bash", str(root / "bench" / "gpu_check.sh")], capture_output=True, text=True, timeout=120, env={"PY": sys.executable, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"gpu": False, "why": "no CUDA device: nothing to check"}
