"""The sampler's arithmetic with every summation order fixed, so that a row's
log-probabilities and sampling weights are the same bits on every CPU:
AVX-512, AVX2, ARM and plain C builds of the kernels (csrc/sampler.c), and
the numpy twins here, which run where the kernels do not (no compiler,
``TRIOSERVE_NATIVE_KERNELS=0``). docs/determinism.md, "Across CPU classes".

torch's own reductions (``sum``, ``log_softmax``) are vectorized at the
width of the CPU's vectors, so their order of additions, and so the last
bits, follow the CPU: a trace recorded on an AVX2 machine replayed with
other top logprobs on an AVX-512 one. Here:

- exp is fixed_exp.h's (a polynomial in unfused basic operations), twinned
  by `exp_nonpositive` in numpy;
- a sum of a row is taken in float64 over blocks of `BLOCK` entries: in a
  block, entry i goes to lane i mod 16 and each lane is summed in order,
  the 16 lanes by a fixed tree (i + 8, then + 4, + 2, + 1), then the
  block's last entries (fewer than 16) in order; the blocks in order;
- a log is `log_fixed`, from basic float64 operations, never libm's;
- maxima are exact in any order.

IEEE basic operations (+, -, *, / and conversions) round alike on every
CPU, vector or scalar, so this is enough for identical bits. `Numerics`
gathers the operations the sampler needs; `TORCH` keeps the torch
arithmetic of before, which replays of traces recorded before this module
need (core/replay.py)."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from trioserve.kernels import native_build

BLOCK = 256  # the sampler's block of tokens (its draw finds the block first)
LANES = 16

_F = np.float32
_LOG2E, _HALF = _F(1.44269504088896341), _F(0.5)
_LN2_A, _LN2_B = _F(0.693145751953125), _F(1.428606765330187045e-06)
# The polynomial's coefficients as C folds them: float divisions.
_COEF = [_F(1.0) / _F(720.0), _F(1.0) / _F(120.0), _F(1.0) / _F(24.0), _F(1.0) / _F(6.0), _F(0.5), _F(1.0), _F(1.0)]
_FLOOR = _F(-87.0)

_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_SQRT_HALF = 0.70710678118654752440
_ATANH = [1.0 / (2 * j + 1) for j in range(12, -1, -1)]  # 1/25, 1/23, ..., 1/3, 1


def log_fixed(s: float) -> float:
    """log(s) from basic float64 operations in a fixed order (correct to
    ~1 ulp): s = f 2^k with f in [sqrt(1/2), sqrt(2)), and log f =
    2 atanh((f - 1) / (f + 1)) by its series. Python floats round as C's
    doubles do, so this is the same number everywhere."""
    if not s > 0.0 or math.isinf(s):  # 0: -inf; inf: inf; negative or NaN: NaN
        return -math.inf if s == 0.0 else s if s == math.inf else math.nan
    f, k = math.frexp(s)
    if f < _SQRT_HALF:
        f *= 2.0
        k -= 1
    u = (f - 1.0) / (f + 1.0)
    z = u * u
    p = _ATANH[0]
    for c in _ATANH[1:]:
        p = p * z + c
    return k * _LN2_HI + (k * _LN2_LO + (2.0 * u) * p)


def exp_nonpositive(x: np.ndarray) -> np.ndarray:
    """The twin of fixed_exp.h's exp_nonpositive, elementwise on float32."""
    with np.errstate(all="ignore"):
        n = np.floor(x * _LOG2E + _HALF)
        r = (x - n * _LN2_A) - n * _LN2_B
        p = np.full_like(x, _COEF[0])
        for c in _COEF[1:]:
            p = p * r + c
        scale = ((n.astype(np.int32) + np.int32(127)) << np.int32(23)).view(np.float32)
        return np.where(x < _FLOOR, _F(0.0), p * scale)


def _lane_tree(acc: np.ndarray) -> np.ndarray:
    """The 16 lanes (last axis) summed by the fixed tree."""
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def _blocks_np(w: np.ndarray) -> np.ndarray:
    """Sums of blocks [..., n] (every one of the same n entries) in the fixed order."""
    groups = w.shape[-1] // LANES
    acc = np.zeros((*w.shape[:-1], LANES))
    for g in range(groups):
        acc = acc + w[..., g * LANES : (g + 1) * LANES].astype(np.float64)
    total = _lane_tree(acc)
    for t in range(groups * LANES, w.shape[-1]):
        total = total + w[..., t].astype(np.float64)
    return total


def block_sums_np(w: np.ndarray, block: int = BLOCK) -> np.ndarray:
    rows, n = w.shape
    full = n // block
    parts = []
    if full:
        parts.append(_blocks_np(w[:, : full * block].reshape(rows, full, block)))
    if full * block < n:
        parts.append(_blocks_np(w[:, full * block :])[:, None])
    return np.concatenate(parts, axis=1) if parts else np.zeros((rows, 0))


