"""The C library's load-time packers (`native_pack.grouped_codes`) against the
numpy packers they stand in for: `pack_int4_q8` and `pack_int6_q8` give
the same bytes and scales with the library as without it, at every number
of tiles around a group (whole groups, a short last group, one tile) and
at several widths, and a weight packed either way computes the same
outputs. Without a C compiler both sides are numpy, and the tests say so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trioserve.config import NATIVE_KERNELS_ENV
from trioserve.kernels import native, native_build, native_pack
from trioserve.kernels.int4 import Int4Parts, Int4Rows, concat_rows, parts_from_gguf
from trioserve.kernels.projection import Projection
from trioserve.kernels.int6 import Int6Parts, Int6Rows, concat_rows6, pack_int6_q8, parts_from_gguf6
from trioserve.kernels import w16 as w16_module
from trioserve.kernels.int8w import Q8Rows, concat_rows8, pack_int8_q8, parts_from_q8_0
from trioserve.kernels.w16 import W16Rows, concat_rows16, pack_w16

needs_library = pytest.mark.skipif(native_build.library() is None, reason="the C kernels do not build here (no C compiler or not x86-64/ARM64)")
SHAPES = [(16 * tiles, k) for tiles in (1, 2, 3, 4, 5, 6, 7, 9) for k in (32, 96)] + [(960, 576), (48, 1536)]


def _both(pack, parts, monkeypatch):
    """``pack(parts)`` by the C packer, then by numpy (the library switched off)."""
    with_c = pack(parts)
    monkeypatch.setenv(NATIVE_KERNELS_ENV, "false")
    assert native_build.library() is None and native_pack.grouped_codes(np.zeros((16, 32), np.uint8), 4, 3) is None
    without = pack(parts)
    monkeypatch.delenv(NATIVE_KERNELS_ENV)
    return with_c, without


def _int4_parts(n: int, k: int, seed: int) -> Int4Parts:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    return Int4Parts(q, torch.rand(n, k // 32, generator=g) * 0.02, torch.rand(n, k // 32, generator=g) * 0.02 - 0.01)


def _int6_parts(n: int, k: int, seed: int, symmetric: bool) -> Int6Parts:
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 16, generator=g) * 0.02).half().float()
    m = -32 * d if symmetric else (torch.rand(n, k // 16, generator=g) * 0.02 - 0.01).half().float()
    return Int6Parts(u, d, m)


@needs_library
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_4_bit_packer_writes_numpys_bytes(n, k, monkeypatch):
    with_c, without = _both(native_pack.pack_int4_q8, _int4_parts(n, k, seed=n + k), monkeypatch)
    assert torch.equal(with_c.packed, without.packed) and torch.equal(with_c.scales, without.scales)
    assert (with_c.n, with_c.k, with_c.q8) == (without.n, without.k, without.q8) == (n, k, True)


@needs_library
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["d_and_m", "symmetric"])
def test_the_6_bit_packer_writes_numpys_bytes(n, k, symmetric, monkeypatch):
    with_c, without = _both(pack_int6_q8, _int6_parts(n, k, seed=n * k, symmetric=symmetric), monkeypatch)
    assert with_c.symmetric == without.symmetric == symmetric
    assert torch.equal(with_c.packed, without.packed) and torch.equal(with_c.scales, without.scales)


@needs_library
def test_every_byte_of_a_code_reaches_the_4_bit_layout(monkeypatch):
    # Codes with all 8 bits in use (not only 0..15) still pack alike: the
    # two packers truncate the high nibble's shift the same way.
    parts = Int4Parts(torch.arange(16 * 3 * 64, dtype=torch.int64).remainder(256).to(torch.uint8).view(48, 64), torch.ones(48, 2), torch.zeros(48, 2))
    with_c, without = _both(native_pack.pack_int4_q8, parts, monkeypatch)
    assert torch.equal(with_c.packed, without.packed)


@needs_library
def test_a_weight_packed_by_c_computes_what_the_numpy_one_does(monkeypatch):
    if not (native_build.library().trioserve_int4_q8_available() and native_build.library().trioserve_int6_q8_available()):
        pytest.skip("the int8-activation kernels need AVX2 or AVX-512 VNNI or NEON dot products")
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    c4, n4 = _both(native_pack.pack_int4_q8, _int4_parts(80, 96, seed=1), monkeypatch)
    assert torch.equal(native.int4_q8_matmul(c4, x), native.int4_q8_matmul(n4, x))
    c6, n6 = _both(pack_int6_q8, _int6_parts(80, 96, seed=2, symmetric=False), monkeypatch)
    assert torch.equal(native.int6_q8_matmul(c6, x), native.int6_q8_matmul(n6, x))


@needs_library
@pytest.mark.parametrize(("qtype", "block_bytes"), [("Q4_0", 18), ("Q4_1", 20), ("Q4_K", 144)])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_the_c_unpacker_reads_the_codes_numpy_reads(qtype, block_bytes, rows, monkeypatch):
    # Random bytes, scale fields included (parts_from_gguf does not look at
    # their finiteness): every nibble of every block must land where numpy puts it.
    raw = np.random.default_rng(rows).integers(0, 256, (rows, 2 * block_bytes * (256 // 32 if qtype != "Q4_K" else 1)), dtype=np.uint8)
    with np.errstate(all="ignore"):
        with_c, without = _both(lambda r: parts_from_gguf(r, qtype), raw, monkeypatch)
    assert torch.equal(with_c.q, without.q)
    for a, b in ((with_c.scale, without.scale), (with_c.zero, without.zero)):
        assert np.array_equal(a.numpy(), b.numpy(), equal_nan=True)


@needs_library
@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_the_c_unpacker_reads_the_6_bit_codes_numpy_reads(qtype, rows, monkeypatch):
    # Random blocks (every bit of the codes' bytes in use), some with a zero
    # scale (their codes become 0 either way): the codes, scales and
    # offsets must come out the same with the C library as with numpy.
    block_bytes, weights = {"Q6_K": (210, 256), "Q5_K": (176, 256), "Q5_0": (22, 32), "Q5_1": (24, 32)}[qtype]
    rng = np.random.default_rng(rows + block_bytes)
    raw = rng.integers(0, 256, (rows, 512 // weights, block_bytes), dtype=np.uint8)
    fields = (208,) if qtype == "Q6_K" else (0,) if qtype == "Q5_0" else (0, 2)  # f16 d (and dmin or m)
    for at in fields:
        raw[..., at : at + 2] = np.array([0.01], np.float16).view(np.uint8)
    raw[0, 0, fields[0] : fields[0] + 2] = 0  # the first block's d: its codes come out 0
    raw = raw.reshape(rows, -1)
    with np.errstate(all="ignore"):
        with_c, without = _both(lambda r: parts_from_gguf6(r, qtype), raw, monkeypatch)
    assert torch.equal(with_c.u, without.u) and int(with_c.u.max()) <= (63 if qtype == "Q6_K" else 31)
    assert int(with_c.u[0, :16].max()) == 0 and int(with_c.u.max()) > 0
    assert torch.equal(with_c.d, without.d) and torch.equal(with_c.m, without.m)


def _f16_fields(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` f16 values of every kind: normal ones across the range,
    subnormals, zeros of both signs, the largest, infinities and NaN."""
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504.0, -65504.0, np.inf, -np.inf, np.nan], dtype=np.float16)
    values = (rng.standard_normal(count) * 10.0 ** rng.integers(-7, 5, count)).astype(np.float16)
    pick = rng.random(count) < 0.2
    values[pick] = rng.choice(special, int(pick.sum()))
    return values


