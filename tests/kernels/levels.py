"""Running a kernel test at each instruction-set level of the C kernels
($TRIOSERVE_CPU_FEATURES) that this CPU can execute, so that an AVX-512
machine checks the AVX2 and plain C builds against their torch twins too,
not only the build it would pick for itself. A level the CPU lacks (or
whose build does not load, or lacks the kernel under test) is skipped with
the reason, so a run's summary says what went untested."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels import native_build
from trioserve.kernels.cpu import level_fits

# Every level the library is built for (native_build.LEVELS), widest first.
ALL_LEVELS = ("native", "avx2-vnni", "avx2", "generic")
# The x86 levels with SIMD builds of the int8-activation kernels (the plain C build has none).
SIMD_LEVELS = ("native", "avx2-vnni", "avx2")


def at_levels(levels: tuple[str, ...] = ALL_LEVELS):
    """Parametrize a test's ``level`` fixture (which calls `use_level`) over
    ``levels``. Put it above the test's other parametrizations: the level
    then varies fastest, so consecutive tests share a case, and a twin's
    answer cached for one level serves the next."""
    return pytest.mark.parametrize("level", levels, indirect=True)


def _library_loads() -> bool:
    return native_build.library() is not None


def use_level(level: str, monkeypatch, runs: Callable[[], bool] = _library_loads, what: str = "C kernels") -> None:
    """Make the C kernels built for ``level`` the ones called from here on
    (for the rest of the test), or skip saying why they cannot run: the
    CPU lacks the level's instructions, or that build does not load here,
    or ``runs()`` (asked with the level in force) says it lacks ``what``."""
    unfit = level_fits(level)
    if unfit:
        pytest.skip(f"{CPU_FEATURES_ENV}={level}: {unfit}")
    monkeypatch.setenv(CPU_FEATURES_ENV, level)
    if not runs():
        pytest.skip(f"no {what} at {CPU_FEATURES_ENV}={level} here (no C compiler, TRIOSERVE_NATIVE_KERNELS=0, or not in that build)")