def row_max_np(x: np.ndarray) -> np.ndarray:
    """Each row's largest entry, NaNs passed over (as the C loop does)."""
    return np.where(np.isnan(x), _F(-np.inf), x).max(axis=1)


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _lib() -> ctypes.CDLL | None:
    return native_build.library()


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"takes float32 rows [R, V] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    return x.contiguous()


class Numerics:
    """The fixed-order arithmetic: in C where the kernels are built (``lib``,
    default: the library of this process's level), else the numpy twins."""

    name = "fixed"

    def __init__(self, lib: ctypes.CDLL | None | bool = True) -> None:
        self._given = lib  # True: look the library up on each call (its level can be set per process)

    @property
    def lib(self) -> ctypes.CDLL | None:
        if self._given is True:
            return _lib()
        return self._given or None

    def exp_shifted(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """exp(x - shift[row]) for entries x - shift <= 0 (below -87: 0)."""
        x = _rows(x)
        shift = shift.to(torch.float32).contiguous().reshape(x.shape[0])
        lib = self.lib
        if lib is None:
            with np.errstate(all="ignore"):
                return torch.from_numpy(exp_nonpositive(x.numpy() - shift.numpy()[:, None]))
        out = torch.empty_like(x)
        lib.trioserve_exp_shifted(x.data_ptr(), shift.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], _threads())
        return out

    def block_sums(self, w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
        """[R, ceil(V / block)] float64: each block of each row summed in the fixed order."""
        w = _rows(w)
        lib = self.lib
        if lib is None:
            return torch.from_numpy(block_sums_np(w.numpy(), block))
        rows, n = w.shape
        out = torch.empty(rows, -(-n // block), dtype=torch.float64)
        lib.trioserve_block_sums(w.data_ptr(), out.data_ptr(), rows, n, block, _threads())
        return out

    def total(self, row: torch.Tensor) -> float:
        """The sum of a 1-D row: its block sums, in order."""
        sums = self.block_sums(row.reshape(1, -1))[0].numpy()
        return float(np.cumsum(sums)[-1]) if sums.size else 0.0

    def ordered_sum(self, values: torch.Tensor) -> float:
        """The sum of a short 1-D list (top-k values), first to last, in float64."""
        return float(np.cumsum(values.double().numpy())[-1]) if values.numel() else 0.0

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """log_softmax of float32 rows: (x - max) - log(sum(exp(x - max))),
        the sum in the fixed order, the result rounded once to float32."""
        x = _rows(x)
        rows, n = x.shape
        lib = self.lib
        if lib is None:
            xs = x.numpy()
            maxes = row_max_np(xs)
            with np.errstate(all="ignore"):
                sums = block_sums_np(exp_nonpositive(xs - maxes[:, None]))
                totals = np.cumsum(sums, axis=1)[:, -1]
                lse = np.array([log_fixed(float(s)) for s in totals])
                out = (xs.astype(np.float64) - maxes.astype(np.float64)[:, None]) - lse[:, None]
            return torch.from_numpy(out.astype(np.float32))
        threads = min(_threads(), rows)
        maxes = torch.empty(rows, dtype=torch.float32)
        sums = torch.empty(rows, dtype=torch.float64)
        lib.trioserve_exp_sums(x.data_ptr(), maxes.data_ptr(), sums.data_ptr(), rows, n, BLOCK, threads)
        lse = torch.tensor([log_fixed(s) for s in sums.tolist()], dtype=torch.float64)
        out = torch.empty_like(x)
        lib.trioserve_log_softmax(x.data_ptr(), maxes.data_ptr(), lse.data_ptr(), out.data_ptr(), rows, n, threads)
        return out


class TorchNumerics(Numerics):
    """torch's arithmetic, as the sampler ran it before the fixed order:
    its bits follow the CPU's vector width (ATen's CPU capability). Kept
    only to replay traces recorded with it."""

    name = "torch"

    def exp_shifted(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return (x - shift.reshape(-1, 1)).exp_()

    def block_sums(self, w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
        vocab = w.shape[1]
        full = vocab // block * block
        sums = [w[:, :full].unflatten(1, (-1, block)).sum(2)]
        if full < vocab:
            sums.append(w[:, full:].sum(1, keepdim=True))
        return torch.cat(sums, dim=1).double()

    def total(self, row: torch.Tensor) -> float:
        return float(row.sum())

    def ordered_sum(self, values: torch.Tensor) -> float:
        return float(values.double().sum())

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=1)


FIXED = Numerics()
TORCH = TorchNumerics()
NUMERICS = {FIXED.name: FIXED, TORCH.name: TORCH}
