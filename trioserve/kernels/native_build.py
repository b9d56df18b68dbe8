"""Building and loading the small C kernels (csrc/cpu_kernels.c): the
system C compiler makes a shared library on first use, and ctypes loads it
with each function's signature declared; kernels/native.py calls them.

Build: ``$CC`` (default ``cc``) with ``-O3 -march=native -fopenmp`` (OpenMP from the libgomp torch loads), or
the flags of the level ``$TRIOSERVE_CPU_FEATURES`` names (`LEVELS`: avx2,
avx2-vnni, generic), so that a wider CPU runs and tests a narrower CPU's
kernels; one library per level, chosen when first used. The
shared object goes to ``$TRIOSERVE_CACHE_DIR`` (default
``~/.cache/trioserve``) under a name made from the source, the flags, the
compiler's version and this CPU's feature flags, so an edit, another
compiler or another CPU builds anew. Builds are atomic (write, then
rename), so concurrent processes are safe. Where no compiler works, or
``TRIOSERVE_NATIVE_KERNELS=0``, `library()` is None and the model uses the
torch reference (kernels/reference.py), with a warning saying why. Both
give a row the same result in any company; their bits differ from each
other (a reduction order of their own), so outputs are the same only
between machines that use the same one."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from trioserve.config import CPU_FEATURES_ENV
from trioserve.config import NATIVE_KERNELS_ENV as DISABLE_ENV
from trioserve.config import cpu_features_setting, native_kernels_setting
from trioserve.kernels.cpu import cpu_flags, level_fits

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
# Built together into one library: the forward pass's kernels, the
# sampler's fixed-order arithmetic, and the header of the exp they share.
SOURCES = (SOURCE, SOURCE.parent / "sampler.c")
HEADERS = (SOURCE.parent / "fixed_exp.h",)
# -ffp-contract=off: no fused multiply-adds, so elementwise kernels round
# exactly as their torch twins (RoPE is bit-identical to it).
FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")
# The target flags of each level ($TRIOSERVE_CPU_FEATURES). x86-64-v3 is
# AVX2 + FMA + F16C (Haswell, Zen); generic is the baseline of the machine.
LEVELS = {
    "native": ("-march=native",),
    "avx2-vnni": ("-march=x86-64-v3", "-mavxvnni"),
    "avx2": ("-march=x86-64-v3",),
    "generic": ("-march=armv8-a",) if platform.machine() in ("aarch64", "arm64") else ("-march=x86-64",),
}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def cache_dir() -> Path:
    return Path(os.environ.get("TRIOSERVE_CACHE_DIR") or Path.home() / ".cache" / "trioserve")


def _compiler_version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return done.stdout


def build(cc: str | None = None, out_dir: Path | None = None, level: str = "native") -> Path:
    """Compile the kernels for ``level`` (`LEVELS`) (or find them built) and
    return the shared object's path. Raises OSError or
    subprocess.SubprocessError on failure."""
    cc = cc or os.environ.get("CC") or "cc"
    flags = (*FLAGS, *LEVELS[level])
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256()
    for part in (source, " ".join(flags).encode(), _compiler_version(cc).encode(), " ".join(sorted(cpu_flags())).encode()):
        key.update(part)
        key.update(b"\0")
    out_dir = out_dir or cache_dir()
    target = out_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=120, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernels for the level $TRIOSERVE_CPU_FEATURES names, or
    None (see the module docstring); each level built once per process."""
    return library_at(os.environ.get(CPU_FEATURES_ENV) or "native", os.environ.get(DISABLE_ENV))


