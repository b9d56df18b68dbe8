"""The small C kernels of the CPU, called through ctypes: the layer's
row-wise operations, paged attention and the weight matmuls. The library
is built and loaded by kernels/native_build.py (`library()`, None where it
cannot be built, and the model then runs the torch reference), and the
weights are laid out for the matmuls by kernels/native_pack.py.

Why: a decode step of the default model runs ~30 small torch operators per
layer, and paged attention alone was a third of a one-row step, most of it
gathering cached K/V into padded copies and the operators around the
reduction (bench/README.md, "Performance"). `decode_attention` reads the
blocks where they lie, one call per layer; `rms_norm` (with the cast) and
`rope_write_kv` (RoPE on q and k with the K/V store) replace ~20 small
operators each."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from trioserve.kernels import native_build

if TYPE_CHECKING:
    from trioserve.kernels.native_pack import Int4Pack, Int8Pack


def isa() -> str | None:
    """The instruction sets the loaded kernels were compiled for, in a word
    (e.g. "avx512-vnni", "avx2", "avx2-vnni", "generic"), or None where the
    C kernels do not run."""
    lib = native_build.library()
    return None if lib is None else lib.trioserve_isa().decode()


def _lib(lib: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """``lib`` (a caller's pinned `native_build.library()`), else the
    library for the environment now. Pinning matters on the hot path:
    reading the two environment variables costs ~1.3 us, a few hundred
    times a step."""
    if lib is not None:
        return lib
    lib = native_build.library()
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


def _weight_inputs(name: str, x: torch.Tensor, k: int) -> torch.Tensor:
    """x as a matmul kernel ``name`` takes it: rows of the weight's ``k``
    inputs, bfloat16 or float32, contiguous; else RuntimeError."""
    if x.dim() != 2 or x.shape[1] != k:
        raise RuntimeError(f"{name}: x {tuple(x.shape)} does not have the weight's {k} inputs")
    x = x.contiguous()
    _float_kind(x)
    return x


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


def gelu_tanh_mul(gate_up: torch.Tensor, *, checked: bool = True, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """GeGLU: ``gelu(gate) * up`` (gelu's tanh approximation) of packed rows
    [T, 2F] (gate then up), in fp32, rounded once to gate_up's dtype
    (bfloat16 or float32): [T, F]. The same bits at every instruction-set
    level; within rounding of torch's ``F.gelu(gate, approximate="tanh") *
    up`` in fp32 (the reference set's, `Kernels.gelu_tanh_mul`), not its
    bits. ``checked=False``: as for `decode_attention`."""
    lib = _lib(lib)
    if checked:
        gate_up = gate_up.contiguous()
        _float_kind(gate_up)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise RuntimeError(f"gelu_tanh_mul takes rows [T, 2F], got {tuple(gate_up.shape)}")
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    fn = lib.trioserve_gelu_tanh_mul
    if fn.argtypes is None:
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, int(gate_up.dtype == torch.bfloat16))
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
    window: int | None = None,
    threads: int | None = None,
    checked: bool = True,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Attention of query rows to their first ``lengths[r]`` cached keys,
    read through ``block_tables`` where they lie; with ``window`` (a
    sliding-window layer), to the last ``window`` of them only: a row at
    position p (length p + 1) reads keys p - window + 1 .. p, and the
    blocks before those are neither read nor checked.

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
    if window is not None and window < 1:
        raise RuntimeError(f"decode_attention: a window of {window} keys; a sliding window holds at least one")
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    head = (
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        None if row_seq is None else row_seq.data_ptr(), lens.data_ptr(), out.data_ptr(),
        rows, tables.shape[0], heads, kv_heads, num_blocks, block_size, dim, tables.shape[1],
    )  # fmt: skip
    if window is None:
        code = lib.trioserve_decode_attention(*head, scale, kind, pool, threads or torch.get_num_threads())
    else:
        code = _window_attention(lib)(*head, window, scale, kind, pool, threads or torch.get_num_threads())
    if code == 1:
        raise RuntimeError(f"decode_attention does not take head dim {dim} with {heads} heads over {kv_heads} KV heads")
    if code == 3:
        raise RuntimeError("decode_attention: a length, table row or block id is outside the block tables or the pool")
    if code:
        raise RuntimeError("decode_attention could not allocate its scratch memory")
    return out


def _window_attention(lib: ctypes.CDLL):
    """`trioserve_window_attention` of ``lib``, its signature declared:
    `trioserve_decode_attention`'s with the window (int64) before the scale."""
    fn = lib.trioserve_window_attention
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def supports(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether `decode_attention` takes this attention shape."""
    return dim % 16 == 0 and dim <= 256 and kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= 16


def _bf16_kernels() -> bool:
    """Whether the kernels built here have their AVX-512 BF16 part
    (`int4_matmul`, `int8_matmul`)."""
    lib = native_build.library()
    return lib is not None and bool(lib.trioserve_int4_available())


def int4_supported(n: int, k: int) -> bool:
    """Whether `int4_matmul` runs here for a [n, k] weight: the kernels
    built, for a CPU with AVX-512 BF16, and both sizes multiples of 32."""
    return n > 0 and k > 0 and n % 32 == 0 and k % 32 == 0 and _bf16_kernels()


def int8_supported(n: int, k: int) -> bool:
    """Whether `int8_matmul` runs here for a [n, k] weight: the kernels
    built (every level has it: AVX-512 BF16, AVX2 with FMA and F16C, NEON,
    plain C; the same bits on each), n a multiple of 32 and k even."""
    lib = native_build.library()
    return n > 0 and k > 0 and n % 32 == 0 and k % 2 == 0 and lib is not None and bool(lib.trioserve_int8_available())


def int4_q8_supported(n: int, k: int) -> bool:
    """Whether `int4_q8_matmul` runs here for a [n, k] weight: the kernels
    built (every level has it: AVX-512 VNNI, AVX2, NEON with dotprod, plain
    C; the same bits on each), n a multiple of 16 and k of 32."""
    lib = native_build.library()
    return n > 0 and k > 0 and n % 16 == 0 and k % 32 == 0 and lib is not None and bool(lib.trioserve_int4_q8_available())


def int6_q8_supported(n: int, k: int) -> bool:
    """Whether `int6_q8_matmul` runs here for a [n, k] weight (as `int4_q8_supported`)."""
    lib = native_build.library()
    return n > 0 and k > 0 and n % 16 == 0 and k % 32 == 0 and lib is not None and bool(lib.trioserve_int6_q8_available())


def int8_q8_supported(n: int, k: int) -> bool:
    """Whether `int8_q8_matmul` (signed 8-bit codes, GGUF's Q8_0) runs here for a [n, k] weight (as `int4_q8_supported`)."""
    lib = native_build.library()
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
    return n > 0 and k > 0 and native_build.library() is not None


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
        x = _weight_inputs("w16_matmul", x, pack.k)
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
        x = _weight_inputs(name, x, pack.k)
    out = torch.empty(x.shape[0], pack.n, dtype=out_dtype or x.dtype)
    code = getattr(lib, f"trioserve_{name}")(
        pack.packed.data_ptr(), pack.scales.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], pack.n, pack.k,
        int(x.dtype == torch.bfloat16), int(out.dtype == torch.bfloat16), threads or torch.get_num_threads(),
    )  # fmt: skip
    _check_matmul(code, name, pack.n, pack.k)
    return out


def int8_matmul(pack: Int8Pack, x: torch.Tensor, *, threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [R, K] (bfloat16 or float32; fp32 rounded to bf16) times the 8-bit
    weight's transpose, times its scales: [R, N] fp32. Each row's result
    depends on that row alone (the C source says how)."""
    lib = _lib(lib)
    x = _weight_inputs("int8_matmul", x, pack.k)
    out = torch.empty(x.shape[0], pack.n, dtype=torch.float32)
    code = lib.trioserve_int8_matmul(
        pack.packed.data_ptr(), pack.scale.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], pack.n, pack.k,
        int(x.dtype == torch.bfloat16), threads or torch.get_num_threads(),
    )  # fmt: skip
    _check_matmul(code, "int8_matmul", pack.n, pack.k)
    return out
