"""Int8 activations for the 4-bit projections (`--activations int8`): the C
VNNI kernel (kernels/native.py `int4_q8_matmul`) against its torch twin
(kernels/reference.py `int4_q8_matmul`) and the dequantized weights, its
batch invariance, its refusals, `Projection`'s and `select_kernels`' choice,
the settings, and a recorded run replayed with the activations it had.

The kernel has an AVX-512 VNNI build and an AVX2 one (with `vpdpbusd` from
AVX-VNNI, or `vpmaddubsw` + `vpmaddwd` without it), chosen from the CPU's
flags; the kernel tests run at every level this CPU can execute
($TRIOSERVE_CPU_FEATURES: native, avx2-vnni, avx2), so an AVX-512 machine
tests the AVX2 code too, and every level gives the same bits. A level the
CPU lacks is skipped with the reason; the twin's tests always run."""

from __future__ import annotations

import functools
import json

import gguf
import numpy as np
import pytest
import torch
import trio

from tests.k_quants import quantize_q4_k
from trioserve import cli
from trioserve.config import CPU_FEATURES_ENV
from trioserve.kernels import native, native_pack, reference
from trioserve.kernels.cpu import level_fits
from trioserve.kernels.int4 import parts_from_gguf
from trioserve.kernels.projection import Projection
from trioserve.kernels.tiled import PROMPT_TILE, tiled_linear

Q = gguf.GGMLQuantizationType
needs_vnni = pytest.mark.skipif(not native.int4_q8_supported(16, 32), reason="the int8-activation kernel needs the C kernels (no C compiler here)")
LEVELS = ("native", "avx2-vnni", "avx2")


def _use_level(level: str, monkeypatch) -> None:
    """Run the C kernels built for ``level`` from here on, or skip saying why not."""
    unfit = level_fits(level)
    if unfit:
        pytest.skip(f"{CPU_FEATURES_ENV}={level}: {unfit}")
    monkeypatch.setenv(CPU_FEATURES_ENV, level)
    if not native.int4_q8_supported(16, 32):
        pytest.skip(f"no int8-activation kernel at {level} here (no C compiler, or TRIOSERVE_NATIVE_KERNELS=0)")


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch) -> str:
    """Each instruction-set level of the kernels this CPU can run."""
    _use_level(request.param, monkeypatch)
    return request.param


