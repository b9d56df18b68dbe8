"""Attention gives the same bits at every level of the C kernels this CPU
runs (issue 47), for every pair of query and pool dtypes the kernel takes:
bf16 queries over a bf16 pool (the default model on an AVX-512 BF16 CPU:
there the `tile_bf16_d64` path with vdpbf16ps, elsewhere its arithmetic
emulated, DAZ and FTZ included), float32 queries over a float32 pool (an
AVX2-only CPU's default) and float32 queries over a bf16 pool; decode rows
and prompt rows, ragged lengths, several head groupings. Each level's
build is compared with the native one (the widest this CPU has, whose
bits are the reference), and so is the 64-bit ARM build under qemu where
the cross tools are installed (test_neon.py's harness). Levels the CPU
lacks, or whose build does not load, are left out, and the tests skip
saying why when fewer than two remain.

The flush cases' expectations were checked against vdpbf16ps on an AMD
Zen 4 (EPYC); where another CPU's instruction flushed otherwise, its
native build would differ from the others here."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.kernels.test_neon import CC, QEMU, Jobs, arm  # noqa: F401 (arm: the ARM build's fixture)
from tests.kernels.test_neon import _attention as _neon_attention
from trioserve.kernels import native, native_build
from trioserve.kernels.cpu import level_fits

LEVELS = ("native", "avx2-vnni", "avx2", "generic")
# (query dtype, pool dtype)
KINDS = {
    "bf16": (torch.bfloat16, torch.bfloat16),
    "f32": (torch.float32, torch.float32),
    "f32q-bf16pool": (torch.float32, torch.bfloat16),
}
LENGTHS = (1, 15, 16, 17, 100, 300)
# Prompt chunks (start, tokens): rows attending to 1..17, 100 and 284..300 keys.
PROMPT = ((0, 17), (99, 1), (283, 17))
SHAPES = [(9, 3, 64, 16), (4, 4, 64, 16), (8, 2, 64, 32), (8, 2, 128, 16)]


@functools.lru_cache(maxsize=1)
def _libraries() -> tuple[dict, dict]:
    """The libraries of the levels that run here, and why the others do not."""
    libs, why = {}, {}
    for level in LEVELS:
        unfit = level_fits(level)
        if unfit:
            why[level] = unfit
            continue
        lib = native_build.library_at(level)
        if lib is None:
            why[level] = "its build does not load here (no C compiler, or TRIOSERVE_NATIVE_KERNELS=0)"
        else:
            libs[level] = lib
    return libs, why


@pytest.fixture(scope="module")
def libs() -> dict:
    libs, why = _libraries()
    if "native" not in libs or len(libs) < 2:
        pytest.skip(f"fewer than two levels run here, nothing to compare: {why}")
    return libs


def _pool(gen, kv_heads, needs, block_size, dim, dtype, values=None):
    """A pool with the blocks of sequences needing ``needs`` keys, taken in a
    scattered order: (k, v, tables [S, MB], blocks per sequence)."""
    counts = [-(-n // block_size) for n in needs]
    num_blocks = sum(counts) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(needs), max(counts), dtype=torch.int64)
    used = 0
    for s, nb in enumerate(counts):
        tables[s, :nb] = torch.tensor(order[used : used + nb])
        used += nb
    shape = (kv_heads, num_blocks, block_size, dim)
    make = values or (lambda shape: torch.randn(shape, generator=gen))
    return make(shape).to(dtype), make(shape).to(dtype), tables


def _decode(gen, heads, kv_heads, dim, block_size, q_dtype, pool_dtype):
    k, v, tables = _pool(gen, kv_heads, LENGTHS, block_size, dim, pool_dtype)
    q = torch.randn(len(LENGTHS), heads, dim, generator=gen).to(q_dtype)
    return dict(q=q, k_cache=k, v_cache=v, block_tables=tables, lengths=torch.tensor(LENGTHS))


def _prompt(gen, heads, kv_heads, dim, block_size, q_dtype, pool_dtype):
    k, v, tables = _pool(gen, kv_heads, [start + n for start, n in PROMPT], block_size, dim, pool_dtype)
    row_seq = torch.tensor([s for s, (_, n) in enumerate(PROMPT) for _ in range(n)])
    lengths = torch.tensor([start + t + 1 for start, n in PROMPT for t in range(n)])
    q = torch.randn(len(row_seq), heads, dim, generator=gen).to(q_dtype)
    return dict(q=q, k_cache=k, v_cache=v, block_tables=tables, lengths=lengths, row_seq=row_seq)


def _assert_same_bits(libs, case, scale, threads=None):
    outs = {level: native.decode_attention(**case, scale=scale, lib=lib, threads=threads) for level, lib in libs.items()}
    want = outs["native"]
    assert torch.isfinite(want).all()
    differ = {level: float((out - want).abs().max()) for level, out in outs.items() if not torch.equal(out, want)}
    assert not differ, f"levels whose bits differ from native's (largest difference): {differ}"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), SHAPES)
@pytest.mark.parametrize("rows", ["decode", "prompt"])
def test_attention_is_the_same_bits_at_every_level(libs, rows, heads, kv_heads, dim, block_size, kind):
    gen = torch.Generator().manual_seed(heads * 1000 + dim * 10 + block_size)
    make = _decode if rows == "decode" else _prompt
    case = make(gen, heads, kv_heads, dim, block_size, *KINDS[kind])
    _assert_same_bits(libs, case, dim**-0.5)


@pytest.mark.parametrize("rows", ["decode", "prompt"])
def test_rows_alone_or_on_one_thread_are_the_same_bits(libs, rows):
    """Each level's row is its own: computed alone, on one thread, it is the
    same bits as in company (and so the same bits as native's)."""
    gen = torch.Generator().manual_seed(7)
    make = _decode if rows == "decode" else _prompt
    case = make(gen, 9, 3, 64, 16, torch.bfloat16, torch.bfloat16)
    together = {level: native.decode_attention(**case, scale=0.125, lib=lib) for level, lib in libs.items()}
    for r in (0, 3, len(case["lengths"]) - 1):
        alone = dict(case, q=case["q"][r : r + 1], lengths=case["lengths"][r : r + 1])
        if rows == "decode":
            alone["block_tables"] = case["block_tables"][r : r + 1]
        else:
            alone["row_seq"] = case["row_seq"][r : r + 1]
        for level, lib in libs.items():
            out = native.decode_attention(**alone, scale=0.125, lib=lib, threads=1)
            assert torch.equal(out[0], together[level][r]), (level, r)


def _bf16_with(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """bf16 values of x's sign and 8 leading mantissa bits with the given
    biased exponents (0: denormals, or zeros where the mantissa is)."""
    bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0x807F
    return (bits | (exponent.to(torch.int32) << 7)).to(torch.int16).view(torch.bfloat16)


FLUSHES = ("all", "some-keys", "queries")


def _flush_case(where: str) -> tuple[dict, float]:
    """bf16 queries and pool with values vdpbf16ps flushes (or the plain C
    build's exact path takes): "all" tiny, so that products lie around
    2^-126 and a scale of 2^118 brings the scores to order one; "some-keys"
    with a denormal, tiny or zero value among ordinary ones; "queries" with
    a denormal, and a head of huge values (2^63 and up) over small keys."""
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed({"all": 1, "some-keys": 2, "queries": 3}[where])
    lengths = (1, 17, 40, 300)

    def tiny_values(*shape, low=58, high=72):
        x = torch.randn(*shape, generator=gen)
        exponent = torch.randint(low, high, shape, generator=gen)
        exponent[torch.rand(shape, generator=gen) < 0.03] = 0  # denormals (and a few zeros)
        return _bf16_with(x, exponent)

    def pool_values(shape):
        return tiny_values(*shape) if where == "all" else torch.randn(shape, generator=gen)

    k, v, tables = _pool(gen, kv_heads, lengths, bs, dim, torch.bfloat16, values=pool_values)
    q = tiny_values(len(lengths), heads, dim) if where == "all" else torch.randn(len(lengths), heads, dim, generator=gen).bfloat16()
    scale = 2.0**118 if where == "all" else 0.125
    if where == "some-keys":
        flat = k.view(-1, dim)
        picks = torch.randperm(flat.shape[0], generator=gen)[: flat.shape[0] // 5]
        for i, p in enumerate(picks.tolist()):
            flat[p, (7 * i) % dim] = (1e-40, 3e-20, -2e-30, 0.0, -0.0)[i % 5]
    if where == "queries":
        q[1, 0, 5] = 1e-38
        q[2, 4, :] = q[2, 4, :].float() * 2.0**70
        k[1] = k[1].float() * 2.0**-70
    return dict(q=q, k_cache=k, v_cache=v, block_tables=tables, lengths=torch.tensor(lengths)), scale


@pytest.mark.parametrize("where", FLUSHES)
def test_bf16_scores_flush_as_vdpbf16ps_does(libs, where):
    """vdpbf16ps reads denormal inputs as zeros and flushes tiny sums to zero
    (DAZ and FTZ, tininess after rounding); the other builds take an exact
    path for queries or keys holding such values (or, in plain C, huge
    ones), and give its bits."""
    case, scale = _flush_case(where)
    _assert_same_bits(libs, case, scale)
    _assert_same_bits(libs, case, scale, threads=1)


def _tininess_case() -> tuple[dict, float]:
    """One query head, one key whose score is 0 where its lane is flushed
    after rounding (see below), 2^-6 where not; a second key scoring 0."""
    dim = 64
    q = torch.zeros(1, 1, dim)
    k = torch.zeros(1, 1, 16, dim)
    v = torch.zeros(1, 1, 16, dim)
    q[0, 0, 1], k[0, 0, 0, 1] = 2.0**-63, 2.0**-63  # lane 0: first the odd pair's product, 2^-126
    q[0, 0, 0], k[0, 0, 0, 0] = -1.5 * 2.0**-75, 2.0**-76  # then the even pair's, -1.5 * 2^-151
    v[0, 0, 0] = 1.0  # key 1 scores 0, its value 0
    tables = torch.zeros(1, 1, dtype=torch.int64)
    return dict(q=q.bfloat16(), k_cache=k.bfloat16(), v_cache=v.bfloat16(), block_tables=tables, lengths=torch.tensor([2])), 2.0**120


def test_bf16_tininess_is_decided_after_rounding(libs):
    """A lane whose sum is 2^-126 - 1.5 * 2^-151 exactly: rounded to 24 bits
    it is 2^-126 - 2^-150, below the least normal, so vdpbf16ps flushes it to
    zero (x86 decides tininess after rounding), where fmaf would round it up
    to 2^-126. With a scale of 2^120 that score is 2^-6 or 0, and the two
    keys' weights tell which (0: half each, the output 0.5)."""
    case, scale = _tininess_case()
    _assert_same_bits(libs, case, scale)
    out = native.decode_attention(**case, scale=scale, lib=libs["native"])
    assert torch.equal(out, torch.full_like(out, 0.5)), "the score was not flushed as vdpbf16ps does"


@pytest.mark.skipif(CC is None or QEMU is None, reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu, qemu-user-static)")
def test_the_arm_build_gives_the_native_bits(libs, arm, tmp_path):
    """The 64-bit ARM build (plain C attention, run under qemu by
    test_neon.py's harness) gives this CPU's native bits too: each kind,
    decode and prompt rows, and the flushes."""
    cases = {}
    for kind, (q_dtype, pool_dtype) in KINDS.items():
        for rows, make in (("decode", _decode), ("prompt", _prompt)):
            cases[f"{kind} {rows}"] = make(torch.Generator().manual_seed(len(cases)), 9, 3, 64, 16, q_dtype, pool_dtype), 0.125
    cases.update({f"flush {where}": _flush_case(where) for where in FLUSHES}, tininess=_tininess_case())
    jobs, want = Jobs(), {}
    for name, (case, scale) in cases.items():
        want[_arm_attention(jobs, case, scale)] = (name, native.decode_attention(**case, scale=scale, lib=libs["native"]))
    done, _ = jobs.run(arm, tmp_path)
    for i, (kind, expected) in want.items():
        assert done[i].code == 0, kind
        got = done[i].tensor(-1, torch.float32, *expected.shape)
        assert torch.equal(got, expected), (kind, float((got - expected).abs().max()))


def _arm_attention(jobs, case, scale) -> int:
    return _neon_attention(jobs, case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["lengths"], scale,
                           row_seq=case.get("row_seq"))  # fmt: skip
