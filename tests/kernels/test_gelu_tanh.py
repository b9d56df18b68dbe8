"""GeGLU's C kernel (`native.gelu_tanh_mul`, Gemma's MLP: gelu with the
tanh approximation, times up): the same bits at every level of the C
kernels this CPU runs (AVX-512's 16 lanes, AVX2's 8, plain C), and within
rounding of its torch twin (`Kernels.gelu_tanh_mul`: torch's gelu in fp32,
the reference and Triton sets')."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_attention_levels_bits import _libraries
from trioserve.kernels import native
from trioserve.kernels.ops import Kernels, NativeKernels


@pytest.fixture(scope="module")
def libs() -> dict:
    libs, why = _libraries()
    if "native" not in libs:
        pytest.skip(f"no C kernels here: {why}")
    return libs


def _rows(rows: int, f: int, seed: int) -> torch.Tensor:
    """[rows, 2f] fp32: gates over gelu's whole range (tiny, ordinary, past
    where tanh saturates, zeros of both signs), ups ordinary."""
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(rows, f, generator=gen) * torch.tensor([1e-30, 1e-3, 1.0, 3.0, 10.0, 1e4])[torch.randint(0, 6, (rows, f), generator=gen)]
    gate.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e38, -1e38])[: gate.numel()]
    return torch.cat([gate, torch.randn(rows, f, generator=gen)], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "f"), [(1, 16), (3, 17), (5, 40), (70, 128)])
def test_gelu_tanh_mul_is_the_same_bits_at_every_level(libs, dtype, rows, f):
    if len(libs) < 2:
        pytest.skip("one level runs here: nothing to compare")
    x = _rows(rows, f, seed=rows * 100 + f).to(dtype)
    outs = {level: native.gelu_tanh_mul(x, lib=lib) for level, lib in libs.items()}
    want = outs["native"]
    assert want.dtype == dtype and want.shape == (rows, f)
    differ = {level: float((out.float() - want.float()).abs().max()) for level, out in outs.items() if not torch.equal(out, want)}
    assert not differ, f"levels whose bits differ from native's: {differ}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_is_gelu_within_rounding(libs, dtype):
    """Against 0.5 x (1 + tanh(u)) in float64, written x sigmoid(2u) (the
    same function; the tanh form cancels for x below about -5 even in
    float64): within a few units of fp32 rounding of the value, plus 1e-7
    of |gate up| (where gelu is tiny, e^2u carries the fp32 rounding of
    2u, ~|2u| 2^-24, and underflows to 0 below e^-87); and against torch's
    fp32 twin, absolutely."""
    x = _rows(64, 48, seed=3).to(dtype)
    gate, up = x.double().chunk(2, dim=1)
    u = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    exact = gate * torch.sigmoid(2 * u) * up
    twin = Kernels().gelu_tanh_mul(x)
    rel = 2e-6 if dtype == torch.float32 else 2**-8  # bf16: one rounding of the result
    for level, lib in libs.items():
        got = native.gelu_tanh_mul(x, lib=lib).double()
        excess = (got - exact).abs() - (rel * exact.abs() + 1e-7 * (gate * up).abs())
        assert float(excess.max()) <= 0, (level, float(excess.max()))
        scale = float((gate * up).abs().max())
        torch.testing.assert_close(got, twin.double(), rtol=0, atol=(1e-6 if dtype == torch.float32 else 2**-8) * scale, msg=level)


def test_the_kernel_sets_compute_geglu(libs):
    x = _rows(7, 32, seed=4)
    c_set, torch_set = NativeKernels(attention_in_c=True), Kernels()
    assert torch.equal(c_set.gelu_tanh_mul(x), native.gelu_tanh_mul(x))
    gate, up = x.chunk(2, dim=1)
    assert torch.equal(torch_set.gelu_tanh_mul(x), F.gelu(gate, approximate="tanh") * up)
    torch.testing.assert_close(c_set.gelu_tanh_mul(x), torch_set.gelu_tanh_mul(x), rtol=0, atol=1e-6 * float((gate * up).abs().max()))
    bf = x.to(torch.bfloat16)
    assert torch_set.gelu_tanh_mul(bf).dtype == torch.bfloat16 == c_set.gelu_tanh_mul(bf).dtype
