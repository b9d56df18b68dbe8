"""Sliding-window attention in the C kernel (`native.decode_attention(...,
window=w)`, `trioserve_window_attention`): a row at position p (length
p + 1) reads keys p - w + 1 .. p only.

- It is the windowless kernel on those keys alone: the same bits as the
  kernel run over a pool holding just the window's keys (so the window
  changes which keys are read, never how a row is computed).
- The same bits at every level of the C kernels this CPU runs (the
  AVX-512 BF16 tiles, the AVX2 and plain C paths), for decode and prompt
  rows, every query and pool dtype, rows alone or in company.
- Within rounding of the torch twin under the windowed mask
  (`reference.window_mask`, which the reference and Triton kernel sets
  apply: `Kernels.attention(..., window=)`).
- The blocks before a row's window are neither read nor checked."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_attention_levels_bits import KINDS, SHAPES, _decode, _libraries, _prompt
from trioserve.kernels import native, reference
from trioserve.kernels.ops import Kernels, NativeKernels
from trioserve.models.step import SeqChunk, build_step

WINDOWS = (1, 5, 16, 40, 1000)


@pytest.fixture(scope="module")
def libs() -> dict:
    libs, why = _libraries()
    if "native" not in libs:
        pytest.skip(f"no C kernels here: {why}")
    return libs


def _case(rows: str, heads, kv_heads, dim, block_size, kind, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed + heads * 1000 + dim * 10 + block_size)
    make = _decode if rows == "decode" else _prompt
    return make(gen, heads, kv_heads, dim, block_size, *KINDS[kind])


def _compacted(case: dict, r: int, window: int) -> dict:
    """Row r alone over a fresh pool holding only its window's keys, from
    the first slot on: the windowless kernel's input for that row."""
    k, v = case["k_cache"], case["v_cache"]
    kv_heads, _, block_size, dim = k.shape
    length = int(case["lengths"][r])
    first = max(0, length - window)
    table = case["block_tables"][int(case["row_seq"][r]) if "row_seq" in case else r]
    positions = torch.arange(first, length)
    slots = table[positions // block_size] * block_size + positions % block_size
    blocks = -(-(length - first) // block_size)
    k_new, v_new = (torch.zeros(kv_heads, blocks, block_size, dim, dtype=k.dtype) for _ in range(2))
    for new, old in ((k_new, k), (v_new, v)):
        new.view(kv_heads, -1, dim)[:, : length - first] = old.view(kv_heads, -1, dim)[:, slots]
    tables = torch.arange(blocks, dtype=torch.int64)[None]
    return dict(q=case["q"][r : r + 1], k_cache=k_new, v_cache=v_new, block_tables=tables, lengths=torch.tensor([length - first]))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), SHAPES[:3])
@pytest.mark.parametrize("rows", ["decode", "prompt"])
def test_a_window_is_the_kernel_over_the_windows_keys_alone(libs, rows, heads, kv_heads, dim, block_size, kind):
    case = _case(rows, heads, kv_heads, dim, block_size, kind)
    for window in (5, 16, 40):
        for level, lib in libs.items():
            got = native.decode_attention(**case, scale=0.125, window=window, lib=lib)
            for r in range(0, len(case["lengths"]), 3):
                want = native.decode_attention(**_compacted(case, r, window), scale=0.125, lib=lib)
                assert torch.equal(got[r], want[0]), (level, window, r)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), SHAPES)
@pytest.mark.parametrize("rows", ["decode", "prompt"])
def test_windowed_attention_is_the_same_bits_at_every_level(libs, rows, heads, kv_heads, dim, block_size, kind):
    if len(libs) < 2:
        pytest.skip("one level runs here: nothing to compare")
    case = _case(rows, heads, kv_heads, dim, block_size, kind, seed=1)
    for window in WINDOWS:
        outs = {level: native.decode_attention(**case, scale=dim**-0.5, window=window, lib=lib) for level, lib in libs.items()}
        want = outs["native"]
        assert torch.isfinite(want).all()
        differ = {level: float((out - want).abs().max()) for level, out in outs.items() if not torch.equal(out, want)}
        assert not differ, f"window {window}: levels whose bits differ from native's: {differ}"


def test_a_window_past_the_length_changes_nothing(libs):
    for rows in ("decode", "prompt"):
        case = _case(rows, 9, 3, 64, 16, "bf16", seed=2)
        for lib in libs.values():
            whole = native.decode_attention(**case, scale=0.125, lib=lib)
            assert torch.equal(native.decode_attention(**case, scale=0.125, window=300, lib=lib), whole)
            assert torch.equal(native.decode_attention(**case, scale=0.125, window=10**9, lib=lib), whole)


