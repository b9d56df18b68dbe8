"""The kernels' weight layouts share one step: tiles of 16 outputs in
groups (three a group: Q8_TILES, I6_TILES in the C source), each group
read block by block across its tiles. `grouped` lays a weight out so."""

from __future__ import annotations

import numpy as np


def grouped(tiles: np.ndarray, dtype: type, per_group: int) -> np.ndarray:
    """``tiles`` [tile, block, ...] as groups of ``per_group`` tiles (the
    last may hold fewer), each group block by block across its tiles, flat.
    Written once into the result: a copy per group and then their
    concatenation had held a big weight twice over (a third of an 8B
    model's build)."""
    count, nb, rest = tiles.shape[0], tiles.shape[1], tiles.shape[2:]
    out = np.empty(tiles.size, dtype=dtype)
    whole = count // per_group * per_group
    split = whole * (tiles.size // max(count, 1))
    if whole:
        groups = tiles[:whole].reshape(whole // per_group, per_group, nb, *rest)
        out[:split].reshape(whole // per_group, nb, per_group, *rest)[...] = groups.swapaxes(1, 2)
    if whole < count:
        out[split:].reshape(nb, count - whole, *rest)[...] = tiles[whole:].swapaxes(0, 1)
    return out
