"""The Triton elementwise kernels (kernels/gpu/elementwise.py) against
independent torch math: kernels/reference.py's rms_norm, apply_rope and
write_kv, and the plain torch expressions of the residual add and of
silu(gate) * up.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which is exact for float32 and float16 but rounds
bfloat16 stores by truncation, so the outputs are checked in float32 and
float16 only (a bfloat16 residual is read, which the interpreter widens
exactly). Shapes stay tiny: interpreted, a program costs milliseconds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trioserve.kernels import reference
from trioserve.kernels.gpu import elementwise

DTYPES = [torch.float32, torch.float16]
IDS = ["fp32", "fp16"]
# fp32: a sum of squares in another order and a few roundings. fp16: the
# kernel and the twin each round once from fp32 values a few fp32 units
# apart, so they may land one fp16 unit (2^-10 relative) apart.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(gen: torch.Generator, rows: int, n: int) -> torch.Tensor:
    x = torch.randn(rows, n, generator=gen) * 30
    x[0, 0] = 2.5e4  # an "attention sink" sized value
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("rows", "n"), [(1, 576), (3, 48), (33, 100), (7, 17)])
def test_rms_norm_matches_the_torch_twin(dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    x = _rows(gen, rows, n)
    weight = torch.rand(n, generator=gen) + 0.5
    before = x.clone()
    got = elementwise.rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-5, dtype).cpu()
    assert got.dtype == dtype and got.shape == (rows, n)
    assert torch.equal(x, before)
    want = reference.rms_norm(x, weight, 1e-5).to(dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("delta_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["d32", "d16", "dbf16"])
@pytest.mark.parametrize(("rows", "n"), [(1, 576), (3, 48), (33, 17)])
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype, delta_dtype, rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    h0 = _rows(gen, rows, n)
    delta = (torch.randn(rows, n, generator=gen) * 4).to(delta_dtype)
    weight = torch.rand(n, generator=gen) + 0.5
    summed = h0 + delta  # torch widens delta to fp32; h must end as this sum, bit for bit
    h = h0.to(DEVICE, copy=True)
    out = elementwise.add_rms_norm(h, delta.to(DEVICE), weight.to(DEVICE), 1e-5, dtype).cpu()
    assert torch.equal(h.cpu(), summed)
    assert out.dtype == dtype and out.shape == (rows, n)
    want = reference.rms_norm(summed, weight, 1e-5).to(dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("rows", "f"), [(1, 1536), (3, 21), (33, 48)])
def test_silu_mul_matches_the_torch_expression(dtype, rows, f):
    gen = torch.Generator().manual_seed(rows * f)
    gate_up = (torch.randn(rows, 2 * f, generator=gen) * 6).to(dtype)
    gate_up[0, 0], gate_up[0, 1] = -90.0, 90.0  # e^90 overflows fp32: the kernel must not take it
    got = elementwise.silu_mul(gate_up.to(DEVICE)).cpu()
    assert got.dtype == dtype and got.shape == (rows, f)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).to(dtype)  # in fp32, rounded once, as the kernel
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _rope_case(gen, *, rows, real, heads, kv_heads, dim, block_size, dtype, max_pos=200, num_blocks=5):
    """Packed qkv rows, positions, rotary tables, two random caches and
    ``real`` slots scattered across the blocks (rows past them are padding)."""
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (rows,), generator=gen)
    positions[0] = max_pos - 1  # the tables' last row
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:real]
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), torch.rand(dim // 2, generator=gen, dtype=torch.float64))
    cos, sin = angles.cos().float(), angles.sin().float()
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype) for _ in range(2))
    return qkv, positions, cos, sin, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize(("dim", "block_size"), [(64, 16), (128, 32)])
@pytest.mark.parametrize(("rows", "real"), [(1, 1), (3, 2), (33, 29)])
def test_rope_and_kv_write_are_bit_identical_to_the_torch_twin(dtype, heads, kv_heads, dim, block_size, rows, real):
    """Both rotations round each product and then the sum, as the twin
    does, and V is copied: in fp32 and fp16 alike every bit agrees. Pad
    rows store nothing, so the cache holds its old values off the slots."""
    gen = torch.Generator().manual_seed(rows * 1000 + heads * 10 + dim)
    qkv, positions, cos, sin, k_cache, v_cache, slots = _rope_case(
        gen, rows=rows, real=real, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, dtype=dtype
    )
    q_ref = qkv[:, : heads * dim].view(rows, heads, dim)
    k_ref = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v_ref = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    c, s = cos.index_select(0, positions), sin.index_select(0, positions)
    want_q = reference.apply_rope(q_ref, c, s)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(want_k, want_v, slots, reference.apply_rope(k_ref, c, s)[:real].contiguous(), v_ref[:real].contiguous())

    got_k, got_v = k_cache.to(DEVICE, copy=True), v_cache.to(DEVICE, copy=True)
    args = (qkv, positions, cos, sin)
    q = elementwise.rope_write_kv(*(t.to(DEVICE) for t in args), got_k, got_v, slots.to(DEVICE), heads, kv_heads)
    assert q.dtype == dtype and q.shape == (rows, heads, dim)
    assert torch.equal(q.cpu(), want_q)
    got_k, got_v = got_k.cpu(), got_v.cpu()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # Off the written slots (pad rows' included) the cache is as it was.
    untouched = torch.ones(k_cache.shape[1] * block_size, dtype=torch.bool)
    untouched[slots] = False
    flat = (kv_heads, -1, dim)
    assert torch.equal(got_k.view(flat)[:, untouched], k_cache.view(flat)[:, untouched])
    assert torch.equal(got_v.view(flat)[:, untouched], v_cache.view(flat)[:, untouched])
    assert not torch.equal(got_k.view(flat)[:, slots], k_cache.view(flat)[:, slots])


def test_out_of_range_positions_and_slots_are_refused_before_any_write():
    gen = torch.Generator().manual_seed(5)
    max_pos, num_blocks, block_size = 50, 3, 16
    qkv, positions, cos, sin, k_cache, v_cache, slots = _rope_case(
        gen, rows=4, real=3, heads=4, kv_heads=2, dim=64, block_size=block_size, dtype=torch.float32,
        max_pos=max_pos, num_blocks=num_blocks,
    )  # fmt: skip
    k0, v0 = k_cache.clone(), v_cache.clone()

    def call(pos, sl, heads=4):
        return elementwise.rope_write_kv(qkv, pos, cos, sin, k_cache, v_cache, sl, heads, 2)

    for bad in (max_pos, -1):
        pos = positions.clone()
        pos[3] = bad  # a pad row's position is read too
        with pytest.raises(RuntimeError, match="position is out of range"):
            call(pos, slots)
    for bad in (num_blocks * block_size, -1):
        sl = slots.clone()
        sl[1] = bad
        with pytest.raises(RuntimeError, match="slot is out of range"):
            call(positions, sl)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)
    with pytest.raises(RuntimeError, match="does not hold"):
        call(positions, slots, heads=5)
    with pytest.raises(RuntimeError, match="at most 4 slots"):
        call(positions, torch.arange(5))
    with pytest.raises(RuntimeError, match="caches of qkv's dtype"):
        elementwise.rope_write_kv(qkv.half(), positions, cos, sin, k_cache, v_cache, slots, 4, 2)


def test_the_norms_and_silu_mul_refuse_what_they_do_not_take():
    x, w = torch.randn(2, 16), torch.ones(16)
    with pytest.raises(RuntimeError, match="fp32 rows"):
        elementwise.rms_norm(x.half(), w, 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="fp32 rows"):
        elementwise.rms_norm(x, torch.ones(15), 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="casts to float32"):
        elementwise.rms_norm(x, w, 1e-5, torch.int8)
    with pytest.raises(RuntimeError, match="a delta of their shape"):
        elementwise.add_rms_norm(x, torch.randn(2, 15), w, 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="contiguous fp32 rows"):
        elementwise.add_rms_norm(torch.randn(16, 2).t(), x, w, 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match=r"silu_mul takes float rows \[T, 2F\]"):
        elementwise.silu_mul(torch.randn(2, 3))