@pytest.mark.parametrize("rows", ["decode", "prompt"])
def test_windowed_rows_alone_or_on_one_thread_are_the_same_bits(libs, rows):
    case = _case(rows, 9, 3, 64, 16, "bf16", seed=3)
    for level, lib in libs.items():
        together = native.decode_attention(**case, scale=0.125, window=20, lib=lib, threads=2)
        n = len(case["lengths"])
        for r in sorted({0, 3, min(17, n - 1), n - 1}):
            alone = dict(case, q=case["q"][r : r + 1], lengths=case["lengths"][r : r + 1])
            if rows == "decode":
                alone["block_tables"] = case["block_tables"][r : r + 1]
            else:
                alone["row_seq"] = case["row_seq"][r : r + 1]
            out = native.decode_attention(**alone, scale=0.125, window=20, lib=lib, threads=1)
            assert torch.equal(out[0], together[r]), (level, r)


def test_blocks_before_the_window_are_not_read(libs):
    """Table entries before each row's window hold block ids outside the
    pool: nothing refuses them, and the result is the same."""
    case = _case("decode", 4, 4, 64, 16, "f32", seed=4)
    window = 20
    bad = case["block_tables"].clone()
    for r, length in enumerate(case["lengths"].tolist()):
        bad[r, : max(0, length - window) // 16] = 10**6
    for lib in libs.values():
        want = native.decode_attention(**case, scale=0.125, window=window, lib=lib)
        assert torch.equal(native.decode_attention(**dict(case, block_tables=bad), scale=0.125, window=window, lib=lib), want)
        with pytest.raises(RuntimeError, match="outside the block tables or the pool"):
            native.decode_attention(**dict(case, block_tables=bad), scale=0.125, lib=lib)
    with pytest.raises(RuntimeError, match="a window of 0 keys"):
        native.decode_attention(**case, scale=0.125, window=0)


BLOCK = 4


def _pool_and_step(dtype, pool_dtype):
    """A step of decode rows and two prompt chunks over a random pool, K/V
    already written for every position the step's rows read."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim = 4, 2, 32
    chunks = [
        SeqChunk([1], 21, list(range(0, 6)), decode=True),
        SeqChunk([2], 9, list(range(6, 9)), decode=True),
        SeqChunk(list(range(10)), 14, list(range(9, 16))),
        SeqChunk(list(range(7)), 0, list(range(16, 18))),
    ]
    k = torch.randn(kv_heads, 20, BLOCK, dim, generator=gen).to(pool_dtype)
    v = torch.randn(kv_heads, 20, BLOCK, dim, generator=gen).to(pool_dtype)
    return build_step(chunks, BLOCK), k, v, torch.randn(sum(len(c.token_ids) for c in chunks), heads, dim, generator=gen).to(dtype)


@pytest.mark.parametrize(("dtype", "pool_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("window", [1, 3, 8, 100])
def test_the_kernel_sets_take_the_window_alike(libs, dtype, pool_dtype, window):
    """`Kernels.attention(..., window=)`: the C kernel (read in place) and the
    torch twin under `reference.window_mask` agree within rounding, group by
    group of a step of decode rows and prompt chunks."""
    step, k, v, q = _pool_and_step(dtype, pool_dtype)
    c_set, torch_set = NativeKernels(attention_in_c=True), Kernels()
    assert c_set.windows_in_place and not torch_set.windows_in_place
    size = max(g.block_tables.numel() for g in step.groups) * k.shape[0] * BLOCK * k.shape[-1]
    gather = (torch.empty(size, dtype=pool_dtype), torch.empty(size, dtype=pool_dtype))
    for g in step.groups:
        rows = q[g.first : g.first + g.count]
        got = c_set.attention(rows, k, v, g, 0.2, None, window=window)
        want = torch_set.attention(rows, k, v, g, 0.2, gather, window=window)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)
        # and the window is in force: without it both differ (every row here reads more than 1 key)
        if window == 1:
            whole = c_set.attention(rows, k, v, g, 0.2, None)
            assert not torch.allclose(whole.float(), got.float(), atol=tol)


def test_window_mask_keeps_the_last_keys_of_each_row():
    mask = torch.tensor([[[True, False, False, False], [True, True, False, False], [True, True, True, True], [False] * 4]])
    cut = reference.window_mask(mask, 2)
    assert cut.tolist() == [[[True, False, False, False], [True, True, False, False], [False, False, True, True], [False] * 4]]


def test_the_triton_set_takes_the_window_through_the_torch_twin():
    """The Triton attention kernel has no window: a windowed group goes to
    the torch twin under the windowed mask (with the gather buffers)."""
    pytest.importorskip("triton")
    from trioserve.kernels.ops import TritonKernels

    step, k, v, q = _pool_and_step(torch.float32, torch.float32)
    size = max(g.block_tables.numel() for g in step.groups) * k.shape[0] * BLOCK * k.shape[-1]
    gather = (torch.empty(size), torch.empty(size))
    triton_set, torch_set = TritonKernels(), Kernels()
    assert not triton_set.windows_in_place
    for g in step.groups:
        rows = q[g.first : g.first + g.count]
        assert torch.equal(triton_set.attention(rows, k, v, g, 0.2, gather, window=3), torch_set.attention(rows, k, v, g, 0.2, gather, window=3))