@functools.cache
def library_at(level: str, disable: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for ``level``, or None with a warning saying why
    (``disable``: $TRIOSERVE_NATIVE_KERNELS's text)."""
    environ = {} if disable is None else {DISABLE_ENV: disable}
    try:
        if not native_kernels_setting(environ):
            return None
        level = cpu_features_setting({CPU_FEATURES_ENV: level})
    except ValueError as e:
        log.warning("%s; using the torch reference", e)
        return None
    unfit = level_fits(level)
    if unfit:
        log.warning("%s=%s: %s; using the torch reference", CPU_FEATURES_ENV, level, unfit)
        return None
    try:
        lib = ctypes.CDLL(str(build(level=level)))
    except subprocess.CalledProcessError as e:
        log.warning("native kernels not built (%s); using the torch reference: %s", e.cmd[0], (e.stderr or "").strip()[-500:])
        return None
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native kernels not built; using the torch reference: %s", e)
        return None
    fn = lib.trioserve_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr] * 7 + [_i64] * 8 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn = lib.trioserve_rms_norm
    fn.restype = None
    fn.argtypes = [_ptr] * 3 + [_i64] * 2 + [ctypes.c_float, ctypes.c_int]
    fn = lib.trioserve_add_rms_norm
    fn.restype = None
    fn.argtypes = [_ptr] * 4 + [_i64] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn = lib.trioserve_silu_mul
    fn.restype = None
    fn.argtypes = [_ptr] * 2 + [_i64] * 2 + [ctypes.c_int]
    fn = lib.trioserve_rope_write_kv
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr] * 8 + [_i64] * 7 + [ctypes.c_int, ctypes.c_int]
    lib.trioserve_int4_available.restype = ctypes.c_int
    lib.trioserve_int4_available.argtypes = []
    lib.trioserve_int8_available.restype = ctypes.c_int
    lib.trioserve_int8_available.argtypes = []
    fn = lib.trioserve_int4_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int] * 3
    fn = lib.trioserve_int8_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int] * 2
    lib.trioserve_int4_q8_available.restype = ctypes.c_int
    lib.trioserve_int4_q8_available.argtypes = []
    fn = lib.trioserve_int4_q8_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int] * 3
    lib.trioserve_int6_q8_available.restype = ctypes.c_int
    lib.trioserve_int6_q8_available.argtypes = []
    fn = lib.trioserve_int6_q8_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int] * 3
    fn = lib.trioserve_int6s_q8_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int] * 3
    lib.trioserve_int8_q8_available.restype = ctypes.c_int
    lib.trioserve_int8_q8_available.argtypes = []
    fn = lib.trioserve_int8_q8_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int] * 3
    fn = lib.trioserve_w16_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr] * 3 + [_i64] * 3 + [ctypes.c_int] * 4
    lib.trioserve_isa.restype = ctypes.c_char_p
    lib.trioserve_isa.argtypes = []
    for name in ("trioserve_pack_int4_q8_codes", "trioserve_pack_int6_q8_codes"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [_ptr] + [_i64] * 3 + [_ptr, ctypes.c_int]
    fn = lib.trioserve_unpack_nibbles
    fn.restype = None
    fn.argtypes = [_ptr] + [_i64] * 4 + [_ptr, ctypes.c_int]
    fn = lib.trioserve_unpack_codes6
    fn.restype = None
    fn.argtypes = [_ptr, _i64, ctypes.c_int, _ptr, ctypes.c_int]
    fn = lib.trioserve_q4_k_scales
    fn.restype = None
    fn.argtypes = [_ptr, _i64, _ptr, _ptr, ctypes.c_int]
    fn = lib.trioserve_pack_int4_q8_rows
    fn.restype = None
    fn.argtypes = [_ptr, _i64, _i64, ctypes.c_int, _i64, _ptr, _ptr, ctypes.c_int]
    fn = lib.trioserve_pack_int6_q8_rows
    fn.restype = None
    fn.argtypes = [_ptr, _i64, _i64, ctypes.c_int, _i64, ctypes.c_int, _ptr, _ptr, ctypes.c_int]
    fn = lib.trioserve_pack_int8_q8_rows
    fn.restype = None
    fn.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, ctypes.c_int]
    fn = lib.trioserve_pack_w16_rows
    fn.restype = None
    fn.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int]
    fn = lib.trioserve_int6_rows_symmetric
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _i64, ctypes.c_int, ctypes.c_int]
    # The sampler's fixed-order arithmetic (csrc/sampler.c, kernels/fixed_order.py).
    fn = lib.trioserve_exp_shifted
    fn.restype = None
    fn.argtypes = [_ptr] * 3 + [_i64] * 2 + [ctypes.c_int]
    fn = lib.trioserve_block_sums
    fn.restype = None
    fn.argtypes = [_ptr] * 2 + [_i64] * 3 + [ctypes.c_int]
    fn = lib.trioserve_exp_sums
    fn.restype = None
    fn.argtypes = [_ptr] * 3 + [_i64] * 3 + [ctypes.c_int]
    fn = lib.trioserve_log_softmax
    fn.restype = None
    fn.argtypes = [_ptr] * 4 + [_i64] * 2 + [ctypes.c_int]
    return lib
