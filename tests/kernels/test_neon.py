"""The C kernels' 64-bit ARM build (NEON with the dot-product extension),
made by Debian's cross compiler with kernels/native_build.py's own flags and run
under qemu-user through tests/kernels/neon_harness.c, against this CPU:

* the integer and 16-bit matmuls and the 8-bit head: this CPU's bits (the
  integer sums are exact and the rest is the same operations in order);
* decode and prompt-row attention over scattered paged blocks: the torch
  twin within test_native.py's tolerances, and each row the same bits alone,
  in company, in another order and on another number of threads;
* RMSNorm, the residual add with it, SiLU and RoPE with the K/V write:
  this CPU's bits (plain operations in a fixed order, no contraction), and
  the twins' rules besides (RoPE bit-identical to torch);
* the load-time packers: this CPU's bytes for the same file blocks, f16
  fields of every kind included;
* the shared library itself: links, exports what the Python side binds, holds
  the dot-product paths.

Where the cross compiler or qemu is missing, skipped saying so (`make
test` installs them where it can: gcc-aarch64-linux-gnu, qemu-user-static);
where the cross libgomp is missing, the harness includes the source
(no OpenMP) and the shared-library test skips saying why.

Tested under emulation only: no ARM machine has timed these."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.kernels.test_int6 import _raw as _raw6
from tests.kernels.rope_case import BLOCK_SIZE, MAX_POS, rope_case
from tests.kernels.test_native import TOLERANCE, _case, _prompt_case
from tests.kernels.test_pack_layout import _f16_fields, _q4_tensor, _q6_tensor
from trioserve.kernels import native, native_build, native_pack, reference
from trioserve.kernels.int4 import Int4Rows, parts_from_gguf
from trioserve.kernels.int6 import TILE_GROUPS, Int6Rows, pack_int6_q8, parts_from_gguf6
from trioserve.kernels.int8w import Q8Rows, pack_int8_q8, parts_from_q8_0
from trioserve.kernels.w16 import W16Rows, pack_w16, parts_from_w16
from trioserve.models.step import SeqChunk, build_step

HERE = Path(__file__).resolve().parent
CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
Q = gguf.GGMLQuantizationType
# What `-march=native` (native_build.py's default level) picks on an ARM CPU with
# dot products (Graviton 2, Apple M1 and later, Ampere Altra); a cross
# compiler has no `native`.
ARM_MARCH = ("-march=armv8.2-a+dotprod",)
# Threads the harness's OpenMP regions get where a kernel takes no count (RMSNorm, SiLU, RoPE at 64 rows and up).
OMP_THREADS = "3"

pytestmark = pytest.mark.skipif(
    CC is None or QEMU is None, reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu, qemu-user-static)"
)
needs_here = pytest.mark.skipif(not native.int4_q8_supported(16, 32), reason="the integer kernels do not run on this CPU to compare with")
needs_library = pytest.mark.skipif(native_build.library() is None, reason="the C kernels do not build here to compare with")


@dataclass(frozen=True)
class ArmBuild:
    harness: Path
    library: Path | None  # the shared object, None where it could not be built
    why_not: str | None  # why the shared object was not built
    sysroot: Path  # the ARM libc (and libgomp) qemu loads the harness with


def _compile(*args: str) -> None:
    done = subprocess.run([CC, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


_BUILT: list[ArmBuild] = []  # the session's one build (test_attention_levels_bits.py runs it too)


@pytest.fixture(scope="module")
def arm(tmp_path_factory) -> ArmBuild:
    """The kernels as native_build.py builds them (its flags, `ARM_MARCH` for
    `-march=native`) with the harness linked to them; where the cross
    libgomp is missing, the harness with the source included, no OpenMP.
    Built once a session: every module that takes this fixture gets the
    same files (read only), not a build of its own (~8 s each)."""
    if not _BUILT:
        _BUILT.append(_build_arm(tmp_path_factory.mktemp("arm64")))
    return _BUILT[0]


def _build_arm(where: Path) -> ArmBuild:
    exe, lib = where / "harness", where / "libtrioserve_arm64.so"
    sysroot = Path(subprocess.run([CC, "-print-file-name=libc.so.6"], capture_output=True, text=True, check=True).stdout.strip()).resolve().parent.parent
    gomp = Path(subprocess.run([CC, "-print-file-name=libgomp.so"], capture_output=True, text=True, check=True).stdout.strip())
    if not gomp.is_absolute() or not gomp.exists():
        _compile("-O3", "-ffp-contract=off", *ARM_MARCH, "-static", "-Wno-unknown-pragmas", "-DHARNESS_STATIC", "-I", str(native_build.SOURCE.parent),
                 str(HERE / "neon_harness.c"), "-o", str(exe), "-lm")  # fmt: skip
        return ArmBuild(exe, None, f"no libgomp for {CC} (Debian: libgomp1-arm64-cross), so native_build.py's -fopenmp build cannot link", sysroot)
    _compile(*native_build.FLAGS, *ARM_MARCH, "-o", str(lib), *map(str, native_build.SOURCES))  # as native_build.build() runs it
    # -lm: the library calls sqrtf and names no libm (in Python the process has it loaded).
    _compile("-O2", "-fopenmp", str(HERE / "neon_harness.c"), "-o", str(exe), "-L", str(where), "-ltrioserve_arm64", "-lm", f"-Wl,-rpath,{where}")
    return ArmBuild(exe, lib, None, sysroot)


def _bytes(a) -> bytes:
    if isinstance(a, torch.Tensor):
        a = a.contiguous()
        a = (a.view(torch.int16) if a.dtype == torch.bfloat16 else a).numpy()
    return np.ascontiguousarray(a).tobytes()


@dataclass(frozen=True)
class Done:
    """One case's return code and buffers: its inputs as the call left them, then its outputs."""

    code: int
    buffers: list[bytes]

    def tensor(self, i: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        raw = np.frombuffer(self.buffers[i], dtype=np.int16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype)
        t = torch.from_numpy(raw.copy())
        return (t.view(torch.bfloat16) if dtype == torch.bfloat16 else t).view(*shape)


class Jobs:
    """Cases for one run of the harness (neon_harness.c says the format)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._count = 0

    def add(self, op: int, ints, inputs, outputs, floats=()) -> int:
        """Queue ``op`` with ``ints``, ``floats``, ``inputs`` (arrays or
        tensors) and outputs of the given byte sizes; returns its index."""
        self._parts.append(np.array([op, len(ints), *ints, len(floats)], np.int64).tobytes() + np.array(floats, np.float64).tobytes())
        self._parts.append(np.array([len(inputs)], np.int64).tobytes())
        for a in inputs:
            b = _bytes(a)
            self._parts += [np.array([len(b)], np.int64).tobytes(), b]
        self._parts.append(np.array([len(outputs), *outputs], np.int64).tobytes())
        self._count += 1
        return self._count - 1

    def run(self, arm: ArmBuild, tmp_path: Path) -> tuple[list[Done], str]:
        job, out = tmp_path / "job", tmp_path / "out"
        job.write_bytes(b"".join(self._parts))
        ran = subprocess.run([QEMU, "-L", str(arm.sysroot), str(arm.harness), str(job), str(out)], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": OMP_THREADS})  # fmt: skip
        assert ran.returncode == 0, (ran.returncode, ran.stderr)
        data, at, done = out.read_bytes(), 0, []
        for _ in range(self._count):
            code, n = np.frombuffer(data, np.int64, 2, at)
            at += 16
            buffers = []
            for _ in range(n):
                size = int(np.frombuffer(data, np.int64, 1, at)[0])
                buffers.append(data[at + 8 : at + 8 + size])
                at += 8 + size
            done.append(Done(int(code), buffers))
        assert at == len(data)
        return done, ran.stdout.strip()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# -- matmuls ------------------------------------------------------------------


def _matmul(jobs: Jobs, op: int, packed, scales, x: torch.Tensor, n: int, threads: int) -> int:
    rows, k = x.shape
    return jobs.add(op, [rows, n, k, threads], [packed, scales, x.float()], [rows * n * 4])


def _x(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    x[:, 3] *= 30
    return x


@needs_here
@pytest.mark.parametrize("rows", [1, 7, 33, 129])
def test_the_arm_kernels_give_this_cpus_bits(arm, tmp_path, rows):
    rng = np.random.default_rng(rows)
    w = (rng.standard_normal((80, 256)) * 0.05).astype(np.float32)
    x = _x(rows, 256)
    threads = 1 if rows < 33 else 3
    jobs, want = Jobs(), {}
    # 4-bit (Q4_1 codes), int8 activations
    pack4 = native_pack.pack_int4_q8(parts_from_gguf(gguf.quants.quantize(w, Q.Q4_1), "Q4_1"))
    want[_matmul(jobs, 1, pack4.packed, pack4.scales, x, 80, threads)] = native.int4_q8_matmul(pack4, x)
    # up to 6 bits (Q5_1 codes)
    pack6 = pack_int6_q8(parts_from_gguf6(gguf.quants.quantize(w, Q.Q5_1), "Q5_1"))
    want[_matmul(jobs, 2, pack6.packed, pack6.scales, x, 80, threads)] = native.int6_q8_matmul(pack6, x)
    # 6 bits, symmetric (Q6_K: d alone among the scales)
    pack6s = pack_int6_q8(parts_from_gguf6(_raw6("Q6_K", 80, 256, seed=rows), "Q6_K"))
    assert pack6s.symmetric
    want[_matmul(jobs, 6, pack6s.packed, pack6s.scales, x, 80, threads)] = native.int6_q8_matmul(pack6s, x)
    # signed 8-bit codes (Q8_0)
    pack8 = pack_int8_q8(parts_from_q8_0(gguf.quants.quantize(w, Q.Q8_0)))
    want[_matmul(jobs, 4, pack8.packed, pack8.scales, x, 80, threads)] = native.int8_q8_matmul(pack8, x)
    # F16 weights as the file holds them
    pack16 = pack_w16(parts_from_w16(w.astype(np.float16), "F16"))
    want[_matmul(jobs, 5, pack16.packed, np.zeros(0, np.int16), x, 80, threads)] = native.w16_matmul(pack16, x)
    # the 8-bit head
    if native.int8_supported(96, 256):
        q = torch.from_numpy(rng.integers(-127, 128, (96, 256), dtype=np.int8))
        head = native_pack.pack_int8(q, torch.from_numpy(rng.random(96).astype(np.float32)) / 50)
        want[_matmul(jobs, 3, head.packed, head.scale, x, 96, threads)] = native.int8_matmul(head, x)
    done, isa = jobs.run(arm, tmp_path)
    assert isa == "neon-dotprod"
    for i, expected in want.items():
        assert done[i].code == 0
        got = done[i].tensor(-1, torch.float32, *expected.shape)
        assert torch.equal(got, expected), (i, float((got - expected).abs().max()))


# -- attention ----------------------------------------------------------------

# (queries, pool) dtypes: a float32 model's bf16 pool too.
KINDS = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16), "fp32-bf16-pool": (torch.float32, torch.bfloat16)}


def _attention(jobs: Jobs, q, k, v, tables, lengths, scale, *, row_seq=None, threads=3) -> int:
    rows, heads, dim = q.shape
    kv_heads, num_blocks, block_size, _ = k.shape
    ints = [rows, tables.shape[0], heads, kv_heads, num_blocks, block_size, dim, tables.shape[1],
            int(q.dtype == torch.bfloat16), int(k.dtype == torch.bfloat16), threads, int(row_seq is not None)]  # fmt: skip
    seq = np.zeros(0, np.int64) if row_seq is None else row_seq.to(torch.int64)
    return jobs.add(10, ints, [q, k, v, tables.to(torch.int64), seq, lengths.to(torch.int64)], [rows * heads * dim * 4], [scale])


def _twin(q, k, v, g, scale) -> torch.Tensor:
    """The torch twin; a bf16 pool under fp32 queries widened first (exact, as the kernel reads it)."""
    if q.dtype == torch.float32:
        k, v = k.float(), v.float()
    return reference.paged_attention(q, k, v, g.block_tables, g.pad_index, g.mask, scale).float()


@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_attention_matches_the_twin_and_a_row_is_its_own(arm, tmp_path, kind):
    """Decode rows over scattered blocks of ragged lengths: 1, 7, 33 and
    129 rows, head dims 64 and 128 (the specialized loops) and 48 with 5
    query heads to a KV head (the general one); each within the twin's
    tolerance, and the 33 rows' each the same bits on one thread or three,
    alone (an unpadded table) and in another company and order."""
    qtype, pool = KINDS[kind]
    jobs, checks = Jobs(), []
    for seqs, heads, kv_heads, dim, block_size in [(1, 5, 1, 48, 16), (7, 8, 2, 128, 32), (33, 9, 3, 64, 16), (129, 4, 4, 64, 16)]:
        gen = torch.Generator().manual_seed(seqs * 100 + heads)
        q, k, v, chunks = _case(gen, seqs=seqs, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, dtype=qtype)
        k, v = k.to(pool), v.to(pool)
        g = build_step(chunks, block_size).groups[0]
        scale = dim**-0.5
        checks.append((_attention(jobs, q, k, v, g.block_tables, g.lengths, scale), _twin(q, k, v, g, scale)))
        if seqs == 33:  # the same rows on one thread, a few alone, others in another order
            again = {"one thread": (_attention(jobs, q, k, v, g.block_tables, g.lengths, scale, threads=1), slice(None))}
            for s in (0, 1, 5, 32):
                again[f"row {s} alone"] = (_attention(jobs, q[s : s + 1], k, v, *_tables([chunks[s]], block_size, buckets=False), scale), [s])
            picked = [9, 2, 30]
            again[f"rows {picked}"] = (_attention(jobs, q[picked], k, v, *_tables([chunks[s] for s in picked], block_size), scale), picked)
            crowd = len(checks) - 1
    done, _ = jobs.run(arm, tmp_path)
    results = []
    for i, want in checks:
        assert done[i].code == 0
        got = done[i].tensor(-1, torch.float32, *want.shape)
        torch.testing.assert_close(got, want, atol=TOLERANCE[qtype], rtol=TOLERANCE[qtype])
        results.append(got)
    together = results[crowd]
    for what, (i, rows) in again.items():
        assert torch.equal(done[i].tensor(-1, torch.float32, *together[rows].shape), together[rows]), what


def _tables(chunks, block_size: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    g = build_step(chunks, block_size, **kw).groups[0]
    return g.block_tables, g.lengths


@pytest.mark.parametrize("kind", list(KINDS))
def test_prompt_rows_match_the_twin_and_do_not_depend_on_the_chunking(arm, tmp_path, kind):
    """Prompt chunks read row by row (row_seq) over scattered blocks, one
    after a cached prefix and one of a single token: the twin's causal
    attention within tolerance, and the first chunk cut in two (each part
    alone) or run on one thread the same bits."""
    qtype, pool = KINDS[kind]
    jobs, checks = Jobs(), []
    for heads, kv_heads, dim, block_size in [(9, 3, 64, 16), (8, 2, 128, 16), (5, 5, 32, 8)]:
        gen = torch.Generator().manual_seed(heads * 100 + dim)
        q, k, v, chunks = _prompt_case(gen, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, dtype=qtype)
        k, v = k.to(pool), v.to(pool)
        g = build_step(chunks, block_size, buckets=False).groups[0]
        assert not g.decode and g.row_seq.shape == (59,)
        scale = dim**-0.5
        whole = _attention(jobs, q, k, v, g.block_tables, g.row_lengths, scale, row_seq=g.row_seq)
        single = _attention(jobs, q, k, v, g.block_tables, g.row_lengths, scale, row_seq=g.row_seq, threads=1)
        first = chunks[0]
        parts = []
        for cut, rows in ((SeqChunk(first.token_ids[:13], 0, first.block_table), slice(0, 13)),
                          (SeqChunk(first.token_ids[13:], 13, first.block_table), slice(13, 37))):  # fmt: skip
            a = build_step([cut], block_size, buckets=False).groups[0]
            parts.append((_attention(jobs, q[rows], k, v, a.block_tables, a.row_lengths, scale, row_seq=a.row_seq), rows))
        checks.append((whole, single, parts, _twin(q, k, v, g, scale)))
    done, _ = jobs.run(arm, tmp_path)
    for whole, single, parts, want in checks:
        assert done[whole].code == 0
        got = done[whole].tensor(-1, torch.float32, *want.shape)
        torch.testing.assert_close(got, want, atol=TOLERANCE[qtype], rtol=TOLERANCE[qtype])
        assert torch.equal(done[single].tensor(-1, torch.float32, *want.shape), got)
        for i, rows in parts:
            assert torch.equal(done[i].tensor(-1, torch.float32, *got[rows].shape), got[rows])


def test_attention_refuses_what_it_does_not_take(arm, tmp_path):
    """The ARM build's bounds checks: a length past the table, a block id
    outside the pool, a row_seq past the tables, head dim 72, bf16
    queries over an fp32 pool."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, chunks = _case(gen, seqs=2, heads=4, kv_heads=2, dim=64, block_size=16, dtype=torch.float32)
    tables, lengths = _tables(chunks, 16, buckets=False)
    too_long, bad_block = lengths.clone(), tables.clone()
    too_long[1] = tables.shape[1] * 16 + 1
    bad_block[0, 0] = k.shape[1]
    jobs = Jobs()
    cases = [
        (_attention(jobs, q, k, v, tables, too_long, 0.125), 3),
        (_attention(jobs, q, k, v, bad_block, lengths, 0.125), 3),
        (_attention(jobs, q, k, v, tables, lengths, 0.125, row_seq=torch.tensor([0, 2])), 3),
        (_attention(jobs, torch.randn(2, 4, 72), torch.randn(2, 8, 16, 72), torch.randn(2, 8, 16, 72), tables, lengths, 0.1), 1),
        (_attention(jobs, q.bfloat16(), k, v, tables, lengths, 0.125), 1),
        (_attention(jobs, q, k, v, tables, lengths, 0.125), 0),
    ]
    done, _ = jobs.run(arm, tmp_path)
    assert [done[i].code for i, _ in cases] == [code for _, code in cases]


# -- RMSNorm, the residual add, SiLU, RoPE ------------------------------------------

ROWS = [1, 7, 33, 129]  # 129: the kernels' OpenMP split (at 64 rows and up)


def _rms_norm(jobs, x, weight, eps, dtype) -> int:
    return jobs.add(11, [*x.shape, int(dtype == torch.bfloat16)], [x, weight], [x.numel() * _itemsize(dtype)], [eps])


def _silu(jobs, gate_up) -> int:
    rows, width = gate_up.shape
    return jobs.add(13, [rows, width // 2, int(gate_up.dtype == torch.bfloat16)], [gate_up], [rows * width // 2 * _itemsize(gate_up.dtype)])


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norms_and_silu_give_this_cpus_bits_row_by_row(arm, tmp_path, dtype):
    """RMSNorm (then cast), the residual add fused into it, and SiLU times
    up, at 1, 7, 33 and 129 rows of odd widths: this CPU's bits; the twins'
    tolerances; the first and last rows alone the same bits; the fused add
    leaves h + delta in h and the norm of that sum."""
    jobs, cases = Jobs(), []
    for rows, n, f in zip(ROWS, [576, 17, 100, 48], [1536, 21, 48, 7]):
        gen = torch.Generator().manual_seed(rows * n)
        x = torch.randn(rows, n, generator=gen) * 30
        x[0, 0] = 2.5e4  # an "attention sink" sized value
        weight = torch.rand(n, generator=gen) + 0.5
        delta = torch.randn(rows, n, generator=gen).to(dtype)
        gate_up = (torch.randn(rows, 2 * f, generator=gen) * 6).to(dtype)
        gate_up[0, :4] = torch.tensor([0.0, -0.0, -100.0, 100.0])
        h = torch.randn(rows, n, generator=gen) * 30
        c = dict(x=x, weight=weight, delta=delta, gate_up=gate_up, h=h, rows=rows)
        c["norm"] = _rms_norm(jobs, x, weight, 1e-5, dtype)
        c["norm_alone"] = [(r, _rms_norm(jobs, x[r : r + 1], weight, 1e-5, dtype)) for r in {0, rows - 1}]
        c["fused"] = jobs.add(12, [rows, n, int(delta.dtype == torch.bfloat16), int(dtype == torch.bfloat16)], [h, delta, weight],
                              [rows * n * _itemsize(dtype)], [1e-5])  # fmt: skip
        c["norm_of_sum"] = _rms_norm(jobs, h + delta, weight, 1e-5, dtype)
        c["silu"] = _silu(jobs, gate_up)
        c["silu_alone"] = [(r, _silu(jobs, gate_up[r : r + 1])) for r in {0, rows - 1}]
        cases.append(c)
    done, _ = jobs.run(arm, tmp_path)
    for c in cases:
        x, weight, rows = c["x"], c["weight"], c["rows"]
        got = done[c["norm"]].tensor(-1, dtype, *x.shape)
        assert torch.equal(got, native.rms_norm(x, weight, 1e-5, dtype)), rows
        tolerance = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got.float(), reference.rms_norm(x, weight, 1e-5).to(dtype).float(), atol=tolerance, rtol=tolerance)
        for r, i in c["norm_alone"]:
            assert torch.equal(done[i].tensor(-1, dtype, 1, x.shape[1])[0], got[r]), (rows, r)
        summed = c["h"] + c["delta"]
        fused = done[c["fused"]]
        assert torch.equal(fused.tensor(0, torch.float32, *x.shape), summed)  # h, written in place
        out = fused.tensor(-1, dtype, *x.shape)
        assert torch.equal(out, done[c["norm_of_sum"]].tensor(-1, dtype, *x.shape))
        assert torch.equal(out, native.add_rms_norm(c["h"].clone(), c["delta"], weight, 1e-5, dtype))
        gate_up = c["gate_up"]
        f = gate_up.shape[1] // 2
        silu = done[c["silu"]].tensor(-1, dtype, rows, f)
        assert torch.equal(silu, native.silu_mul(gate_up)), rows
        gate, up = gate_up.double().chunk(2, dim=-1)
        exact = gate * torch.sigmoid(gate) * up
        step = 2**-8 if dtype == torch.bfloat16 else 2**-20
        assert ((silu.double() - exact).abs() <= step * exact.abs() + 1e-30).all()
        for r, i in c["silu_alone"]:
            assert torch.equal(done[i].tensor(-1, dtype, 1, f)[0], silu[r]), (rows, r)


def _rope(jobs, qkv, positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads) -> int:
    rows, dim = qkv.shape[0], k_cache.shape[-1]
    ints = [rows, slots.shape[0], heads, kv_heads, dim, cos.shape[0], k_cache.shape[1] * k_cache.shape[2],
            int(qkv.dtype == torch.bfloat16), int(k_cache.dtype == torch.bfloat16)]  # fmt: skip
    return jobs.add(14, ints, [qkv, positions, cos, sin, k_cache, v_cache, slots], [rows * heads * dim * _itemsize(qkv.dtype)])


@pytest.mark.parametrize("kind", list(KINDS))
def test_rope_and_the_kv_write_are_the_twins_bits(arm, tmp_path, kind):
    """RoPE on q and k with the K/V store into scattered slots, pad rows
    rotated and never stored: bit-identical to the torch twin at 1, 7, 33
    and 129 rows; out-of-range positions and slots, and bf16 rows over an
    fp32 pool, refused."""
    dtype, pool = KINDS[kind]
    jobs, cases = Jobs(), []
    num_blocks = 11
    for rows, real, (heads, kv_heads, dim) in zip(ROWS, [1, 5, 33, 100], [(9, 3, 64), (4, 4, 128), (8, 2, 16), (6, 2, 32)]):
        case = rope_case(rows, real, heads, kv_heads, dim, dtype, pool, num_blocks)
        qkv, positions, cos, sin, caches, slots = case.qkv, case.positions, case.cos, case.sin, case.caches, case.slots
        args = (qkv, positions, cos, sin, *caches, slots, heads, kv_heads)
        cases.append((_rope(jobs, *args), case.want_q, case.want_k, case.want_v))
        if rows == 7:
            refused = [_rope(jobs, qkv, positions + MAX_POS, *args[2:]),
                       _rope(jobs, qkv, positions, cos, sin, *caches, slots + num_blocks * BLOCK_SIZE, heads, kv_heads)]  # fmt: skip
    mismatched = _rope(jobs, torch.zeros(1, 3 * 16, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64), torch.ones(4, 8), torch.zeros(4, 8),
                       torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16), torch.zeros(1, dtype=torch.int64), 1, 1)  # fmt: skip
    done, _ = jobs.run(arm, tmp_path)
    for i, want_q, want_k, want_v in cases:
        assert done[i].code == 0
        assert torch.equal(done[i].tensor(-1, dtype, *want_q.shape), want_q)
        assert torch.equal(done[i].tensor(4, pool, *want_k.shape), want_k)
        assert torch.equal(done[i].tensor(5, pool, *want_v.shape), want_v)
    assert [done[i].code for i in refused] == [3, 3]
    assert done[mismatched].code == 1


# -- the load-time packers ------------------------------------------------------------


def _pack_rows(jobs, op: int, raw: np.ndarray, order: np.ndarray, n: int, k: int, outputs, kind=0, group=TILE_GROUPS, symmetric=0) -> int:
    return jobs.add(op, [n, k, kind, group, symmetric, raw.strides[0], 3], [raw, order.astype(np.int64)], outputs)


# The NaN an invalid operation (inf - inf, 0 x inf) makes, as f16 bits:
# x86's "default NaN" has the sign bit set, AArch64's does not. Packing
# Q4_1 or Q4_K blocks with infinite d or m makes one (m = zero - 8 d), and
# numpy on each machine makes its own as well; the loader refuses such
# blocks (gguf_loader._check_finite) before anything is packed.
ARM_DEFAULT_NAN, X86_DEFAULT_NAN = 0x7E00, 0xFE00


def _differ(got: bytes, want, scales: bool) -> str | None:
    """None where ``got`` is ``want``'s bytes (f16 scales: but for the
    default NaNs' sign, and only there); else what differs."""
    w = _bytes(want)
    if scales and len(got) == len(w):
        a, b = np.frombuffer(got, np.uint16), np.frombuffer(w, np.uint16)
        off = (a != b) & ~((a == ARM_DEFAULT_NAN) & (b == X86_DEFAULT_NAN))
        if not off.any():
            return None
        j = int(np.argmax(off))
        return f"{int(off.sum())} of {a.size} f16 scales differ, the first at {j}: {a[j]:#06x} here, {b[j]:#06x} on x86"
    if got == w:
        return None
    a, b = np.frombuffer(got, np.uint8), np.frombuffer(w, np.uint8)
    if a.size != b.size:
        return f"{a.size} bytes, {b.size} on x86"
    return f"{int((a != b).sum())} of {a.size} bytes differ, the first at {int(np.argmax(a != b))}"


@needs_library
def test_the_packers_write_this_cpus_bytes(arm, tmp_path):
    """The row packers native_pack.py runs at load time (4-bit from Q4_0, Q4_1,
    Q4_K; 6-bit from Q6_K, Q5_K, Q5_0, Q5_1; Q8_0; F16 and BF16), reading
    rows through pointers in a shuffled order, on three threads, at 1, 4
    and 7 tiles (a short last group) and 1, 7, 33 and 129 rows (16-bit):
    this CPU's bytes and scale bits, f16 fields of every kind included
    (subnormal, huge, infinite, NaN; the sign of a NaN that infinite
    fields make aside, `ARM_DEFAULT_NAN`), and the same symmetric verdict."""
    rng = np.random.default_rng(42)
    jobs, checks = Jobs(), []
    with np.errstate(all="ignore"):
        for qtype in ("Q4_0", "Q4_1", "Q4_K"):
            for tiles in (1, 4, 7):
                n, k = 16 * tiles, 512
                raw, order = _q4_tensor(qtype, n, k, rng), rng.permutation(n)
                want = native_pack.pack_int4_q8_rows(Int4Rows.of(raw, qtype).take_rows(order))
                i = _pack_rows(jobs, 20, raw, order, n, k, [n * k // 2, n * k // 32 * 4], kind=native_pack._ROWS_KINDS[qtype], group=native_pack.Q8_GROUP_TILES)
                checks.append((i, (qtype, tiles), [want.packed, want.scales], None))
        for qtype in ("Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q6_K finite"):
            for tiles in (1, 4, 7):
                n, k = 16 * tiles, 512
                if qtype == "Q6_K finite":  # m = -32 d everywhere: the layout with d alone
                    raw = _q6_tensor("Q6_K", n, k, rng).reshape(n, 2, 210)
                    raw[..., 208:210] = (rng.random((n, 2)) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, 2, 2)
                    raw = raw.reshape(n, -1)
                else:
                    raw = _q6_tensor(qtype, n, k, rng)
                order = rng.permutation(n)
                kind = native_pack.CODES6_KINDS[qtype.split()[0]][0]
                want = native_pack.pack_int6_q8_rows(Int6Rows.of(raw, qtype.split()[0]).take_rows(order))
                assert want.symmetric == (qtype == "Q6_K finite")
                scales = n * k // 32 * (2 if want.symmetric else 4) * 2  # bytes of f16
                i = _pack_rows(jobs, 21, raw, order, n, k, [n * k * 3 // 4, scales], kind=kind, symmetric=int(want.symmetric))
                checks.append((i, (qtype, tiles), [want.packed, want.scales], int(want.symmetric)))
        for tiles in (1, 4, 7):
            n, k = 16 * tiles, 256
            raw = rng.integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
            raw[..., 0:2] = _f16_fields(rng, n * (k // 32)).view(np.uint8).reshape(n, k // 32, 2)
            raw, order = raw.reshape(n, -1), rng.permutation(n)
            want = native_pack.pack_int8_q8_rows(Q8Rows.of(raw, "Q8_0").take_rows(order))
            checks.append((_pack_rows(jobs, 22, raw, order, n, k, [n * k, n * k // 32 * 2]), ("Q8_0", tiles), [want.packed, want.scales], None))
        for qtype in ("F16", "BF16"):
            for n in ROWS:
                k = 200
                values = rng.standard_normal((n, k)).astype(np.float32)
                bits = values.astype(np.float16).view(np.uint16) if qtype == "F16" else (values.view(np.uint32) >> 16).astype(np.uint16)
                order = rng.permutation(n)
                want = native_pack.pack_w16_rows(W16Rows.of(bits.view(np.uint8), qtype).take_rows(order))
                i = _pack_rows(jobs, 23, bits, order, n, k, [want.packed.numel() * 2])
                checks.append((i, (qtype, n), [want.packed], None))
    done, _ = jobs.run(arm, tmp_path)
    for i, what, want, symmetric in checks:
        got = done[i].buffers[2:]
        assert len(got) == len(want)
        for j, (g, w) in enumerate(zip(got, want)):
            wrong = _differ(g, w, scales=j == 1)
            assert wrong is None, (what, "codes" if j == 0 else "scales", wrong)
        if symmetric is not None:
            assert done[i].code == symmetric, what


# -- the shared library -------------------------------------------------------------


def test_the_shared_library_links_and_exports_what_the_bindings_use(arm, tmp_path):
    """native_build.py's build (its FLAGS with `ARM_MARCH`): a 64-bit ARM
    shared object that needs libgomp, exports every trioserve_ function
    native_build.py declares and native.py and native_pack.py call, holds
    sdot (the dot-product paths compiled in), and, linked into the
    harness, loads and names its instruction sets under qemu."""
    if arm.library is None:
        pytest.skip(arm.why_not)
    tools = {name: shutil.which(f"aarch64-linux-gnu-{name}") for name in ("readelf", "nm", "objdump")}
    if None in tools.values():
        pytest.skip("needs aarch64-linux-gnu-readelf, -nm and -objdump (Debian: binutils-aarch64-linux-gnu)")

    def tool(name: str, *args: str) -> str:
        return subprocess.run([tools[name], *args, str(arm.library)], capture_output=True, text=True, check=True, timeout=120).stdout

    header = tool("readelf", "-h")
    assert re.search(r"Machine:\s+AArch64", header) and re.search(r"Type:\s+DYN", header), header
    assert "[libgomp.so.1]" in tool("readelf", "-d")
    exported = {line.split()[-1] for line in tool("nm", "-D", "--defined-only").splitlines() if line.split()[-2:-1] == ["T"]}
    bound = {name for module in (native_build, native, native_pack) for name in re.findall(r"\btrioserve_\w+", Path(module.__file__).read_text())}
    assert len(bound) > 20, bound
    assert bound <= exported, sorted(bound - exported)
    assert re.search(r"\bsdot\b", tool("objdump", "-d", "--no-show-raw-insn"))
    _, isa = Jobs().run(arm, tmp_path)
    assert isa == "neon-dotprod"


@needs_library
def test_the_sampler_arithmetic_gives_this_cpus_bits(arm, tmp_path):
    """csrc/sampler.c's exp, block sums, exp sums and log_softmax on ARM: the
    bits of this CPU's build and of the numpy twins (kernels/sampler_math.py),
    for rows of awkward widths, masked entries and wide spreads."""
    from trioserve.kernels.sampler_math import BLOCK, FIXED, Numerics, log_fixed

    twin = Numerics(lib=None)
    jobs, cases = Jobs(), []
    for width in (7, 16, 257, 360, 49152):
        gen = torch.Generator().manual_seed(width)
        x = torch.randn(3, width, generator=gen) * 6
        x[1, : width // 2] = -float("inf")
        x[2] *= 30
        shift = x.amax(dim=1)
        weights = twin.exp_shifted(x, shift)
        lse = torch.tensor([log_fixed(float(s)) for s in np.cumsum(twin.block_sums(twin.exp_shifted(x, shift)).numpy(), axis=1)[:, -1]], dtype=torch.float64)
        c = dict(x=x, shift=shift, weights=weights, lse=lse, width=width)
        c["exp"] = jobs.add(30, [3, width, 2], [x, shift], [x.numel() * 4])
        c["sums"] = jobs.add(31, [3, width, BLOCK, 2], [weights], [3 * -(-width // BLOCK) * 8])
        c["exp_sums"] = jobs.add(32, [3, width, BLOCK, 2], [x], [3 * 4, 3 * 8])
        c["lsm"] = jobs.add(33, [3, width, 2], [x, shift, lse], [x.numel() * 4])
        cases.append(c)
    done, _ = jobs.run(arm, tmp_path)
    for c in cases:
        x, width = c["x"], c["width"]
        assert torch.equal(done[c["exp"]].tensor(-1, torch.float32, 3, width), twin.exp_shifted(x, c["shift"])), width
        assert torch.equal(done[c["sums"]].tensor(-1, torch.float64, 3, -(-width // BLOCK)), twin.block_sums(c["weights"])), width
        sums = done[c["exp_sums"]]
        assert torch.equal(sums.tensor(-2, torch.float32, 3), c["shift"]), width
        assert torch.equal(sums.tensor(-1, torch.float64, 3), torch.from_numpy(np.cumsum(twin.block_sums(c["weights"]).numpy(), axis=1)[:, -1])), width
        lsm = done[c["lsm"]].tensor(-1, torch.float32, 3, width)
        assert torch.equal(lsm, twin.log_softmax(x)) and torch.equal(lsm, FIXED.log_softmax(x)), width
