"""The weight-only quantized matmul (kernels/gpu/quant_matmul.py) against
float64 products of the weights as the gguf package dequantizes them.

Weights are random GGUF Q4_1 and Q8_0 blocks made by gguf.quants.quantize,
and Q4_0/Q4_1 through Int4Parts (the loader's path). Without a GPU the
kernel runs under Triton's interpreter (tests/conftest.py), so shapes stay
tiny: K = 160 and 576 (the real model's hidden size; multiples of 32, not
powers of two) and N = 40 and 96 (N = 40 leaves a masked tail in an N
block); the real model's N = 1536 only adds blocks.

Tolerances are relative to sum_k |x_k w_k| of each output, so cancellation
cannot hide an error: float32, and float16/bfloat16 activations in the
default reduction (widened exactly to float32): 1e-5. float16 through
tl.dot (dot=True), where the weights are rounded to float16 (2^-11 each):
1e-3. bfloat16 activations are only read and widened, which the
interpreter does exactly (its bfloat16 arithmetic is what is wrong)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from trioserve.kernels.gpu import quant_matmul as qm
from trioserve.kernels.int4 import parts_from_gguf

Q = gguf.GGMLQuantizationType
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {
    (torch.float32, False): 1e-5,
    (torch.float16, False): 1e-5,
    (torch.bfloat16, False): 1e-5,
    (torch.float32, True): 1e-5,
    (torch.float16, True): 1e-3,
}


def _weights(kind: str, n: int, k: int, seed: int) -> tuple[qm.Q4Weight | qm.Q8Weight, torch.Tensor]:
    """A packed weight and its float32 dequantization by the gguf package
    (for Int4Parts, by that record's own formula)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.3 + rng.standard_normal((n, 1)) * 0.1).astype(np.float32)
    if kind in ("q4_1", "q8_0"):
        qtype = Q.Q4_1 if kind == "q4_1" else Q.Q8_0
        raw = gguf.quants.quantize(w, qtype)
        expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).copy())
        packed = qm.pack_q4_1(raw, n, k) if kind == "q4_1" else qm.pack_q8_0(raw, n, k)
        return packed, expected
    qtype = {"parts_q4_0": Q.Q4_0, "parts_q4_1": Q.Q4_1}[kind]
    parts = parts_from_gguf(gguf.quants.quantize(w, qtype), qtype.name)
    return qm.pack_int4_parts(parts), parts.dequantize()


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[0, :3] = torch.tensor([40.0, -25.0, 1e-3])  # a few outsized activations
    return x


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "parts_q4_0", "parts_q4_1"])
def test_packed_weights_dequantize_as_the_file_does(kind):
    packed, expected = _weights(kind, 40, 160, seed=1)
    assert packed.shape == (40, 160)
    assert torch.equal(packed.dequantize(), expected)


@pytest.mark.parametrize(
    ("dtype", "dot"),
    [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False), (torch.float32, True), (torch.float16, True)],
    ids=["fp32", "fp16", "bf16", "fp32-dot", "fp16-dot"],
)
@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize(("kind", "n", "k"), [("q4_1", 96, 160), ("q8_0", 40, 160), ("parts_q4_0", 40, 576)])
def test_matmul_matches_float64(kind, n, k, rows, dtype, dot):
    packed, w = _weights(kind, n, k, seed=n + k)
    x = _x(rows, k, seed=rows).to(dtype)
    y = qm.matmul(packed.to(DEVICE), x.to(DEVICE), dot=dot).cpu()
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    x64, w64 = x.double(), w.double()
    expected = x64 @ w64.T
    scale = x64.abs() @ w64.abs().T
    error = (y.double() - expected).abs()
    assert (error <= TOLERANCE[dtype, dot] * scale).all(), float((error / scale).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_row_gets_the_same_bits_alone_and_in_company(kind, dtype):
    """The reduction over K runs in the same order whatever M is and
    wherever a row sits among the others (the default path)."""
    packed, _ = _weights(kind, 40, 160, seed=5)
    packed = packed.to(DEVICE)
    x = _x(33, 160, seed=6).to(dtype).to(DEVICE)
    together = qm.matmul(packed, x)
    for i in (0, 1, 7, 15, 16, 31, 32):  # every place in a 16-row block, and the lone last one
        assert torch.equal(qm.matmul(packed, x[i : i + 1]), together[i : i + 1]), i
    assert torch.equal(qm.matmul(packed, x[5:8]), together[5:8])


def test_strided_activations_and_no_rows():
    packed, _ = _weights("q4_1", 40, 160, seed=7)
    packed = packed.to(DEVICE)
    x = _x(3, 160, seed=8).to(DEVICE)
    columns = x.t().contiguous().t()  # the same values, column-major
    assert columns.stride() != x.stride()
    assert torch.equal(qm.matmul(packed, columns), qm.matmul(packed, x))
    assert qm.matmul(packed, x[:0]).shape == (0, 40)


def test_launch_blocks_do_not_depend_on_rows():
    assert qm.launch_blocks(1536, 576) == qm.launch_blocks(1536, 576, dot=False)
    assert qm.launch_blocks(1536, 576, dot=True)[2] == 64  # 576 = 9 * 64
    assert qm.launch_blocks(96, 160, dot=True)[2] == 32


def test_bad_inputs_are_refused():
    rng = np.random.default_rng(9)
    raw = gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), Q.Q4_1)
    with pytest.raises(ValueError, match="bytes"):
        qm.pack_q4_1(raw, 8, 96)
    with pytest.raises(ValueError, match="multiple of 32"):
        qm.pack_q8_0(raw, 8, 48)
    packed = qm.pack_q4_1(raw, 8, 64).to(DEVICE)
    with pytest.raises(RuntimeError, match="takes x"):
        qm.matmul(packed, torch.zeros(2, 96, device=DEVICE))
    with pytest.raises(RuntimeError, match="takes x"):
        qm.matmul(packed, torch.zeros(2, 64, dtype=torch.float64, device=DEVICE))
