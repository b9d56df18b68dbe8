"""The integer kernels' plain C build (`TRIOSERVE_CPU_FEATURES=generic`,
`-march=x86-64`: no SIMD, no FMA instruction) against the SIMD builds this
CPU runs (native, avx2-vnni, avx2): the 4-bit (Q4_0, Q4_1, Q4_K), 6-bit
(Q6_K, Q5_K, Q5_0, Q5_1) and signed 8-bit (Q8_0) codes kernels with int8
activations, and the 8-bit output head, give every row the same bits at
every level, so `--activations int8` runs at generic too and a trace
recorded on an AVX-512 server replays there with the same tokens and
log-probabilities. The model check at the end runs the tiny Q4_1 and Q8_0
models in a process per level and compares their logits bit for bit.

A level this CPU lacks, or a build that does not load (no C compiler), is
skipped with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from tests.kernels.test_int6 import _raw as _raw6
from tests.kernels.test_int8w import _raw as _raw8
from tests.kernels.test_native_q8 import _parts, _rows
from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels import native, native_build, native_pack
from trioserve.kernels.cpu import level_fits
from trioserve.kernels.int6 import pack_int6_q8, parts_from_gguf6
from trioserve.kernels.int8w import pack_int8_q8, parts_from_q8_0

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[2]
SIMD_LEVELS = ("native", "avx2-vnni", "avx2")
ROWS = (1, 3, 17, 64)
# (x's dtype, the output's): fp32 in and out, bf16 in and out, fp32 in and bf16 out.
DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16))


def _generic():
    """The generic build, or skip saying why there is none."""
    unfit = level_fits("generic")
    if unfit:
        pytest.skip(f"{CPU_FEATURES_ENV}=generic: {unfit}")
    lib = native_build.library_at("generic")
    if lib is None:
        pytest.skip("no C kernels at generic here (no C compiler, or TRIOSERVE_NATIVE_KERNELS=0)")
    return lib


def _levels() -> dict:
    """{level: library} for generic and every SIMD level that runs here (at least one, else skip)."""
    libs = {"generic": _generic()}
    for level in SIMD_LEVELS:
        if level_fits(level) is None and (lib := native_build.library_at(level)) is not None and lib.trioserve_int4_q8_available():
            libs[level] = lib
    if len(libs) < 2:
        pytest.skip("no SIMD build of the integer kernels runs here to compare the plain C one with")
    return libs


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, so that NaN compares as the bits it is."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _edge_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with, from 17 rows up, rows the kernels meet rarely: one of
    subnormal inputs (its step 127 / amax overflows: every byte -128, the
    sign-flip case of the 8-bit codes), one of huge ones (outputs overflow),
    one with a few subnormals among normal inputs (the head's fused path)."""
    x = x.clone()
    if x.shape[0] >= 17:
        x[5] = x[5] * 1e-40
        x[9] = x[9] * 1e36
        x[11, ::7] = 3e-39
    return x


def _assert_levels_agree(libs: dict, run) -> None:
    """run(lib) -> list of tensors; the same bits at every level."""
    outs = {level: run(lib) for level, lib in libs.items()}
    generic = outs.pop("generic")
    for level, other in outs.items():
        for i, (a, b) in enumerate(zip(generic, other, strict=True)):
            assert torch.equal(_bits(a), _bits(b)), f"generic and {level} differ in output {i}: {float((a.float() - b.float()).abs().nan_to_num().max())}"


