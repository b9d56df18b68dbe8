"""Embedding pooling in fixed point: why, and the plain half of it.

An embedding request's vector is its prompt's final hidden states (after
the model's last RMSNorm) pooled -- the last token's, or the mean of all
of them -- then L2-normalised. A prompt is prefilled in chunks that fall
wherever a step's budget ends, so a mean taken as floating-point sums per
chunk would round differently for every way of cutting the prompt, and
batch invariance (docs/determinism.md) would be lost at the very end.

So the worker turns each hidden value into an integer: the fp32 value
times 2**FRACTION_BITS, rounded to the nearest integer (exact steps in
float64), clamped to +-LIMIT. A chunk's pooled rows are summed as int64
and the core adds the chunks' sums as Python integers. Integer addition
is exact, so the total is the same however the prompt was chunked and
whatever shared its steps; each row's hidden state already is
(docs/determinism.md). `embedding` then divides, normalises and rounds to
float32 with correctly rounded operations only.

Precision: a value is off by at most 2**-25 (3e-8) before the mean,
about one fp32 rounding for values near 1; final-normed hidden states are
of order 1 (at most sqrt(hidden size) times the norm's weight). This module
is plain Python: the core uses it; the worker uses its constants."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

FRACTION_BITS = 24
# A value is clamped to +-2**20 before scaling: far beyond any final-normed
# hidden state, and it keeps a chunk's int64 sum exact up to 2**19 rows.
LIMIT = 1 << (20 + FRACTION_BITS)


def embedding(sums: Sequence[int], count: int) -> tuple[float, ...]:
    """The unit vector along the mean of ``count`` pooled rows whose
    fixed-point sums are ``sums``, each component rounded to float32. A
    zero vector stays zero."""
    if count < 1:
        raise ValueError(f"nothing was pooled (count {count})")
    scale = count << FRACTION_BITS
    mean = [s / scale for s in sums]  # int / int: correctly rounded
    norm = math.sqrt(math.fsum(x * x for x in mean))
    if norm == 0.0:
        return tuple(0.0 for _ in mean)
    return float32s(x / norm for x in mean)


def raw_vector(sums: Sequence[int], count: int) -> tuple[float, ...]:
    """The mean of ``count`` pooled rows whose fixed-point sums are ``sums``,
    not scaled to length 1 (a classification head's outputs: a score is a
    value, not a direction), each component rounded to float32."""
    if count < 1:
        raise ValueError(f"nothing was pooled (count {count})")
    scale = count << FRACTION_BITS
    return float32s(s / scale for s in sums)


def float32s(values) -> tuple[float, ...]:
    """``values`` rounded to float32 (still Python floats)."""
    packed = list(values)
    return struct.unpack(f"<{len(packed)}f", struct.pack(f"<{len(packed)}f", *packed))


def add_sums(total: list[int] | None, sums: Sequence[int]) -> list[int]:
    """``total`` plus one chunk's ``sums``, element by element (None: the
    first chunk)."""
    if total is None:
        return list(sums)
    if len(total) != len(sums):
        raise ValueError(f"pooled sums of {len(sums)} values added to {len(total)}")
    return [a + b for a, b in zip(total, sums, strict=True)]
