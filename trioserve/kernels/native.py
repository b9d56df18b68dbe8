"""Small C kernels for the CPU, built on first use with the system C
compiler and called through ctypes.

Why: a decode step of the default model runs ~30 small torch operators per
layer, and paged attention alone was a third of a one-row step, most of it
gathering cached K/V into padded copies and the operators around the
reduction (bench/README.md, "Performance"). `decode_attention` reads the
blocks where they lie, one call per layer; `rms_norm` (with the cast) and
`rope_write_kv` (RoPE on q and k with the K/V store) replace ~20 small
operators each.

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
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from trioserve.config import CPU_FEATURES_ENV
from trioserve.config import NATIVE_KERNELS_ENV as DISABLE_ENV
from trioserve.config import cpu_features_setting, native_kernels_setting
from trioserve.kernels.layout import grouped
from trioserve.kernels.cpu import cpu_flags, level_fits

if TYPE_CHECKING:
    from trioserve.kernels.int4 import Int4Parts, Int4Rows
    from trioserve.kernels.int6 import Int6Rows
    from trioserve.kernels.int8w import Q8Rows
    from trioserve.kernels.w16 import W16Rows

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
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
    source = SOURCE.read_bytes()
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
        subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120, check=True)
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
    return lib


def isa() -> str | None:
    """The instruction sets the loaded kernels were compiled for, in a word
    (e.g. "avx512-vnni", "avx2", "avx2-vnni", "generic"), or None where the
    C kernels do not run."""
    lib = library()
    return None if lib is None else lib.trioserve_isa().decode()


def _lib(lib: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """``lib`` (a caller's pinned `library()`), else the library for the
    environment now. Pinning matters on the hot path: reading the two
    environment variables costs ~1.3 us, a few hundred times a step."""
    if lib is not None:
        return lib
    lib = library()
    if lib is None:
        raise RuntimeError("native kernels are not available")
    return lib


def _pool_kinds(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *others: torch.Tensor) -> tuple[int, int]:
    """(x's kind, the pool's kind): 1 for bfloat16, 0 for float32. The pool
    is one dtype; a float32 ``x`` may read or write a bfloat16 pool (a
    float32 model with a 16-bit KV pool), a bfloat16 one needs a bfloat16
    pool. Else RuntimeError."""
    pool = _float_kind(k_cache, v_cache)
    kind = _float_kind(x, *others)
    if kind and not pool:
        raise RuntimeError(f"native kernels take a bfloat16 pool with bfloat16 rows, got {k_cache.dtype}")
    return kind, pool


def _float_kind(*tensors: torch.Tensor) -> int:
    """1 for bfloat16, 0 for float32 (all alike, on CPU, contiguous); else RuntimeError."""
    dtype = tensors[0].dtype
    if dtype not in (torch.bfloat16, torch.float32) or any(t.dtype != dtype for t in tensors):
        raise RuntimeError(f"native kernels take bfloat16 or float32 alike, got {', '.join(str(t.dtype) for t in tensors)}")
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise RuntimeError("native kernels take contiguous CPU tensors")
    return int(dtype == torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype, *, checked: bool = True, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`reference.rms_norm` of fp32 rows x [T, n] with an fp32 weight [n],
    then cast to ``dtype`` (bfloat16 or float32), in one pass. Sums of
    squares are taken in an order of the kernel's own, so the bits differ
    from torch's by rounding. ``checked=False``: as for `decode_attention`
    (x and weight contiguous fp32, dtype bfloat16 or float32)."""
    lib = _lib(lib)
    if checked:
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2 or weight.shape != (x.shape[1],):
            raise RuntimeError(f"rms_norm takes fp32 rows [T, n] and an fp32 weight [n], got {x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
        x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    kind = _float_kind(out) if checked else int(dtype == torch.bfloat16)
    lib.trioserve_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, kind)
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype, *, checked: bool = True, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``h += delta`` in place (h fp32 rows [T, n]; delta [T, n] bfloat16 or
    float32, widened as torch adds them), then `rms_norm` of the new h: the
    same bits as ``h = h + delta`` followed by `rms_norm`, in one pass.
    ``checked=False``: as for `decode_attention` (h, delta and weight
    contiguous, dtype bfloat16 or float32)."""
    lib = _lib(lib)
    if checked:
        if h.dtype != torch.float32 or not h.is_contiguous() or h.dim() != 2 or delta.shape != h.shape or weight.shape != (h.shape[1],):
            raise RuntimeError(f"add_rms_norm takes contiguous fp32 rows [T, n], a delta of their shape and a weight [n], got {tuple(h.shape)}, {tuple(delta.shape)}, {tuple(weight.shape)}")
        delta = delta.contiguous()
        _float_kind(delta)
        if weight.dtype != torch.float32:
            raise RuntimeError(f"add_rms_norm takes an fp32 weight, got {weight.dtype}")
        weight = weight.contiguous()
    out = torch.empty(h.shape, dtype=dtype)
    kind = _float_kind(out) if checked else int(dtype == torch.bfloat16)
    lib.trioserve_add_rms_norm(
        h.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], eps,
        int(delta.dtype == torch.bfloat16), kind,
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor, *, checked: bool = True, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of packed rows [T, 2F] (gate then up), in fp32,
    rounded once to gate_up's dtype (bfloat16 or float32): [T, F].
    Within rounding of torch's ``F.silu(gate) * up``, which rounds twice;
    not its bits. ``checked=False``: as for `decode_attention`."""
    lib = _lib(lib)
    if checked:
        gate_up = gate_up.contiguous()
        _float_kind(gate_up)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise RuntimeError(f"silu_mul takes rows [T, 2F], got {tuple(gate_up.shape)}")
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    lib.trioserve_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, int(gate_up.dtype == torch.bfloat16))
    return out


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
    *,
    checked: bool = True,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """RoPE and the K/V write of one layer in one pass, the twin of
    `reference.apply_rope` on q and k then `reference.write_kv` (bit-identical
    to them). qkv [T, (H + 2 KVH) * D] packed rows; positions [T]; cos, sin
    [max_position, D/2] fp32; k_cache, v_cache [KVH, NB, BS, D]; slots [R]
    for the first R rows (the rest are padding: rotated, never stored).
    Returns the rotated queries [T, H, D] in qkv's dtype. ``checked=False``:
    as for `decode_attention`."""
    lib = _lib(lib)
    rows = qkv.shape[0]
    dim = k_cache.shape[-1]
    if qkv.shape[1] != (heads + 2 * kv_heads) * dim or cos.shape != sin.shape or cos.shape[1] * 2 != dim:
        raise RuntimeError(f"rope_write_kv: qkv {tuple(qkv.shape)} does not hold {heads} + 2 x {kv_heads} heads of {dim}")
    q = torch.empty(rows, heads, dim, dtype=qkv.dtype)
    if checked:
        qkv = qkv.contiguous()
        kind, pool = _pool_kinds(qkv, k_cache, v_cache, q)
        if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
            raise RuntimeError("rope_write_kv takes contiguous fp32 cos and sin tables")
        positions = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int64).contiguous()
    else:
        kind, pool = int(qkv.dtype == torch.bfloat16), int(k_cache.dtype == torch.bfloat16)
    num_slots = k_cache.shape[1] * k_cache.shape[2]
    code = lib.trioserve_rope_write_kv(
        qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), slots.data_ptr(), rows, slots.shape[0], heads, kv_heads, dim, cos.shape[0], num_slots, kind, pool,
    )  # fmt: skip
    if code == 1:
        raise RuntimeError("rope_write_kv: bfloat16 rows need a bfloat16 pool")
    if code:
        raise RuntimeError("rope_write_kv: a position or slot is out of range")
    return q


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    row_seq: torch.Tensor | None = None,
    threads: int | None = None,
    checked: bool = True,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Attention of query rows to their first ``lengths[r]`` cached keys,
    read through ``block_tables`` where they lie.

    q [R, H, D]; k_cache, v_cache [KVH, NB, BS, D] (q's dtype: bfloat16 or
    float32, CPU; or a bfloat16 pool for float32 queries); block_tables [S, MB] and lengths [R] int64. Row r reads
    table row r (decode rows: one token per sequence, S = R), or row
    ``row_seq[r]`` when given (prompt rows: a chunk's tokens share their
    sequence's table, each attending to keys up to its own position).
    Returns [R, H, D] float32. Each row's result depends only on its own
    query, keys and values (the C source says how). Raises RuntimeError
    when the kernels are not available or the shapes are not ones they take.
    ``checked=False`` skips the dtype and layout checks and conversions (a
    few microseconds a call) for a caller that guarantees them, as the model
    does; the kernel's own bounds checks always run."""
    lib = _lib(lib)
    rows, heads, dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    if checked:
        q = q.contiguous()
        kind, pool = _pool_kinds(q, k_cache, v_cache)
        tables = block_tables.to(torch.int64).contiguous()
        lens = lengths.to(torch.int64).contiguous()
        if row_seq is not None:
            row_seq = row_seq.to(torch.int64).contiguous()
        if lens.shape != (rows,) or (row_seq is not None and row_seq.shape != (rows,)):
            raise RuntimeError(f"decode_attention: {rows} query rows need {rows} lengths (and table rows), got {tuple(lens.shape)}")
    else:
        kind, pool, tables, lens = int(q.dtype == torch.bfloat16), int(k_cache.dtype == torch.bfloat16), block_tables, lengths
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    code = lib.trioserve_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        None if row_seq is None else row_seq.data_ptr(), lens.data_ptr(), out.data_ptr(),
        rows, tables.shape[0], heads, kv_heads, num_blocks, block_size, dim, tables.shape[1],
        scale, kind, pool, threads or torch.get_num_threads(),
    )  # fmt: skip
    if code == 1:
        raise RuntimeError(f"decode_attention does not take head dim {dim} with {heads} heads over {kv_heads} KV heads")
    if code == 3:
        raise RuntimeError("decode_attention: a length, table row or block id is outside the block tables or the pool")
    if code:
        raise RuntimeError("decode_attention could not allocate its scratch memory")
    return out