@needs_library
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_the_c_q4_k_scales_round_as_numpy_does(rows, monkeypatch):
    # Random Q4_K blocks whose d and dmin take every kind of f16 (tiny and
    # huge ones put the products' f16 rounding, subnormals and overflow to
    # the test): the group scales and zeros must be numpy's, bit for bit.
    rng = np.random.default_rng(rows)
    raw = rng.integers(0, 256, (rows, 3, 144), dtype=np.uint8)
    raw[..., 0:2] = _f16_fields(rng, rows * 3).view(np.uint8).reshape(rows, 3, 2)
    raw[..., 2:4] = _f16_fields(rng, rows * 3).view(np.uint8).reshape(rows, 3, 2)
    raw = raw.reshape(rows, -1)
    with np.errstate(all="ignore"):
        with_c, without = _both(lambda r: parts_from_gguf(r, "Q4_K"), raw, monkeypatch)
    for a, b in ((with_c.scale, without.scale), (with_c.zero, without.zero)):
        a, b = a.numpy(), b.numpy()
        assert np.array_equal(np.isnan(a), np.isnan(b))
        assert np.array_equal(a[~np.isnan(a)].view(np.uint32), b[~np.isnan(b)].view(np.uint32))
    assert torch.equal(with_c.q, without.q)


