"""The integer kernels' 64-bit ARM build (NEON with the dot-product
extension), compiled by Debian's cross compiler and run under qemu-user,
against the same kernels on this CPU: the same bits (the integer sums are
exact and the rest is the same operations in the same order). Where the
cross compiler or qemu is missing, skipped saying so (`make test` installs
them where it can: gcc-aarch64-linux-gnu, qemu-user-static).

Tested under emulation only: no ARM machine has timed these."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from trioserve.kernels import native
from trioserve.kernels.int4 import parts_from_gguf
from tests.kernels.test_int6 import _raw as _raw6
from trioserve.kernels.int6 import pack_int6_q8, parts_from_gguf6
from trioserve.kernels.int8w import pack_int8_q8, parts_from_q8_0
from trioserve.kernels.w16 import pack_w16, parts_from_w16

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "trioserve" / "kernels" / "csrc"
CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
Q = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(
    CC is None or QEMU is None, reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu, qemu-user-static)"
)


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("neon") / "harness"
    built = subprocess.run(
        [CC, "-O2", "-march=armv8.2-a+dotprod", "-ffp-contract=off", "-static", "-Wno-unknown-pragmas", "-I", str(CSRC),
         str(HERE / "neon_harness.c"), "-o", str(exe), "-lm"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    return exe


def _run(harness: Path, tmp_path: Path, kind: int, packed: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, n: int) -> tuple[torch.Tensor, str]:
    rows, k = x.shape
    pb, sb = packed.contiguous().numpy().tobytes(), scales.contiguous().numpy().tobytes()
    job, out = tmp_path / f"job{kind}", tmp_path / f"out{kind}"
    job.write_bytes(np.array([kind, rows, n, k, len(pb), len(sb)], dtype=np.int64).tobytes() + pb + sb + x.float().numpy().tobytes())
    ran = subprocess.run([QEMU, str(harness), str(job), str(out)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, (ran.returncode, ran.stderr)
    return torch.from_numpy(np.frombuffer(out.read_bytes(), dtype=np.float32).copy()).view(rows, n), ran.stdout.strip()


def _x(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    x[:, 3] *= 30
    return x


needs_here = pytest.mark.skipif(not native.int4_q8_supported(16, 32), reason="the integer kernels do not run on this CPU to compare with")


@needs_here
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_the_arm_kernels_give_this_cpus_bits(harness, tmp_path, rows):
    rng = np.random.default_rng(rows)
    w = (rng.standard_normal((80, 256)) * 0.05).astype(np.float32)
    x = _x(rows, 256)
    # 4-bit (Q4_1 codes), int8 activations
    pack4 = native.pack_int4_q8(parts_from_gguf(gguf.quants.quantize(w, Q.Q4_1), "Q4_1"))
    arm, isa = _run(harness, tmp_path, 1, pack4.packed, pack4.scales, x, 80)
    assert isa == "neon-dotprod"
    assert torch.equal(arm, native.int4_q8_matmul(pack4, x))
    # up to 6 bits (Q5_1 codes)
    pack6 = pack_int6_q8(parts_from_gguf6(gguf.quants.quantize(w, Q.Q5_1), "Q5_1"))
    arm, _ = _run(harness, tmp_path, 2, pack6.packed, pack6.scales, x, 80)
    assert torch.equal(arm, native.int6_q8_matmul(pack6, x))
    # 6 bits, symmetric (Q6_K: d alone among the scales)
    pack6s = pack_int6_q8(parts_from_gguf6(_raw6("Q6_K", 80, 256, seed=rows), "Q6_K"))
    assert pack6s.symmetric
    arm, _ = _run(harness, tmp_path, 6, pack6s.packed, pack6s.scales, x, 80)
    assert torch.equal(arm, native.int6_q8_matmul(pack6s, x))
    # signed 8-bit codes (Q8_0)
    pack8 = pack_int8_q8(parts_from_q8_0(gguf.quants.quantize(w, Q.Q8_0)))
    arm, _ = _run(harness, tmp_path, 4, pack8.packed, pack8.scales, x, 80)
    assert torch.equal(arm, native.int8_q8_matmul(pack8, x))
    # F16 weights as the file holds them
    pack16 = pack_w16(parts_from_w16(w.astype(np.float16), "F16"))
    arm, _ = _run(harness, tmp_path, 5, pack16.packed, torch.zeros(0, dtype=torch.int16), x, 80)
    assert torch.equal(arm, native.w16_matmul(pack16, x))
    # the 8-bit head
    if native.int8_supported(96, 256):
        q = torch.from_numpy(rng.integers(-127, 128, (96, 256), dtype=np.int8))
        head = native.pack_int8(q, torch.from_numpy(rng.random(96).astype(np.float32)) / 50)
        arm, _ = _run(harness, tmp_path, 3, head.packed, head.scale, x, 96)
        assert torch.equal(arm, native.int8_matmul(head, x))