@attrs.frozen
class Int4Pack:
    """A 4-bit weight [N, K] in `int4_matmul`'s layout (the C source's
    comment above `trioserve_int4_matmul` draws it): ``packed`` uint8 codes
    in panels of 32 outputs, ``scales`` f16 d and m per 32 inputs."""

    packed: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    # True for `int4_q8_matmul`'s layout (tiles of 16 outputs, quads of inputs), written by `pack_int4_q8`.
    q8: bool = False


def _bf16_kernels() -> bool:
    """Whether the kernels built here have their AVX-512 BF16 part
    (`int4_matmul`, `int8_matmul`)."""
    lib = library()
    return lib is not None and bool(lib.trioserve_int4_available())


def int4_supported(n: int, k: int) -> bool:
    """Whether `int4_matmul` runs here for a [n, k] weight: the kernels
    built, for a CPU with AVX-512 BF16, and both sizes multiples of 32."""
    return n > 0 and k > 0 and n % 32 == 0 and k % 32 == 0 and _bf16_kernels()


def int8_supported(n: int, k: int) -> bool:
    """Whether `int8_matmul` runs here for a [n, k] weight: the kernels
    built, for a CPU with AVX-512 BF16 or with AVX2, FMA and F16C (the same
    bits), n a multiple of 32 and k even."""
    lib = library()
    return n > 0 and k > 0 and n % 32 == 0 and k % 2 == 0 and lib is not None and bool(lib.trioserve_int8_available())