def _q4_tensor(qtype: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a Q4_0, Q4_1 or Q4_K tensor [rows, k] (every nibble
    in use), their f16 fields of every kind: [rows, row bytes] uint8."""
    bytes_, weights, fields = {"Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q4_K": (144, 256, (0, 2))}[qtype]
    raw = rng.integers(0, 256, (rows, k // weights, bytes_), dtype=np.uint8)
    for at in fields:
        raw[..., at : at + 2] = _f16_fields(rng, rows * (k // weights)).view(np.uint8).reshape(rows, k // weights, 2)
    return raw.reshape(rows, -1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16) if a.dtype == torch.uint16 else a, b.view(torch.int16) if b.dtype == torch.uint16 else b)


def _packed_three_ways(fused, pack, monkeypatch):
    """``pack`` of the weight ``fused()`` makes: from the blocks (the C
    packer), from its unpacked parts, and with the library off (numpy
    unpacking and packing); asserts the three give the same bytes and
    scale bits, and returns the first and the weight."""
    rows = fused()
    with np.errstate(all="ignore"):
        direct, unpacked = pack(rows), pack(rows.parts())
        monkeypatch.setenv(NATIVE_KERNELS_ENV, "false")
        assert native_build.library() is None
        fallback = pack(fused())
        monkeypatch.delenv(NATIVE_KERNELS_ENV)
    for other in (unpacked, fallback):
        assert torch.equal(direct.packed, other.packed)
        assert not hasattr(direct, "scales") or _same_bits(direct.scales, other.scales)
        assert getattr(direct, "symmetric", None) == getattr(other, "symmetric", None)
    return direct, rows


@needs_library
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("tiles", [1, 2, 3, 4, 7])
def test_4_bit_rows_are_laid_out_from_the_blocks_as_from_their_codes(qtype, tiles, monkeypatch):
    # A fused weight of two tensors, the first's rows out of order (as a Q
    # or K projection's are unpermuted): the C packer reading the file's
    # blocks through row pointers writes the bytes and f16 scales that
    # unpacking the codes and packing them writes, f16 fields of every
    # kind included (subnormal, huge, infinite, NaN), with the library and
    # without it (then `pack_int4_q8_rows` unpacks first).
    rng = np.random.default_rng(tiles)
    k = 512
    first, second = _q4_tensor(qtype, 16 * tiles - 8, k, rng), _q4_tensor(qtype, 8, k, rng)
    order = rng.permutation(first.shape[0])
    fused = lambda: concat_rows([Int4Rows.of(first, qtype).take_rows(order), Int4Rows.of(second, qtype)])  # noqa: E731
    pack = lambda w: native_pack.pack_int4_q8_rows(w) if isinstance(w, Int4Rows) else native_pack.pack_int4_q8(w)  # noqa: E731
    direct, rows = _packed_three_ways(fused, pack, monkeypatch)
    assert (direct.n, direct.k, direct.q8) == (16 * tiles, k, True)
    with np.errstate(all="ignore"):
        alone = parts_from_gguf(first, qtype), parts_from_gguf(second, qtype)
    # The parts themselves are the reordered rows of each tensor's own parts.
    assert torch.equal(rows.q[: len(order)], alone[0].q[torch.from_numpy(order)])
    assert torch.equal(rows.q[len(order) :], alone[1].q)


def test_4_bit_rows_say_what_they_cannot_hold():
    with pytest.raises(ValueError, match=r"each source must be \[rows, row bytes\] uint8, each row's bytes in one run"):
        Int4Rows.of(np.zeros((16, 36), np.uint8)[:, ::2], "Q4_0")
    with pytest.raises(ValueError, match="each source must be"):
        Int4Rows.of(np.zeros((16, 9), np.uint16), "Q4_0")
    with pytest.raises(ValueError, match="Int4Rows holds Q4_0, Q4_1, Q4_K blocks, not Q8_0"):
        Int4Rows.of(np.zeros((16, 34), np.uint8), "Q8_0")
    with pytest.raises(ValueError, match=r"Int4Rows.concat: parts of different widths \[32, 64\]"):
        concat_rows([Int4Rows.of(np.zeros((16, 18), np.uint8), "Q4_0"), Int4Rows.of(np.zeros((16, 36), np.uint8), "Q4_0")])
    with pytest.raises(ValueError, match=r"sources of different widths \[32, 64\]"):
        Int4Rows((np.zeros((16, 18), np.uint8), np.zeros((16, 36), np.uint8)), "Q4_0", np.zeros((1, 2), np.int64))


def test_a_projection_lets_the_files_pages_go_once_its_rows_are_packed():
    # Int4Rows hold views of the mapped file: the projection made of them
    # calls their release (the loader's madvise) once, after packing, and
    # computes what the unpacked parts give.
    rng = np.random.default_rng(5)
    raw = _q4_tensor("Q4_1", 32, 256, rng).reshape(32, 8, 20)
    raw[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)  # finite scales: a weight that computes
    raw[..., 2:4] = np.array([-0.05], np.float16).view(np.uint8)
    raw = raw.reshape(32, -1)
    released = []
    rows = Int4Rows.of(raw, "Q4_1", lambda: released.append(1))
    dense = rows.dequantize()
    proj = Projection(dense, None, rows, activations="int8")
    assert released == [1]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    again = Projection(dense, None, parts_from_gguf(raw, "Q4_1"), activations="int8")
    assert torch.equal(proj(x), again(x))


def _q6_tensor(qtype: str, rows: int, k: int, rng: np.random.Generator, symmetric_scales: bool = False) -> np.ndarray:
    """Random blocks of a Q6_K, Q5_K, Q5_0 or Q5_1 tensor [rows, k] (every
    code bit in use), f16 fields of every kind and some groups with a zero
    scale: [rows, row bytes] uint8."""
    bytes_, weights = {"Q6_K": (210, 256), "Q5_K": (176, 256), "Q5_0": (22, 32), "Q5_1": (24, 32)}[qtype]
    fields = (208,) if qtype == "Q6_K" else (0,) if qtype == "Q5_0" else (0, 2)
    raw = rng.integers(0, 256, (rows, k // weights, bytes_), dtype=np.uint8)
    for at in fields:
        raw[..., at : at + 2] = _f16_fields(rng, rows * (k // weights)).view(np.uint8).reshape(rows, k // weights, 2)
    if qtype == "Q6_K":
        raw[0, 0, 192] = 0  # one group's int8 scale 0: its codes come out 0
    else:
        raw[0, 0, fields[0] : fields[0] + 2] = 0  # the first block's d 0
    return raw.reshape(rows, -1)


@needs_library
@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("tiles", [1, 2, 3, 4, 7])
def test_6_bit_rows_are_laid_out_from_the_blocks_as_from_their_codes(qtype, tiles, monkeypatch):
    # As for the 4-bit rows: a fused weight of two tensors, the first's rows
    # reordered, packed by the C library from the blocks, equals unpacking
    # then packing (with the library, and by numpy alone), symmetric or not
    # as numpy finds it (Q6_K: m = -32 d wherever both round alike).
    rng = np.random.default_rng(tiles + len(qtype))
    k = 512
    first, second = _q6_tensor(qtype, 16 * tiles - 8, k, rng), _q6_tensor(qtype, 8, k, rng)
    order = rng.permutation(first.shape[0])
    fused = lambda: concat_rows6([Int6Rows.of(first, qtype).take_rows(order), Int6Rows.of(second, qtype)])  # noqa: E731
    _, rows = _packed_three_ways(fused, pack_int6_q8, monkeypatch)
    with np.errstate(all="ignore"):
        assert torch.equal(rows.u[: len(order)], parts_from_gguf6(first, qtype).u[torch.from_numpy(order)])


@needs_library
def test_a_q6_k_weight_from_its_blocks_keeps_d_alone():
    # Finite Q6_K scales: m = -32 d in every group, so the layout keeps d
    # alone, from the blocks as from the codes; asking for it where a group
    # breaks the rule (Q5_1's own m) is refused with the reason.
    rng = np.random.default_rng(9)
    raw = _q6_tensor("Q6_K", 32, 512, rng).reshape(32, 2, 210)
    raw[..., 208:210] = np.array([0.002], np.float16).view(np.uint8)
    rows = Int6Rows.of(raw.reshape(32, -1), "Q6_K")
    assert pack_int6_q8(rows).symmetric and pack_int6_q8(rows.parts()).symmetric
    q51 = _q6_tensor("Q5_1", 32, 512, rng).reshape(32, 16, 24)
    q51[..., 0:4] = np.array([0.01, 0.5], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="a symmetric 6-bit pack needs m = -32 d in every group"):
        pack_int6_q8(Int6Rows.of(q51.reshape(32, -1), "Q5_1"), symmetric=True)


@needs_library
@pytest.mark.parametrize("tiles", [1, 2, 3, 4, 7])
def test_q8_0_rows_are_laid_out_from_the_blocks_as_from_their_codes(tiles, monkeypatch):
    # Q8_0 as the 4- and 6-bit rows: a fused weight of two tensors, the
    # first's rows reordered, packed from the blocks by the C library,
    # equals the codes' packing with it and without it (the file's f16
    # scale bits kept as they are, finite or not).
    rng = np.random.default_rng(tiles)
    k = 256
    tensors = []
    for rows_ in (16 * tiles - 8, 8):
        raw = rng.integers(0, 256, (rows_, k // 32, 34), dtype=np.uint8)
        raw[..., 0:2] = _f16_fields(rng, rows_ * (k // 32)).view(np.uint8).reshape(rows_, k // 32, 2)
        tensors.append(raw.reshape(rows_, -1))
    order = rng.permutation(tensors[0].shape[0])
    fused = lambda: concat_rows8([Q8Rows.of(tensors[0], "Q8_0").take_rows(order), Q8Rows.of(tensors[1], "Q8_0")])  # noqa: E731
    direct, rows = _packed_three_ways(fused, pack_int8_q8, monkeypatch)
    assert (direct.n, direct.k) == (16 * tiles, k)
    assert torch.equal(rows.c[: len(order)], parts_from_q8_0(tensors[0]).c[torch.from_numpy(order)])


@needs_library
@pytest.mark.parametrize("qtype", ["F16", "BF16"])
@pytest.mark.parametrize("rows_", [5, 16, 40])
def test_16_bit_rows_are_laid_out_from_the_file_as_from_their_bits(qtype, rows_, monkeypatch):
    # F16/BF16 rows: a fused weight of two tensors, the first's rows
    # reordered, a last tile short of 16 rows (zeros past n), K not a
    # multiple of the packer's run of 64: the C packer reading the file's
    # rows equals packing the bits, with the library and without.
    rng = np.random.default_rng(rows_)
    k = 200
    def finite(r: int) -> np.ndarray:  # random finite values of the type, as the file's bytes
        values = rng.standard_normal((r, k)).astype(np.float32)
        bits = values.astype(np.float16).view(np.uint16) if qtype == "F16" else (values.view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8)

    first, second = finite(rows_), finite(3)
    order = rng.permutation(rows_)
    fused = lambda: concat_rows16([W16Rows.of(first, qtype).take_rows(order), W16Rows.of(second, qtype)])  # noqa: E731
    direct, rows = _packed_three_ways(fused, pack_w16, monkeypatch)
    assert (direct.n, direct.k, direct.bf16) == (rows_ + 3, k, qtype == "BF16")
    assert torch.equal(rows.bits[:rows_], torch.from_numpy(first.view(np.int16))[torch.from_numpy(order)])


def test_16_bit_values_are_checked_finite_a_slice_at_a_time(monkeypatch):
    # The load-time check reads the mapped file a slice of rows at a time
    # (no copy of the whole) and still finds one NaN in the last slice.
    monkeypatch.setattr(w16_module, "ROWS_AT_ONCE", 64)
    bits = np.full((40, 32), np.float16(0.5)).view(np.int16)
    w16_module.check_finite16(bits, "F16")
    bits = bits.copy()
    bits[39, 31] = np.array([np.nan], np.float16).view(np.int16)[0]
    with pytest.raises(ValueError, match="contains NaN or infinity"):
        w16_module.check_finite16(bits, "F16")
    with pytest.raises(ValueError, match="cannot stack F16 and BF16 rows into one weight"):
        concat_rows16([W16Rows.of(np.zeros((2, 64), np.uint8), "F16"), W16Rows.of(np.zeros((2, 64), np.uint8), "BF16")])


def test_rows_of_different_types_are_unpacked_and_their_pages_let_go():
    # A fused weight whose parts differ in type (a Q5_K_M file's Q5_K q and
    # k beside a Q6_K v) cannot be packed from the blocks in one pass: it is
    # unpacked, and each part's file pages are let go right then.
    rng = np.random.default_rng(11)
    released = []
    a = Int6Rows.of(_q6_tensor("Q5_K", 16, 256, rng), "Q5_K", lambda: released.append("q5_k"))
    b = Int6Rows.of(_q6_tensor("Q6_K", 16, 256, rng), "Q6_K", lambda: released.append("q6_k"))
    with np.errstate(all="ignore"):
        both = concat_rows6([a, b])
        assert isinstance(both, Int6Parts) and both.shape == (32, 256)
        assert torch.equal(both.u[:16], a.parts().u) and torch.equal(both.u[16:], b.parts().u)
    assert released == ["q5_k", "q6_k"]


def test_a_kind_of_block_rows_must_say_how_it_unpacks():
    from trioserve.kernels.layout import BlockRows

    with pytest.raises(TypeError, match="Half must set _unpack, _cat"):
        type("Half", (BlockRows,), {"TYPES": {"Q4_0": (18, 32)}})
