"""The kernels' weight layouts share one step: tiles of 16 outputs in
groups (three a group: Q8_TILES, I6_TILES in the C source), each group
read block by block across its tiles. `grouped` lays a weight out so;
`BlockRows` holds a weight still in its file's blocks, for the C packers
that write those layouts straight from them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


class BlockRows:
    """A weight still in its GGUF file's blocks (a subclass names the types
    it holds, ``TYPES``: name -> bytes and weights a block): output row i
    is row ``order[i, 1]`` of ``sources[order[i, 0]]``, each source a
    [rows, row bytes] uint8 view of the mapped file. A kernel's layout is
    written straight from the blocks through the rows' addresses (the C
    library's ``*_rows`` packers), so a fused projection's parts and a
    Q/K projection's row order cost no copies; every other path reads the
    weight unpacked (the subclass's ``parts()``). ``release()`` lets the
    file's pages go once the weight is packed."""

    TYPES: dict[str, tuple[int, int]] = {}
    # Each subclass sets both (staticmethods): one source's rows unpacked
    # into its parts type, and unpacked parts one after the other.
    _unpack: Callable[[np.ndarray, str], Any]
    _cat: Callable[[list], Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [name for name in ("TYPES", "_unpack", "_cat") if name not in cls.__dict__]
        if missing:
            raise TypeError(f"{cls.__name__} must set {', '.join(missing)}")

    def __init__(self, sources: tuple[np.ndarray, ...], qtype: str, order: np.ndarray, release: tuple[Callable[[], None], ...] = ()):
        if qtype not in self.TYPES:
            raise ValueError(f"{type(self).__name__} holds {', '.join(self.TYPES)} blocks, not {qtype}")
        if any(s.ndim != 2 or s.dtype != np.uint8 or s.strides[1] != 1 for s in sources):
            raise ValueError(f"{type(self).__name__}: each source must be [rows, row bytes] uint8, each row's bytes in one run (the C packers read them so)")
        self.sources = sources
        self.qtype = qtype
        self.order = np.ascontiguousarray(order, dtype=np.int64).reshape(-1, 2)
        self._release = release
        self._parts = None
        block_bytes, weights = self.TYPES[qtype]
        widths = sorted({s.shape[1] // block_bytes * weights for s in sources})
        if len(widths) != 1:
            raise ValueError(f"{type(self).__name__}: sources of different widths {widths}")
        self.k = widths[0]

    @classmethod
    def of(cls, raw: np.ndarray, qtype: str, release: Callable[[], None] | None = None):
        """All of tensor ``raw``'s rows ([rows, row bytes] uint8), in order."""
        order = np.stack([np.zeros(raw.shape[0], dtype=np.int64), np.arange(raw.shape[0])], axis=1)
        return cls((raw,), qtype, order, (release,) if release else ())

    @classmethod
    def joined(cls, parts: list) -> BlockRows | None:
        """``parts`` one after the other as one weight, where every part is
        one of these of one type; else None."""
        if not all(isinstance(p, cls) for p in parts) or len({p.qtype for p in parts}) != 1:
            return None
        sources: list[np.ndarray] = []
        orders, release = [], []
        for p in parts:
            orders.append(p.order + np.array([len(sources), 0]))
            sources.extend(p.sources)
            release.extend(p._release)
        return cls(tuple(sources), parts[0].qtype, np.concatenate(orders), tuple(release))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.order.shape[0], self.k)

    def take_rows(self, order: np.ndarray):
        return type(self)(self.sources, self.qtype, self.order[np.asarray(order, dtype=np.int64)], self._release)

    def row_addresses(self) -> np.ndarray:
        """Each output row's first byte, as integers (uint64 [N])."""
        base = np.array([s.ctypes.data for s in self.sources], dtype=np.uint64)
        stride = np.array([s.strides[0] for s in self.sources], dtype=np.uint64)
        return base[self.order[:, 0]] + stride[self.order[:, 0]] * self.order[:, 1].astype(np.uint64)

    def parts(self) -> Any:
        """The weight unpacked (each source once, joined and put in
        ``order``), as the other paths take it; made when first asked, kept."""
        if self._parts is None:
            made = [self._unpack(s, self.qtype) for s in self.sources]
            offsets = np.cumsum([0] + [s.shape[0] for s in self.sources])[:-1]
            whole = made[0] if len(made) == 1 else self._cat(made)
            self._parts = whole.take_rows(offsets[self.order[:, 0]] + self.order[:, 1])
        return self._parts

    def dequantize(self) -> Any:
        return self.parts().dequantize()

    @classmethod
    def concat(cls, parts: list) -> Any:
        """One weight of ``parts``' rows (these, or unpacked parts), one
        after the other: still in the file's blocks where every part is and
        of one type, else unpacked."""
        widths = sorted({p.shape[1] for p in parts})
        if len(widths) != 1:
            raise ValueError(f"{cls.__name__}.concat: parts of different widths {widths}")
        joined = cls.joined(parts)
        if joined is not None:
            return joined
        unpacked = [p.parts() if isinstance(p, cls) else p for p in parts]
        for p in parts:  # unpacked now (parts of different types: a Q5_K_M file's Q5_K and Q6_K rows): the file's pages can go
            if isinstance(p, BlockRows):
                p.release()
        return cls._cat(unpacked)

    def release(self) -> None:
        """Let the file's pages behind the sources go (read again if touched)."""
        for fn in self._release:
            fn()