# Tiles of 16 outputs per group in `pack_int4_q8`'s layout (Q8A_TILES in the C source).
Q8_GROUP_TILES = 3


def int4_q8_supported(n: int, k: int) -> bool:
    """Whether `int4_q8_matmul` runs here for a [n, k] weight: the kernels
    built, for a CPU with AVX-512 VNNI and BF16 or with AVX2, FMA and F16C,
    n a multiple of 16 and k of 32."""
    lib = library()
    return n > 0 and k > 0 and n % 16 == 0 and k % 32 == 0 and lib is not None and bool(lib.trioserve_int4_q8_available())


def int6_q8_supported(n: int, k: int) -> bool:
    """Whether `int6_q8_matmul` runs here for a [n, k] weight (as `int4_q8_supported`)."""
    lib = library()
    return n > 0 and k > 0 and n % 16 == 0 and k % 32 == 0 and lib is not None and bool(lib.trioserve_int6_q8_available())


def int8_q8_supported(n: int, k: int) -> bool:
    """Whether `int8_q8_matmul` (signed 8-bit codes, GGUF's Q8_0) runs here for a [n, k] weight (as `int4_q8_supported`)."""
    lib = library()
    return n > 0 and k > 0 and n % 16 == 0 and k % 32 == 0 and lib is not None and bool(lib.trioserve_int8_q8_available())