def test_the_generic_build_has_the_integer_kernels(monkeypatch):
    """They report themselves there, and `--activations auto` takes int8 at generic."""
    from trioserve.kernels.ops import select_kernels

    lib = _generic()
    assert lib.trioserve_isa().decode() in ("generic", "neon")
    for name in ("int4_q8", "int6_q8", "int8_q8", "int8"):
        assert getattr(lib, f"trioserve_{name}_available")() == 1, name
    assert lib.trioserve_int4_available() == 0  # the bf16-activation 4-bit kernel stays AVX-512 BF16's
    monkeypatch.setenv(CPU_FEATURES_ENV, "generic")
    assert native.int4_q8_supported(16, 32) and native.int6_q8_supported(16, 32) and native.int8_q8_supported(16, 32)
    assert native.int8_supported(32, 2) and not native.int4_supported(32, 32)
    cpu = torch.device("cpu")
    assert select_kernels("auto", cpu, torch.float32, 4, 2, 16).activations == "int8"
    assert select_kernels("auto", cpu, torch.float32, 4, 2, 16, "int8").activations == "int8"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("qtype", "n", "k"), [(Q.Q4_0, 48, 32), (Q.Q4_1, 80, 288), (Q.Q4_0, 208, 512), (Q.Q4_K, 80, 512)],
                         ids=lambda v: v.name.lower() if isinstance(v, Q) else None)  # fmt: skip
def test_the_4bit_kernel_gives_the_simd_builds_bits(qtype, n, k, rows):
    """80 outputs are five tiles (a group of three, then two), 208 thirteen (a last group of one)."""
    libs = _levels()
    pack = native_pack.pack_int4_q8(_parts(n, k, qtype, seed=rows))
    x = _edge_rows(_rows(rows, k, seed=rows))
    _assert_levels_agree(libs, lambda lib: [native.int4_q8_matmul(pack, x.to(a), lib=lib, out_dtype=b) for a, b in DTYPES])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("qtype", "n", "k"), [("Q6_K", 80, 512), ("Q5_K", 48, 256), ("Q5_0", 80, 288), ("Q5_1", 16, 64)])
def test_the_6bit_kernel_gives_the_simd_builds_bits(qtype, n, k, rows):
    """Q6_K's weight is symmetric (m = -32 d made in the kernel), the others keep m."""
    libs = _levels()
    pack = pack_int6_q8(parts_from_gguf6(_raw6(qtype, n, k, seed=rows), qtype))
    assert pack.symmetric == (qtype == "Q6_K")
    x = _edge_rows(_rows(rows, k, seed=rows))
    _assert_levels_agree(libs, lambda lib: [native.int6_q8_matmul(pack, x.to(a), lib=lib, out_dtype=b) for a, b in DTYPES])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k", "extreme"), [(80, 288, False), (48, 512, True), (16, 32, True)])
def test_the_8bit_codes_kernel_gives_the_simd_builds_bits(n, k, extreme, rows):
    """``extreme``: blocks of codes -128 and 127 only (the largest pair sums)."""
    libs = _levels()
    pack = pack_int8_q8(parts_from_q8_0(_raw8(n, k, seed=rows, extreme=extreme)))
    x = _edge_rows(_rows(rows, k, seed=rows))
    _assert_levels_agree(libs, lambda lib: [native.int8_q8_matmul(pack, x.to(a), lib=lib, out_dtype=b) for a, b in DTYPES])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(32, 2), (96, 576), (64, 34)])
