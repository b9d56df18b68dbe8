"""The ARM64 build (NEON with dot products) of the kernels the families
added, under qemu: sliding-window attention (`trioserve_window_attention`)
and GeGLU (`trioserve_gelu_tanh_mul`) give this CPU's native bits, as
test_neon.py checks for the other kernels. The shared object is
test_neon.py's (native_build.py's flags for ARM); arm_window_harness.c
calls it on one case a run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.kernels.test_attention_levels_bits import KINDS, _decode, _prompt
from tests.kernels.test_gelu_tanh import _rows
from tests.kernels.test_neon import CC, OMP_THREADS, QEMU, _bytes, _compile, arm  # noqa: F401 (arm: the ARM build's fixture)
from trioserve.kernels import native, native_build

HERE = Path(__file__).parent

pytestmark = [
    pytest.mark.skipif(CC is None or QEMU is None, reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu, qemu-user-static)"),
    pytest.mark.skipif(native_build.library() is None, reason="the C kernels do not build here to compare with"),
]


@pytest.fixture(scope="module")
def harness(arm, tmp_path_factory) -> Path:
    if arm.library is None:
        pytest.skip(f"no ARM shared object to link: {arm.why_not}")
    exe = tmp_path_factory.mktemp("arm-window") / "harness"
    _compile("-O2", str(HERE / "arm_window_harness.c"), "-o", str(exe), "-L", str(arm.library.parent), "-ltrioserve_arm64", "-lm",
             f"-Wl,-rpath,{arm.library.parent}")  # fmt: skip
    return exe


def _run(arm, harness: Path, tmp_path: Path, op: str, data: bytes) -> bytes:
    job, out = tmp_path / f"{op}.in", tmp_path / f"{op}.out"
    job.write_bytes(data)
    ran = subprocess.run([QEMU, "-L", str(arm.sysroot), str(harness), op, str(job), str(out)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": OMP_THREADS})  # fmt: skip
    assert ran.returncode == 0, (ran.returncode, ran.stderr)
    return out.read_bytes()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rows", ["decode", "prompt"])
def test_arm_windowed_attention_gives_this_cpus_bits(arm, harness, tmp_path, rows, kind):
    gen = torch.Generator().manual_seed(11)
    case = (_decode if rows == "decode" else _prompt)(gen, 8, 2, 64, 16, *KINDS[kind])
    q, k, v, tables, lens = case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["lengths"]
    seq = case.get("row_seq")
    for window in (5, 40):
        want = native.decode_attention(**case, scale=0.125, window=window)
        n, heads, dim = q.shape
        head = [n, tables.shape[0], heads, k.shape[0], k.shape[1], k.shape[2], dim, tables.shape[1], window,
                int(q.dtype == torch.bfloat16), int(k.dtype == torch.bfloat16), 3, int(seq is not None)]  # fmt: skip
        parts = [np.array(head, np.int64).tobytes(), np.array([0.125], np.float64).tobytes(), _bytes(q), _bytes(k), _bytes(v)]
        parts += [_bytes(tables.to(torch.int64))] + ([_bytes(seq.to(torch.int64))] if seq is not None else []) + [_bytes(lens.to(torch.int64))]
        raw = _run(arm, harness, tmp_path, "window", b"".join(parts))
        assert int(np.frombuffer(raw, np.int64, 1)[0]) == 0
        got = torch.from_numpy(np.frombuffer(raw, np.float32, offset=8).copy()).view(want.shape)
        assert torch.equal(got, want), (window, float((got - want).abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_arm_geglu_gives_this_cpus_bits(arm, harness, tmp_path, dtype):
    x = _rows(70, 40, seed=9).to(dtype)
    want = native.gelu_tanh_mul(x)
    raw = _run(arm, harness, tmp_path, "geglu", np.array([70, 40, int(dtype == torch.bfloat16)], np.int64).tobytes() + _bytes(x))
    got = torch.from_numpy(np.frombuffer(raw, np.int16 if dtype == torch.bfloat16 else np.float32).copy())
    got = (got.view(torch.bfloat16) if dtype == torch.bfloat16 else got).view(want.shape)
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())
