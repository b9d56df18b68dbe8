"""The suite passes on a machine with no C compiler: the C kernels are then
never built, every path runs on torch, and each case that needs a C kernel
skips and says why. The cases most at risk are those that ask for int8
activations (which the model refuses without the C kernels): this runs every
test file that mentions them again, in a child pytest whose $CC does not
exist and whose kernel cache is empty, and fails with that run's report if
any case fails there. The real-model (slow) cases are left out: they take
the same model-building paths as the tiny ones here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels import native_build

TESTS = Path(__file__).resolve().parent
# A test file "at risk": it asks for int8 activations somewhere.
AT_RISK = re.compile(r'"int8"|activations\s*=\s*activations')
CHILD_S = 1200  # a hang guard for the child run (~1-2 min on a 2-core AVX2 VM)


def _files_at_risk() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if p != Path(__file__).resolve() and AT_RISK.search(p.read_text()))


def test_the_files_at_risk_are_found():
    """The selection finds the files it is meant to (so the run below cannot
    pass by running nothing)."""
    names = {p.relative_to(TESTS).as_posix() for p in _files_at_risk()}
    assert {"models/test_q8_0_codes.py", "models/test_k_quants.py", "kernels/test_int4.py", "kernels/test_thread_governor.py"} <= names


def test_the_int8_cases_pass_or_skip_without_a_c_compiler(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (native_build.DISABLE_ENV, CPU_FEATURES_ENV)}
    env.update(CC=str(tmp_path / "no-such-cc"), TRIOSERVE_CACHE_DIR=str(tmp_path / "cache"), PYTHONDONTWRITEBYTECODE="1")
    files = [str(p) for p in _files_at_risk()]
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-rs", *files],
            cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=CHILD_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the run without a C compiler did not end within {CHILD_S} s:\n{exc.stdout}")
    report = run.stdout[-6000:]
    assert run.returncode == 0, f"without a C compiler:\n{report}"
    # The child really had no kernels: the C-only cases skipped, saying why.
    assert "no C compiler" in run.stdout, report