def test_the_8bit_head_gives_the_simd_builds_bits(n, k, rows):
    """Two fused multiply-adds per input pair in `vdpbf16ps`'s order; the
    plain C build adds exact products plainly, and rows with inputs outside
    [2^-126, 2^120] take its emulated fused multiply-add."""
    libs = _levels()
    gen = torch.Generator().manual_seed(rows * n + k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    pack = native_pack.pack_int8(q, torch.rand(n, generator=gen) / 64)
    x = torch.randn(rows, k, generator=gen) * 3
    if rows >= 17:
        x[4, ::3] = 2e-39  # subnormal inputs among normal ones: the fused path
        x[6] *= 2.0**110  # products near fp32's top: still exact
    _assert_levels_agree(libs, lambda lib: [native.int8_matmul(pack, x.to(a), lib=lib) for a in (torch.float32, torch.bfloat16)])


def test_a_row_gets_the_same_bits_alone_in_company_and_on_any_thread_count():
    lib = _generic()
    parts = _parts(112, 320, Q.Q4_1)
    packs = {
        "int4": (native.int4_q8_matmul, native_pack.pack_int4_q8(parts)),
        "int6": (native.int6_q8_matmul, pack_int6_q8(parts_from_gguf6(_raw6("Q5_1", 112, 320, seed=3), "Q5_1"))),
        "int8": (native.int8_q8_matmul, pack_int8_q8(parts_from_q8_0(_raw8(112, 320, seed=3)))),
    }
    x = _rows(33, 320).to(torch.bfloat16)
    for name, (kernel, pack) in packs.items():
        together = kernel(pack, x, lib=lib, threads=2)
        assert torch.equal(kernel(pack, x, lib=lib, threads=1), together), name
        for r in (0, 5, 32):
            assert torch.equal(kernel(pack, x[r : r + 1], lib=lib, threads=2), together[r : r + 1]), name
        assert torch.equal(kernel(pack, x[3:10], lib=lib, threads=3), together[3:10]), name


# The model check's child: the tiny model at the level $TRIOSERVE_CPU_FEATURES
# names, float32, int8 activations, the C kernels; three prompts prefilled in
# one step, then greedy decode steps of all three together, every step's logits saved.
_CHILD = r"""
import sys
import torch
from trioserve.kernels import native
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step

def run(path, out):
    model = DecoderModel.from_checkpoint(load_checkpoint(path, dtype=torch.float32), batch_invariant=True, kernels="auto", activations="int8")
    assert model.kernels.name == "native" and model.kernels.activations == "int8", (model.kernels.name, model.kernels.activations)
    prompts = [[5, 9, 33, 7, 2, 8, 11, 4, 17], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [40, 2]]
    block, per_seq = 4, 8
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    cache = model.new_kv_cache(per_seq * len(prompts), block)
    step = build_step([SeqChunk(p, 0, t[: (len(p) + block - 1) // block]) for p, t in zip(prompts, tables)], block, fixed=True)
    logits, lengths = [], [len(p) for p in prompts]
    for _ in range(8):
        got = model.forward(step, cache)
        logits.append(got.clone())
        chunks = []
        for i, row in enumerate(got):
            chunks.append(SeqChunk([int(row.argmax())], lengths[i], tables[i][: lengths[i] // block + 1], decode=True))
            lengths[i] += 1
        step = build_step(chunks, block, fixed=True)
    torch.save({"isa": native.isa(), "runner": model.runner is not None, "logits": logits}, out)

for path, out in zip(sys.argv[1::2], sys.argv[2::2], strict=True):  # (model, output) pairs, one after the other
    run(path, out)
"""
KINDS = ("gguf_q4_1", "gguf_q8_0")


@pytest.fixture(scope="module")
def level_logits(tiny_checkpoints, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """{level: {kind: what _CHILD saved}} for generic and the SIMD levels
    that run here: each level in a process of its own, as a server would
    run it, which runs the tiny Q4_1 model and then the Q8_0 one (one
    process a level, not one a level and model: ~1.3 s each saved)."""
    _generic()
    levels = ["generic", *(level for level in ("avx2", "native") if level_fits(level) is None and native_build.library_at(level) is not None)]
    if len(levels) < 2:
        pytest.skip("no SIMD level runs here to compare the plain C build with")
    where = tmp_path_factory.mktemp("levels")
    results = {}
    for level in levels:
        pairs = [(str(tiny_checkpoints[kind]), str(where / f"{level}-{kind}.pt")) for kind in KINDS]
        env = {**os.environ, CPU_FEATURES_ENV: level}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, *(arg for pair in pairs for arg in pair)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results[level] = {kind: torch.load(out) for kind, (_, out) in zip(KINDS, pairs, strict=True)}
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_the_tiny_models_give_the_same_logits_at_generic_avx2_and_native(level_logits, kind):
    """Each level in a process of its own, as a server would run it."""
    results = {level: by_kind[kind] for level, by_kind in level_logits.items()}
    assert results["generic"]["isa"] == "generic"
    first = results.pop("generic")
    for level, other in results.items():
        assert other["isa"] != "generic" and other["runner"] == first["runner"], level
        for step, (a, b) in enumerate(zip(first["logits"], other["logits"], strict=True)):
            assert torch.equal(a, b), f"{kind}: generic and {level} ({other['isa']}) differ at step {step}: {float((a - b).abs().max())}"