def _parts(n: int, k: int, qtype=Q.Q4_1, seed: int = 0):
    """A random [n, k] weight with a per-row offset, quantized to ``qtype``
    (Q4_K by the tests' own writer: the gguf package cannot write it)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.1 + rng.uniform(-0.05, 0.05, (n, 1))).astype(np.float32)
    raw = quantize_q4_k(w) if qtype == Q.Q4_K else gguf.quants.quantize(w, qtype)
    return parts_from_gguf(raw, qtype.name)


def _twin_args(parts):
    d = parts.scale.float()
    return parts.q, d, (parts.zero.float() - 8 * d).half().float()


def _rows(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[:, 7] *= 30  # an outlier channel: its block's other inputs get coarse steps
    if rows > 2:
        x[2] = 0  # a row of zeros: amax 0, every byte 0
    return x


# (qtype, n, k, rows): Q4_0 and Q4_1 at every shape by 1, 3 and 37 rows;
# then each 4-bit type by 1, 7, 33 and 129 rows on a small weight, K not a
# multiple of 256 (288: nine blocks of 32) where the type allows it (Q4_K
# comes in super-blocks of 256).
TWIN_CASES = [
    *((qtype, n, k, rows) for qtype in (Q.Q4_0, Q.Q4_1) for n, k in ((16, 32), (80, 96), (960, 576), (96, 1536)) for rows in (1, 3, 37)),
    *((qtype, 80, 288, rows) for qtype in (Q.Q4_0, Q.Q4_1) for rows in (1, 7, 33, 129)),
    *((Q.Q4_K, n, k, rows) for n, k in ((80, 512), (48, 256)) for rows in (1, 7, 33, 129)),
]


@functools.lru_cache(maxsize=2)
def _twin_case(qtype, n, k, rows, dtype):
    """The weight, the rows and the twin's answer, made once for every
    level (the twin does not depend on the level, and is the slow part)."""
    parts = _parts(n, k, qtype)
    x = _rows(rows, k).to(dtype)
    return parts, x, reference.int4_q8_matmul(*_twin_args(parts), x)


@pytest.mark.parametrize("level", LEVELS, indirect=True)  # outermost: the levels of one case run in a row, sharing its twin
@pytest.mark.parametrize(("qtype", "n", "k", "rows"), TWIN_CASES, ids=lambda v: v.name.lower() if isinstance(v, Q) else None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_matches_its_torch_twin_and_the_weights(level, qtype, n, k, rows, dtype):
    """Within fp32 rounding of the twin (the kernel fuses two multiply-adds
    a block), and within the 8-bit rounding's bound of the dequantized
    weights in float64; each row the same bits alone as in company. 80
    outputs are five tiles of 16: a group of three, then two."""
    parts, x, twin = _twin_case(qtype, n, k, rows, dtype)
    pack = native_pack.pack_int4_q8(parts)
    out = native.int4_q8_matmul(pack, x)
    assert out.dtype == dtype and out.shape == (rows, n)
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(native.int4_q8_matmul(pack, x[r : r + 1]), out[r : r + 1])
    scale = twin.abs().max()
    if dtype == torch.float32:
        assert (out - twin).abs().max() <= 1e-6 * scale
    else:  # the kernel's output rounded once to bf16
        assert ((out.float() - twin).abs() <= twin.abs() * 2**-8 + 1e-6 * scale).all()
    # Against the weights, w = q d + m: the m part takes the exact input
    # sums, and each input is off by at most half its block's step (xd / 2)
    # in the q d part, so an output by at most the sum over blocks of
    # xd / 2 times d times the block's codes (plus fp32 rounding).
    dense = x.to(torch.bfloat16).double() @ parts.dequantize().double().T
    _, xd, _ = reference.q8_blocks(x)
    codes = parts.q.double().view(n, k // 32, 32).sum(-1) * parts.scale.double().abs()
    bound = (xd.double() / 2) @ codes.T + 1e-5 * dense.abs().max()
    assert ((out.double() - dense).abs() <= bound * (1 + 2**-7)).all()
    if rows > 2:
        assert torch.equal(out[2], torch.zeros(n, dtype=dtype))


def test_a_row_gets_the_same_bits_alone_in_company_and_on_any_thread_count(level):
    parts = _parts(960, 576)
    pack = native_pack.pack_int4_q8(parts)
    x = _rows(33, 576).to(torch.bfloat16)
    together = native.int4_q8_matmul(pack, x, threads=2)
    assert torch.equal(native.int4_q8_matmul(pack, x, threads=1), together)
    for r in (0, 5, 32):
        assert torch.equal(native.int4_q8_matmul(pack, x[r : r + 1]), together[r : r + 1])
    assert torch.equal(native.int4_q8_matmul(pack, x[3:10]), together[3:10])


def test_the_twin_blocks_round_half_to_even_and_sum_in_the_kernels_order():
    x = torch.zeros(1, 32)
    x[0, 0] = 127.0  # amax: the step is 1
    x[0, 1], x[0, 2], x[0, 3] = 2.5, -3.5, 0.5
    xq, xd, xs = reference.q8_blocks(x)
    assert xq[0, 0, :4].tolist() == [127.0, 2.0, -4.0, 0.0]
    assert xd[0, 0].item() == 1.0
    assert xs[0, 0].item() == 127.0 + 2.5 - 3.5 + 0.5


def test_the_kernels_block_sums_are_the_twins_bits(level):
    """With d = 0 and m = 1 each output is the sum of the blocks' exact
    input sums: the kernel's order is the twin's, bit for bit."""
    k = 96
    parts = _parts(16, k)
    parts = type(parts)(torch.zeros_like(parts.q), torch.zeros_like(parts.scale), torch.full_like(parts.zero, 1.0))
    x = (torch.randn(5, k) * 100).to(torch.bfloat16)
    out = native.int4_q8_matmul(native_pack.pack_int4_q8(parts), x.float())
    _, _, xs = reference.q8_blocks(x)
    want = torch.zeros(5)
    for b in range(k // 32):
        want = want + xs[:, b]
    assert torch.equal(out[:, 0], want)


@pytest.mark.parametrize(
    ("qtype", "rows", "n", "k"),
    [
        *((Q.Q4_1, rows, n, k) for rows, n, k in ((1, 48, 32), (7, 80, 96), (33, 960, 576), (129, 64, 1536))),
        *((Q.Q4_0, rows, 80, 288) for rows in (1, 7, 33, 129)),
        *((Q.Q4_K, rows, 48, 512) for rows in (1, 7, 33, 129)),
    ],
    ids=lambda v: v.name.lower() if isinstance(v, Q) else None,
)
def test_every_level_gives_a_row_the_same_bits(qtype, rows, n, k, monkeypatch):
    """The AVX2 builds (with and without AVX-VNNI) and the native one (AVX-512
    VNNI here) compute a block's integer sum exactly and scale it by the
    same operations, so they agree bit for bit: a trace replays alike on
    an AVX2 laptop and an AVX-512 server. Odd row counts, a last group of
    one or two tiles, bf16 and fp32 inputs and outputs, each 4-bit type."""
    parts = _parts(n, k, qtype, seed=rows)
    pack = native_pack.pack_int4_q8(parts)
    x = _rows(rows, k, seed=rows)
    results = {}
    for level_ in LEVELS:
        if level_fits(level_) is None:
            monkeypatch.setenv(CPU_FEATURES_ENV, level_)
            if native.int4_q8_supported(16, 32):
                results[level_] = [native.int4_q8_matmul(pack, x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
    if len(results) < 2:
        pytest.skip(f"fewer than two kernel levels run here ({', '.join(results) or 'none'})")
    first, *others = results.values()
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 32, 2), (7, 96, 576), (33, 4096, 576), (129, 64, 34)])
def test_the_8bit_head_gives_a_row_the_same_bits_at_every_level(rows, n, k, monkeypatch):
    """`int8_matmul` (the quantized output head): the AVX2 build adds each
    lane's two products as AVX-512 BF16's `vdpbf16ps` does (odd input
    first, each addition rounded), so both give the same bits; each against
    float64 within fp32 summation of the bf16-rounded inputs."""
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) / 64
    pack = native_pack.pack_int8(q, scale)
    x = torch.randn(rows, k, generator=gen)
    want = x.to(torch.bfloat16).double() @ (q.double() * scale.double()[:, None]).T
    results = {}
    for level_ in LEVELS:
        if level_fits(level_) is None:
            monkeypatch.setenv(CPU_FEATURES_ENV, level_)
            if native.int8_supported(n, k):
                results[level_] = [native.int8_matmul(pack, x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
    if not results:
        pytest.skip("no 8-bit head kernel here (no AVX2 or AVX-512 BF16, or no C compiler)")
    bound = 1e-5 * (x.abs().double() @ (q.double().abs() * scale.double()[:, None]).T) + 1e-30
    for got in results.values():
        assert all(((g.double() - want).abs() <= bound).all() for g in got)
    first, *others = results.values()
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_the_pack_and_the_kernel_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="multiple of 16 outputs and 32 inputs, got 24 x 32"):
        native_pack.pack_int4_q8(_parts(24, 32))
    assert not native.int4_q8_supported(24, 32) and not native.int4_q8_supported(16, 48)
    if not native.int4_q8_supported(16, 32):
        return
    q8 = native_pack.pack_int4_q8(_parts(32, 64))
    bf16 = native_pack.pack_int4(_parts(32, 64))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="int4_matmul was given a weight packed for the other 4-bit kernel"):
        native.int4_matmul(q8, x)
    with pytest.raises(RuntimeError, match="int4_q8_matmul was given a weight packed for the other 4-bit kernel"):
        native.int4_q8_matmul(bf16, x)
    with pytest.raises(RuntimeError, match=r"int4_q8_matmul: x \(2, 32\) does not have the weight's 64 inputs"):
        native.int4_q8_matmul(q8, torch.randn(2, 32))


@pytest.mark.parametrize("use_native", [True, False], ids=["c", "twin"])
def test_projection_with_int8_activations_takes_the_kernel_or_its_twin(use_native):
    """Every row goes through the int8 path, generated tokens' (the
    leading ones) and prompt rows alike, in either mode, each row as it
    would alone; with bf16 activations prompt rows take the bf16 weights."""
    parts = _parts(64, 96)
    weight = parts.dequantize().to(torch.bfloat16)
    proj = Projection(weight, None, parts, use_native=use_native, activations="int8")
    plain = Projection(weight, None, parts, activations="bf16")
    x = _rows(9, 96).to(torch.bfloat16)
    out = proj.fixed(x, 4)
    assert torch.equal(proj(x, 4), out) and torch.equal(proj(x), out)
    twin = reference.int4_q8_matmul(*_twin_args(parts), x).to(torch.bfloat16)
    if use_native and native.int4_q8_supported(64, 96):
        assert proj.native is not None and proj.native.q8 and proj.q8_twin is None
        assert ((out.float() - twin.float()).abs() <= twin.float().abs() * 2**-7 + 1e-5).all()
        assert torch.equal(proj.fixed(x[6:7], 0), out[6:7])  # a prompt row alone: the same bits
    else:
        assert proj.native is None and proj.q8_twin is not None
        assert torch.equal(out, twin)
    bf16_prompt_rows = plain.fixed(x, 4)[4:]
    assert torch.equal(bf16_prompt_rows, tiled_linear(x[4:], weight, None, PROMPT_TILE))
    assert not torch.equal(out[4:], bf16_prompt_rows)
    with pytest.raises(ValueError, match="activations must be bf16 or int8, got 'int4'"):
        Projection(weight, None, parts, activations="int4")


def test_select_kernels_takes_int8_where_it_runs_and_refuses_it_elsewhere(monkeypatch):
    from trioserve.kernels.ops import select_kernels

    cpu = torch.device("cpu")
    # The default, auto: int8 where its C kernel runs, else bf16; never the twin, never on Triton.
    here = "int8" if native.int4_q8_supported(16, 32) else "bf16"
    assert select_kernels("auto", cpu, torch.bfloat16, 4, 2, 16).activations == here
    assert select_kernels("auto", cpu, torch.bfloat16, 4, 2, 16, "auto").activations == here
    assert select_kernels("auto", cpu, torch.float16, 4, 2, 16, "auto").activations == "bf16"  # no C kernels for float16
    assert select_kernels("reference", cpu, torch.float32, 4, 2, 16).activations == "bf16"
    assert select_kernels("auto", cpu, torch.bfloat16, 4, 2, 16, "bf16").activations == "bf16"
    assert select_kernels("reference", cpu, torch.float32, 4, 2, 16, "int8").activations == "int8"  # the twin, anywhere
    if native.int4_q8_supported(16, 32):
        assert select_kernels("auto", cpu, torch.float32, 4, 2, 16, "int8").activations == "int8"
    # A float16 model has no C kernels: int8 would mean the twin, far too slow to serve.
    with pytest.raises(ValueError, match="--activations int8 needs the C kernels, which run bfloat16 or float32 models on the CPU at every instruction-set level .*use --activations bf16"):
        select_kernels("auto", cpu, torch.float16, 4, 2, 16, "int8")
    with pytest.raises(ValueError, match="activations must be one of auto, bf16, int8, got 'fp8'"):
        select_kernels("auto", cpu, torch.float32, 4, 2, 16, "fp8")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="--activations int8 runs on a CPU .* the Triton kernels take bf16 activations"):
        select_kernels("triton", cpu, torch.float32, 4, 2, 16, "int8")
    assert select_kernels("triton", cpu, torch.float32, 4, 2, 16).activations == "bf16"
    assert select_kernels("triton", cpu, torch.float32, 4, 2, 16, "auto").activations == "bf16"  # auto on Triton: bf16


def test_the_settings_name_a_bad_value(tiny_checkpoints):
    from tests.test_cli import run_cli
    from trioserve.config import EngineConfig, activations_setting, settings_from_env

    assert activations_setting({}) == "auto" and EngineConfig().activations == "auto"
    assert settings_from_env({"TRIOSERVE_ACTIVATIONS": "bf16"}).engine.activations == "bf16"
    with pytest.raises(ValueError, match="TRIOSERVE_ACTIVATIONS: must be one of auto, bf16, int8, got 'int4'"):
        settings_from_env({"TRIOSERVE_ACTIVATIONS": "int4"})
    with pytest.raises(ValueError, match="activations"):
        EngineConfig(activations="int4")
    model = ["--model", str(tiny_checkpoints["gguf_q4_1"]), "--port", "0"]
    bad = run_cli("serve", *model, env={"TRIOSERVE_ACTIVATIONS": "int4"})
    assert bad.returncode == 2 and bad.stderr.splitlines() == ["trioserve: error: TRIOSERVE_ACTIVATIONS: must be one of auto, bf16, int8, got 'int4'"]
    # float16 has no C kernels: refused at start, the last line says why, exit 2.
    no_kernel = run_cli("serve", *model, "--dtype", "float16", "--activations", "int8")
    assert no_kernel.returncode == 2, no_kernel.stderr
    assert no_kernel.stderr.splitlines()[-1] == (
        "trioserve: error: --activations int8 needs the C kernels, which run bfloat16 or float32 models on the CPU at every instruction-set level "
        "(here: no C kernels for this cpu model); use --activations bf16"
    )
    flag = run_cli("serve", *model, "--activations", "int4")
    assert flag.returncode == 2 and "argument --activations: invalid choice: 'int4' (choose from 'auto', 'bf16', 'int8')" in flag.stderr


def test_the_cpu_features_setting_names_a_bad_or_unfit_level(tiny_checkpoints):
    from tests.test_cli import run_cli
    from trioserve.config import cpu_features_setting

    assert cpu_features_setting({}) == "native" and cpu_features_setting({CPU_FEATURES_ENV: "avx2"}) == "avx2"
    with pytest.raises(ValueError, match="TRIOSERVE_CPU_FEATURES: must be one of native, avx2-vnni, avx2, generic, got 'avx3'"):
        cpu_features_setting({CPU_FEATURES_ENV: "avx3"})
    # What a CPU without the level's instructions is told (flags given, not read).
    assert level_fits("avx2", frozenset({"sse2", "avx2"}), "x86_64") == "this CPU lacks f16c, fma"
    assert level_fits("avx2-vnni", frozenset({"avx2", "fma", "f16c"}), "x86_64") == "this CPU lacks avx_vnni"
    assert level_fits("avx2", frozenset(), "aarch64") == "avx2 is an x86-64 level and this CPU is aarch64"
    assert level_fits("generic", frozenset(), "aarch64") is None and level_fits("native", frozenset(), "x86_64") is None
    model = ["--model", str(tiny_checkpoints["gguf_q4_1"]), "--port", "0"]
    bad = run_cli("serve", *model, env={CPU_FEATURES_ENV: "avx3"})
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "trioserve: error: TRIOSERVE_CPU_FEATURES: must be one of native, avx2-vnni, avx2, generic, got 'avx3'"
    ]


async def _record(path, record_dir, activations: str) -> list[int]:
    from tests.core.test_replay import run
    from trioserve.config import EngineConfig
    from trioserve.engine import open_engine
    from trioserve.types import GenerateRequest, SamplingParams

    config = EngineConfig(model=str(path), dtype="bfloat16", kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=4,
                          prefill_budget=16, record_dir=str(record_dir), activations=activations)  # fmt: skip
    async with open_engine(config) as engine:
        prompt = engine.tokenizer.encode("The quick brown fox")
        with trio.fail_after(60):
            tokens, _, _ = await run(engine, GenerateRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    return tokens


@needs_vnni
def test_a_recorded_run_keeps_its_activations_and_replays_identically(tiny_checkpoints, tmp_path, capsys):
    """The trace's header says int8, and `trioserve replay --model` rebuilds
    the model with it: identical. (A trace from before the setting replays
    with bf16, what those runs had.)"""
    record_dir = tmp_path / "rec"
    assert len(trio.run(_record, tiny_checkpoints["gguf_q4_1"], record_dir, "int8")) == 12
    (trace,) = record_dir.iterdir()
    head = json.loads(trace.read_text().splitlines()[0])
    assert head["engine"]["activations"] == "int8"
    assert cli.main(["replay", str(trace), "--model"]) == 0
    out = capsys.readouterr().out
    assert "replay (model): identical" in out, out


def test_auto_is_int8_for_a_model_with_4bit_codes_where_the_kernel_runs_and_bf16_for_one_without(tiny_checkpoints, caplog):
    """The default: a 4-bit checkpoint's model takes int8 inputs where the
    C kernel runs; one without 4-bit codes has no rows that would, so its
    kernels (and any trace of it, /metrics, the sharing of generated K/V)
    say bf16, even when int8 was asked for, with a warning then."""
    from trioserve.models.checkpoint import load_checkpoint
    from trioserve.models.decoder import DecoderModel

    here = "int8" if native.int4_q8_supported(16, 32) else "bf16"
    q4 = DecoderModel.from_checkpoint(load_checkpoint(str(tiny_checkpoints["gguf_q4_1"]), dtype=torch.bfloat16))
    assert q4.kernels.activations == here
    dense = DecoderModel.from_checkpoint(load_checkpoint(str(tiny_checkpoints["hf"]), dtype=torch.bfloat16))
    assert dense.kernels.activations == "bf16"
    no_int4 = DecoderModel.from_checkpoint(load_checkpoint(str(tiny_checkpoints["gguf_q4_1"]), dtype=torch.bfloat16), use_int4=False)
    assert no_int4.kernels.activations == "bf16"
    assert not [r for r in caplog.records if "no 4-bit weights" in r.getMessage()]
    asked = DecoderModel.from_checkpoint(load_checkpoint(str(tiny_checkpoints["hf"]), dtype=torch.bfloat16), activations="int8")
    assert asked.kernels.activations == "bf16"
    assert [r.getMessage() for r in caplog.records if "no 4-bit weights" in r.getMessage()] == [
        "--activations int8: this model has no 4-bit weights to take 8-bit inputs; it runs bf16"
    ]