def int8_q8_matmul(pack, x: torch.Tensor, *, threads: int | None = None, checked: bool = True, lib: ctypes.CDLL | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [R, K] (bfloat16 or float32) times a `kernels.int8w.pack_int8_q8`
    weight transposed, each row's inputs rounded to 8 bits per block of 32
    (the C source says how; its twin is kernels/int8w.py `int8_q8_matmul`):
    [R, N] in ``out_dtype`` (default x's dtype), each row's result from that row alone."""
    return _int4_call("int8_q8_matmul", pack, x, threads, checked, lib, out_dtype)


def w16_supported(n: int, k: int) -> bool:
    """Whether `w16_matmul` runs here for a [n, k] weight: the kernels built
    (any CPU: the plain C build has it too)."""
    return n > 0 and k > 0 and library() is not None


def w16_matmul(
    pack, x: torch.Tensor, *, threads: int | None = None, checked: bool = True, lib: ctypes.CDLL | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [R, K] (bfloat16 or float32) times a `kernels.w16.pack_w16` weight
    (F16 or BF16) transposed, products and sums in fp32 (the C source says
    how; its twin is kernels/w16.py `w16_matmul`): [R, N] in ``out_dtype``
    (bfloat16 or float32; default x's dtype), each row's result from that
    row alone."""
    lib = _lib(lib)
    if checked:
        if x.dim() != 2 or x.shape[1] != pack.k:
            raise RuntimeError(f"w16_matmul: x {tuple(x.shape)} does not have the weight's {pack.k} inputs")
        x = x.contiguous()
        _float_kind(x)
    out = torch.empty(x.shape[0], pack.n, dtype=out_dtype or x.dtype)
    code = lib.trioserve_w16_matmul(
        pack.packed.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], pack.n, pack.k, int(pack.bf16),
        int(x.dtype == torch.bfloat16), int(out.dtype == torch.bfloat16),
        threads or torch.get_num_threads(),
    )  # fmt: skip
    _check_matmul(code, "w16_matmul", pack.n, pack.k)
    return out


def int6_q8_matmul(pack, x: torch.Tensor, *, threads: int | None = None, checked: bool = True, lib: ctypes.CDLL | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [R, K] (bfloat16 or float32) times a `kernels.int6.pack_int6_q8`
    weight transposed, each row's inputs rounded to 8 bits per block of 32
    (the C source says how; its twin is kernels/int6.py `int6_q8_matmul`):
    [R, N] in ``out_dtype`` (default x's dtype), each row's result from that row alone."""
    return _int4_call("int6s_q8_matmul" if pack.symmetric else "int6_q8_matmul", pack, x, threads, checked, lib, out_dtype)


def _blocks_d_m(parts: Int4Parts) -> tuple[np.ndarray, np.ndarray]:
    """A 4-bit weight's blocks as w = q d + m: d = scale and
    m = zero - 8 scale, GGUF's own f16 minimum (Q4_1) or -8 d (Q4_0), both
    exact in f16. [N, K/32] fp32 each."""
    d = parts.scale.numpy().astype(np.float32)
    return d, parts.zero.numpy().astype(np.float32) - 8 * d


def grouped_codes(u: np.ndarray, bits: int, per_group: int) -> np.ndarray | None:
    """Codes one a byte, u [n, k] uint8, laid out for the 4-bit (``bits``
    4) or 6-bit (6) int8-activation kernel in groups of ``per_group`` tiles,
    by the C library's packer (one pass, on torch's threads); None where
    the library is not loaded, and the numpy packer serves (the same
    bytes, several times slower: it was most of a big model's build)."""
    lib = library()
    if lib is None:
        return None
    n, k = u.shape
    u = np.ascontiguousarray(u, dtype=np.uint8)
    out = np.empty(n * k * bits // 8, dtype=np.uint8)
    fn = lib.trioserve_pack_int4_q8_codes if bits == 4 else lib.trioserve_pack_int6_q8_codes
    fn(u.ctypes.data, n, k, per_group, out.ctypes.data, torch.get_num_threads())
    return out


def unpack_nibbles(raw: np.ndarray, block_bytes: int, header: int, run: int) -> np.ndarray | None:
    """4-bit codes one a byte out of GGUF blocks (raw [rows, blocks *
    block_bytes] uint8), by the C library: [rows, codes] uint8, each run of
    ``run`` nibble bytes after a block's ``header`` giving its low nibbles,
    then its high ones. None where the library is not loaded."""
    lib = library()
    if lib is None:
        return None
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    out = np.empty((raw.shape[0], raw.shape[1] // block_bytes * (block_bytes - header) * 2), dtype=np.uint8)
    lib.trioserve_unpack_nibbles(raw.ctypes.data, raw.size // block_bytes, block_bytes, header, run, out.ctypes.data, torch.get_num_threads())
    return out


def q4_k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Q4_K rows' group scales and zeros ([rows, supers * 144] uint8 ->
    two [rows, supers * 8] float32), as kernels/int4.py's numpy makes
    them, by the C library; None where it is not loaded."""
    lib = library()
    if lib is None:
        return None
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    supers = raw.size // 144
    scale = np.empty((raw.shape[0], raw.shape[1] // 144 * 8), dtype=np.float32)
    zero = np.empty_like(scale)
    lib.trioserve_q4_k_scales(raw.ctypes.data, supers, scale.ctypes.data, zero.ctypes.data, torch.get_num_threads())
    return scale, zero


CODES6_KINDS = {"Q6_K": (0, 210, 256), "Q5_K": (1, 176, 256), "Q5_0": (2, 22, 32), "Q5_1": (3, 24, 32)}


def unpack_codes6(raw: np.ndarray, qtype_name: str) -> np.ndarray | None:
    """The up-to-6-bit codes of Q6_K, Q5_K, Q5_0 or Q5_1 rows (raw [rows,
    blocks * bytes] uint8), one a byte in the file's order, by the C
    library: [rows, K] uint8. None where the library is not loaded
    (kernels/int6.py reads them with numpy then)."""
    lib = library()
    if lib is None:
        return None
    kind, block_bytes, weights = CODES6_KINDS[qtype_name]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    blocks = raw.size // block_bytes
    out = np.empty((raw.shape[0], raw.shape[1] // block_bytes * weights), dtype=np.uint8)
    lib.trioserve_unpack_codes6(raw.ctypes.data, blocks, kind, out.ctypes.data, torch.get_num_threads())
    return out


def pack_int4_q8(parts: Int4Parts) -> Int4Pack:
    """Lay out unpacked 4-bit codes for `int4_q8_matmul` (the C source's
    comment above `trioserve_int4_q8_matmul` draws it)."""
    q = parts.q.numpy()
    n, k = q.shape
    if n % 16 or k % 32:
        raise ValueError(f"int4_q8_matmul takes weights of a multiple of 16 outputs and 32 inputs, got {n} x {k}")
    nb = k // 32
    d, m = _blocks_d_m(parts)
    both = np.stack([d, m]).astype(np.float16).reshape(2, n // 16, 16, nb).transpose(1, 3, 0, 2)  # tile, block, which, column
    # Groups of Q8_GROUP_TILES tiles, each block by block across its tiles.
    packed = grouped_codes(q, 4, Q8_GROUP_TILES)
    if packed is None:
        codes = q.reshape(n // 16, 16, nb, 2, 4, 4)  # tile, column, block, half, quad, e
        bytes_ = np.left_shift(codes[:, :, :, 1], 4, dtype=np.uint8)
        np.bitwise_or(bytes_, codes[:, :, :, 0], out=bytes_)
        tiles = bytes_.transpose(0, 2, 3, 1, 4)  # tile, block, quad, column, e
        packed = grouped(tiles, np.uint8, Q8_GROUP_TILES)
    scales = grouped(both, np.float16, Q8_GROUP_TILES)
    return Int4Pack(torch.from_numpy(packed), torch.from_numpy(scales.view(np.uint16)), n, k, q8=True)



# `trioserve_pack_int4_q8_rows`'s kinds.
_ROWS_KINDS = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2}


def _rows_packing(rows, kernel: str, code_bytes: float, scales: int):
    """What a ``*_rows`` packer needs: the library, n, k, the rows'
    addresses and empty codes ([n k code_bytes] uint8) and scales ([n k /
    32 scales] uint16); None where the library is not loaded. ValueError
    for a shape ``kernel`` does not take."""
    lib = library()
    if lib is None:
        return None
    n, k = rows.shape
    if n % 16 or k % 32:
        raise ValueError(f"{kernel} takes weights of a multiple of 16 outputs and 32 inputs, got {n} x {k}")
    return lib, n, k, rows.row_addresses(), np.empty(int(n * k * code_bytes), dtype=np.uint8), np.empty(n * k // 32 * scales, dtype=np.uint16)


def pack_int4_q8_rows(rows: Int4Rows) -> Int4Pack:
    """`pack_int4_q8` of a weight still in its GGUF blocks, laid out by the
    C library straight from them (the same bytes, without unpacking the
    codes one a byte or copying them between); through `Int4Parts` where
    the library is not loaded."""
    made = _rows_packing(rows, "int4_q8_matmul", 0.5, 2)
    if made is None:
        return pack_int4_q8(rows.parts())
    lib, n, k, addresses, codes, scales = made
    lib.trioserve_pack_int4_q8_rows(
        addresses.ctypes.data, n, k, _ROWS_KINDS[rows.qtype], Q8_GROUP_TILES, codes.ctypes.data, scales.ctypes.data, torch.get_num_threads()
    )
    return Int4Pack(torch.from_numpy(codes), torch.from_numpy(scales), n, k, q8=True)


def pack_int6_q8_rows(rows: Int6Rows, symmetric: bool | None = None):
    """`int6.pack_int6_q8` of a weight still in its GGUF blocks, by the C
    library straight from them (the same bytes and scales); None where the
    library is not loaded."""
    from trioserve.kernels.int6 import TILE_GROUPS, Int6Pack

    lib = library()
    if lib is None:
        return None
    kind = CODES6_KINDS[rows.qtype][0]
    n, k = rows.shape
    addresses = rows.row_addresses()  # held while the library reads it
    exact = n % 16 == 0 and k % 32 == 0 and bool(lib.trioserve_int6_rows_symmetric(addresses.ctypes.data, n, k, kind, torch.get_num_threads()))
    if symmetric and not exact:
        raise ValueError("a symmetric 6-bit pack needs m = -32 d in every group")
    symmetric = exact if symmetric is None else symmetric
    lib, n, k, addresses, codes, scales = _rows_packing(rows, "int6_q8_matmul", 0.75, 2 if symmetric else 4)
    lib.trioserve_pack_int6_q8_rows(
        addresses.ctypes.data, n, k, kind, TILE_GROUPS, int(symmetric), codes.ctypes.data, scales.ctypes.data, torch.get_num_threads()
    )
    return Int6Pack(torch.from_numpy(codes), torch.from_numpy(scales), n, k, symmetric)


def pack_int8_q8_rows(rows: Q8Rows):
    """`int8w.pack_int8_q8` of a Q8_0 weight still in its GGUF blocks, by
    the C library straight from them (the same bytes and scales); None
    where the library is not loaded."""
    from trioserve.kernels.int6 import TILE_GROUPS
    from trioserve.kernels.int8w import Int8CodesPack

    made = _rows_packing(rows, "int8_q8_matmul", 1, 1)
    if made is None:
        return None
    lib, n, k, addresses, codes, scales = made
    lib.trioserve_pack_int8_q8_rows(addresses.ctypes.data, n, k, TILE_GROUPS, codes.ctypes.data, scales.ctypes.data, torch.get_num_threads())
    return Int8CodesPack(torch.from_numpy(codes.view(np.int8)), torch.from_numpy(scales), n, k)


def pack_w16_rows(rows: W16Rows):
    """`w16.pack_w16` of an F16/BF16 weight still in its file, by the C
    library straight from the file's rows (the same bytes); None where the
    library is not loaded."""
    from trioserve.kernels.w16 import TILE, W16Pack

    lib = library()
    if lib is None:
        return None
    n, k = rows.shape
    addresses = rows.row_addresses()
    out = torch.empty(-(-n // TILE) * TILE * k, dtype=torch.int16)
    lib.trioserve_pack_w16_rows(addresses.ctypes.data, n, k, out.data_ptr(), torch.get_num_threads())
    return W16Pack(out, n, k, rows.bf16)


def pack_int4(parts: Int4Parts) -> Int4Pack:
    """Lay out unpacked 4-bit codes (`Int4Parts`: w = (q - 8) scale + zero)
    for `int4_matmul`, whose blocks hold w = q d + m: d = scale and
    m = zero - 8 scale, which is GGUF's own f16 minimum (Q4_1) or -8 d
    (Q4_0), both exact in f16."""
    q = parts.q.numpy()
    n, k = q.shape
    if n % 32 or k % 32:
        raise ValueError(f"int4_matmul takes weights whose sizes are multiples of 32, got {n} x {k}")
    nb = k // 32
    # [panel, tile, column, block, half, chunk, t]: input 16 * half + 2 * chunk + t of a block
    codes = q.reshape(n // 32, 2, 16, nb, 2, 8, 2)
    bytes_ = (codes[:, :, :, :, 0] | (codes[:, :, :, :, 1] << 4)).astype(np.uint8)
    packed = np.ascontiguousarray(bytes_.transpose(0, 3, 1, 4, 2, 5))  # panel, block, tile, chunk, column, t
    d, m = _blocks_d_m(parts)
    both = np.stack([d, m]).astype(np.float16).reshape(2, n // 32, 2, 16, nb)  # which, panel, tile, column, block
    scales = np.ascontiguousarray(both.transpose(1, 4, 2, 0, 3))  # panel, block, tile, which, column
    return Int4Pack(torch.from_numpy(packed.reshape(-1)), torch.from_numpy(scales.reshape(-1).view(np.uint16)), n, k)


def _check_matmul(code: int, name: str, n: int, k: int) -> None:
    """Raise for a nonzero return code of the int4 or int8 kernel."""
    if code == 2:
        raise RuntimeError(f"{name} could not allocate its scratch memory")
    if code:
        raise RuntimeError(f"{name} does not run here for a {n} x {k} weight (code {code})")


def int4_matmul(pack: Int4Pack, x: torch.Tensor, *, threads: int | None = None, checked: bool = True, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [R, K] (bfloat16 or float32) times the 4-bit weight's transpose:
    [R, N] in x's dtype. Each row's result depends on that row alone (the C
    source says how); it equals x (rounded to bf16) times the dequantized
    weights up to fp32 summation. ``checked=False``: as for
    `decode_attention` (x contiguous, bfloat16 or float32, K columns)."""
    return _int4_call("int4_matmul", pack, x, threads, checked, lib)


def int4_q8_matmul(pack: Int4Pack, x: torch.Tensor, *, threads: int | None = None, checked: bool = True, lib: ctypes.CDLL | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """As `int4_matmul`, for a `pack_int4_q8` weight, with each row's inputs
    rounded to 8 bits per block of 32 (the C source says how; its torch
    twin is kernels/reference.py `int4_q8_matmul`): [R, N] in ``out_dtype``
    (default x's dtype), each row's result from that row alone."""
    return _int4_call("int4_q8_matmul", pack, x, threads, checked, lib, out_dtype)


def _int4_call(
    name: str, pack, x: torch.Tensor, threads: int | None, checked: bool, lib: ctypes.CDLL | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Run the 4-, 6- or 8-bit kernel ``name`` (its layout must be the pack's)
    into ``out_dtype`` (bfloat16 or float32; default x's dtype)."""
    lib = _lib(lib)
    if name in ("int4_matmul", "int4_q8_matmul") and pack.q8 != (name == "int4_q8_matmul"):
        raise RuntimeError(f"{name} was given a weight packed for the other 4-bit kernel")
    if checked:
        if x.dim() != 2 or x.shape[1] != pack.k:
            raise RuntimeError(f"{name}: x {tuple(x.shape)} does not have the weight's {pack.k} inputs")
        x = x.contiguous()
        _float_kind(x)
    out = torch.empty(x.shape[0], pack.n, dtype=out_dtype or x.dtype)
    code = getattr(lib, f"trioserve_{name}")(
        pack.packed.data_ptr(), pack.scales.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], pack.n, pack.k,
        int(x.dtype == torch.bfloat16), int(out.dtype == torch.bfloat16), threads or torch.get_num_threads(),
    )  # fmt: skip
    _check_matmul(code, name, pack.n, pack.k)
    return out


@attrs.frozen
class Int8Pack:
    """An 8-bit weight [N, K] in `int8_matmul`'s layout (drawn in the C
    source): ``packed`` int8 in panels of 32 outputs by input pairs,
    ``scale`` [N] fp32."""

    packed: torch.Tensor
    scale: torch.Tensor
    n: int
    k: int


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> Int8Pack:
    """Lay out int8 codes [N, K] with one scale per output for `int8_matmul`."""
    return Int8Pack(pack_int8_codes(q), scale.float().contiguous(), *q.shape)


def pack_int8_codes(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in `int8_matmul`'s layout, flat. Panels of 32 outputs
    are laid out one after another, so any slice of whole panels packs alone:
    rows [32 a, 32 b) become elements [32 a K, 32 b K) of the whole's layout."""
    n, k = q.shape
    if n % 32 or k % 2:
        raise ValueError(f"int8_matmul takes weights of a multiple of 32 outputs and an even number of inputs, got {n} x {k}")
    # [panel, tile, column, pair, t] -> [panel, pair, tile, column, t]
    return q.reshape(n // 32, 2, 16, k // 2, 2).permute(0, 3, 1, 2, 4).contiguous().reshape(-1)


def unpack_int8_codes(pack: Int8Pack) -> torch.Tensor:
    """The codes [N, K] of an `Int8Pack` (the inverse of `pack_int8_codes`)."""
    n, k = pack.n, pack.k
    return pack.packed.reshape(n // 32, k // 2, 2, 16, 2).permute(0, 2, 3, 1, 4).reshape(n, k)


def int8_matmul(pack: Int8Pack, x: torch.Tensor, *, threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [R, K] (bfloat16 or float32; fp32 rounded to bf16) times the 8-bit
    weight's transpose, times its scales: [R, N] fp32. Each row's result
    depends on that row alone (the C source says how)."""
    lib = _lib(lib)
    if x.dim() != 2 or x.shape[1] != pack.k:
        raise RuntimeError(f"int8_matmul: x {tuple(x.shape)} does not have the weight's {pack.k} inputs")
    x = x.contiguous()
    _float_kind(x)
    out = torch.empty(x.shape[0], pack.n, dtype=torch.float32)
    code = lib.trioserve_int8_matmul(
        pack.packed.data_ptr(), pack.scale.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], pack.n, pack.k,
        int(x.dtype == torch.bfloat16), threads or torch.get_num_threads(),
    )  # fmt: skip
    _check_matmul(code, "int8_matmul", pack.n, pack.k)
    return out


def supports(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether `decode_attention` takes this attention shape."""
    return dim % 16 == 0 and dim <= 256 and kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= 16
