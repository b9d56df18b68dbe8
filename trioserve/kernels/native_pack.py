"""Weights laid out for the C matmul kernels of kernels/native.py, and
GGUF codes unpacked on the way there. The layouts: `Int4Pack` (by
`pack_int4` and `pack_int4_q8`) and `Int8Pack` (by `pack_int8`), drawn in
the C source. The C library's load-time helpers (`grouped_codes`,
`unpack_nibbles`, `q4_k_scales`, `unpack_codes6` and the ``pack_*_rows``
functions, which read a weight's GGUF blocks where they lie) write the
bytes the numpy code writes, in one pass on torch's threads; where the
library is not loaded (kernels/native_build.py) they return None and the
numpy code serves (`pack_int4_q8_rows` falls back to it itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from trioserve.kernels import native_build
from trioserve.kernels.layout import grouped

if TYPE_CHECKING:
    from trioserve.kernels.int4 import Int4Parts, Int4Rows
    from trioserve.kernels.int6 import Int6Rows
    from trioserve.kernels.int8w import Q8Rows
    from trioserve.kernels.w16 import W16Rows


@attrs.frozen
class Int4Pack:
    """A 4-bit weight [N, K] in `int4_matmul`'s layout (the C source's
    comment above `trioserve_int4_matmul` draws it): ``packed`` uint8 codes
    in panels of 32 outputs, ``scales`` f16 d and m per 32 inputs."""

    packed: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    # True for `int4_q8_matmul`'s layout (tiles of 16 outputs, quads of inputs), written by `pack_int4_q8`.
    q8: bool = False


# Tiles of 16 outputs per group in `pack_int4_q8`'s layout (Q8A_TILES in the C source).
Q8_GROUP_TILES = 3


def _blocks_d_m(parts: Int4Parts) -> tuple[np.ndarray, np.ndarray]:
    """A 4-bit weight's blocks as w = q d + m: d = scale and
    m = zero - 8 scale, GGUF's own f16 minimum (Q4_1) or -8 d (Q4_0), both
    exact in f16. [N, K/32] fp32 each."""
    d = parts.scale.numpy().astype(np.float32)
    return d, parts.zero.numpy().astype(np.float32) - 8 * d


def grouped_codes(u: np.ndarray, bits: int, per_group: int) -> np.ndarray | None:
    """Codes one a byte, u [n, k] uint8, laid out for the 4-bit (``bits``
    4) or 6-bit (6) int8-activation kernel in groups of ``per_group`` tiles,
    by the C library's packer (one pass, on torch's threads); None where
    the library is not loaded, and the numpy packer serves (the same
    bytes, several times slower: it was most of a big model's build)."""
    lib = native_build.library()
    if lib is None:
        return None
    n, k = u.shape
    u = np.ascontiguousarray(u, dtype=np.uint8)
    out = np.empty(n * k * bits // 8, dtype=np.uint8)
    fn = lib.trioserve_pack_int4_q8_codes if bits == 4 else lib.trioserve_pack_int6_q8_codes
    fn(u.ctypes.data, n, k, per_group, out.ctypes.data, torch.get_num_threads())
    return out


def unpack_nibbles(raw: np.ndarray, block_bytes: int, header: int, run: int) -> np.ndarray | None:
    """4-bit codes one a byte out of GGUF blocks (raw [rows, blocks *
    block_bytes] uint8), by the C library: [rows, codes] uint8, each run of
    ``run`` nibble bytes after a block's ``header`` giving its low nibbles,
    then its high ones. None where the library is not loaded."""
    lib = native_build.library()
    if lib is None:
        return None
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    out = np.empty((raw.shape[0], raw.shape[1] // block_bytes * (block_bytes - header) * 2), dtype=np.uint8)
    lib.trioserve_unpack_nibbles(raw.ctypes.data, raw.size // block_bytes, block_bytes, header, run, out.ctypes.data, torch.get_num_threads())
    return out


def q4_k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Q4_K rows' group scales and zeros ([rows, supers * 144] uint8 ->
    two [rows, supers * 8] float32), as kernels/int4.py's numpy makes
    them, by the C library; None where it is not loaded."""
    lib = native_build.library()
    if lib is None:
        return None
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    supers = raw.size // 144
    scale = np.empty((raw.shape[0], raw.shape[1] // 144 * 8), dtype=np.float32)
    zero = np.empty_like(scale)
    lib.trioserve_q4_k_scales(raw.ctypes.data, supers, scale.ctypes.data, zero.ctypes.data, torch.get_num_threads())
    return scale, zero


CODES6_KINDS = {"Q6_K": (0, 210, 256), "Q5_K": (1, 176, 256), "Q5_0": (2, 22, 32), "Q5_1": (3, 24, 32)}


def unpack_codes6(raw: np.ndarray, qtype_name: str) -> np.ndarray | None:
    """The up-to-6-bit codes of Q6_K, Q5_K, Q5_0 or Q5_1 rows (raw [rows,
    blocks * bytes] uint8), one a byte in the file's order, by the C
    library: [rows, K] uint8. None where the library is not loaded
    (kernels/int6.py reads them with numpy then)."""
    lib = native_build.library()
    if lib is None:
        return None
    kind, block_bytes, weights = CODES6_KINDS[qtype_name]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    blocks = raw.size // block_bytes
    out = np.empty((raw.shape[0], raw.shape[1] // block_bytes * weights), dtype=np.uint8)
    lib.trioserve_unpack_codes6(raw.ctypes.data, blocks, kind, out.ctypes.data, torch.get_num_threads())
    return out


def pack_int4_q8(parts: Int4Parts) -> Int4Pack:
    """Lay out unpacked 4-bit codes for `int4_q8_matmul` (the C source's
    comment above `trioserve_int4_q8_matmul` draws it)."""
    q = parts.q.numpy()
    n, k = q.shape
    if n % 16 or k % 32:
        raise ValueError(f"int4_q8_matmul takes weights of a multiple of 16 outputs and 32 inputs, got {n} x {k}")
    nb = k // 32
    d, m = _blocks_d_m(parts)
    both = np.stack([d, m]).astype(np.float16).reshape(2, n // 16, 16, nb).transpose(1, 3, 0, 2)  # tile, block, which, column
    # Groups of Q8_GROUP_TILES tiles, each block by block across its tiles.
    packed = grouped_codes(q, 4, Q8_GROUP_TILES)
    if packed is None:
        codes = q.reshape(n // 16, 16, nb, 2, 4, 4)  # tile, column, block, half, quad, e
        bytes_ = np.left_shift(codes[:, :, :, 1], 4, dtype=np.uint8)
        np.bitwise_or(bytes_, codes[:, :, :, 0], out=bytes_)
        tiles = bytes_.transpose(0, 2, 3, 1, 4)  # tile, block, quad, column, e
        packed = grouped(tiles, np.uint8, Q8_GROUP_TILES)
    scales = grouped(both, np.float16, Q8_GROUP_TILES)
    return Int4Pack(torch.from_numpy(packed), torch.from_numpy(scales.view(np.uint16)), n, k, q8=True)


# `trioserve_pack_int4_q8_rows`'s kinds.
_ROWS_KINDS = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2}


def _rows_packing(rows, kernel: str, code_bytes: float, scales: int):
    """What a ``*_rows`` packer needs: the library, n, k, the rows'
    addresses and empty codes ([n k code_bytes] uint8) and scales ([n k /
    32 scales] uint16); None where the library is not loaded. ValueError
    for a shape ``kernel`` does not take."""
    lib = native_build.library()
    if lib is None:
        return None
    n, k = rows.shape
    if n % 16 or k % 32:
        raise ValueError(f"{kernel} takes weights of a multiple of 16 outputs and 32 inputs, got {n} x {k}")
    return lib, n, k, rows.row_addresses(), np.empty(int(n * k * code_bytes), dtype=np.uint8), np.empty(n * k // 32 * scales, dtype=np.uint16)


def pack_int4_q8_rows(rows: Int4Rows) -> Int4Pack:
    """`pack_int4_q8` of a weight still in its GGUF blocks, laid out by the
    C library straight from them (the same bytes, without unpacking the
    codes one a byte or copying them between); through `Int4Parts` where
    the library is not loaded."""
    made = _rows_packing(rows, "int4_q8_matmul", 0.5, 2)
    if made is None:
        return pack_int4_q8(rows.parts())
    lib, n, k, addresses, codes, scales = made
    lib.trioserve_pack_int4_q8_rows(
        addresses.ctypes.data, n, k, _ROWS_KINDS[rows.qtype], Q8_GROUP_TILES, codes.ctypes.data, scales.ctypes.data, torch.get_num_threads()
    )
    return Int4Pack(torch.from_numpy(codes), torch.from_numpy(scales), n, k, q8=True)


def pack_int6_q8_rows(rows: Int6Rows, symmetric: bool | None = None):
    """`int6.pack_int6_q8` of a weight still in its GGUF blocks, by the C
    library straight from them (the same bytes and scales); None where the
    library is not loaded."""
    from trioserve.kernels.int6 import TILE_GROUPS, Int6Pack

    lib = native_build.library()
    if lib is None:
        return None
    kind = CODES6_KINDS[rows.qtype][0]
    n, k = rows.shape
    addresses = rows.row_addresses()  # held while the library reads it
    exact = n % 16 == 0 and k % 32 == 0 and bool(lib.trioserve_int6_rows_symmetric(addresses.ctypes.data, n, k, kind, torch.get_num_threads()))
    if symmetric and not exact:
        raise ValueError("a symmetric 6-bit pack needs m = -32 d in every group")
    symmetric = exact if symmetric is None else symmetric
    lib, n, k, addresses, codes, scales = _rows_packing(rows, "int6_q8_matmul", 0.75, 2 if symmetric else 4)
    lib.trioserve_pack_int6_q8_rows(
        addresses.ctypes.data, n, k, kind, TILE_GROUPS, int(symmetric), codes.ctypes.data, scales.ctypes.data, torch.get_num_threads()
    )
    return Int6Pack(torch.from_numpy(codes), torch.from_numpy(scales), n, k, symmetric)


def pack_int8_q8_rows(rows: Q8Rows):
    """`int8w.pack_int8_q8` of a Q8_0 weight still in its GGUF blocks, by
    the C library straight from them (the same bytes and scales); None
    where the library is not loaded."""
    from trioserve.kernels.int6 import TILE_GROUPS
    from trioserve.kernels.int8w import Int8CodesPack

    made = _rows_packing(rows, "int8_q8_matmul", 1, 1)
    if made is None:
        return None
    lib, n, k, addresses, codes, scales = made
    lib.trioserve_pack_int8_q8_rows(addresses.ctypes.data, n, k, TILE_GROUPS, codes.ctypes.data, scales.ctypes.data, torch.get_num_threads())
    return Int8CodesPack(torch.from_numpy(codes.view(np.int8)), torch.from_numpy(scales), n, k)


def pack_w16_rows(rows: W16Rows):
    """`w16.pack_w16` of an F16/BF16 weight still in its file, by the C
    library straight from the file's rows (the same bytes); None where the
    library is not loaded."""
    from trioserve.kernels.w16 import TILE, W16Pack

    lib = native_build.library()
    if lib is None:
        return None
    n, k = rows.shape
    addresses = rows.row_addresses()
    out = torch.empty(-(-n // TILE) * TILE * k, dtype=torch.int16)
    lib.trioserve_pack_w16_rows(addresses.ctypes.data, n, k, out.data_ptr(), torch.get_num_threads())
    return W16Pack(out, n, k, rows.bf16)


def pack_int4(parts: Int4Parts) -> Int4Pack:
    """Lay out unpacked 4-bit codes (`Int4Parts`: w = (q - 8) scale + zero)
    for `int4_matmul`, whose blocks hold w = q d + m: d = scale and
    m = zero - 8 scale, which is GGUF's own f16 minimum (Q4_1) or -8 d
    (Q4_0), both exact in f16."""
    q = parts.q.numpy()
    n, k = q.shape
    if n % 32 or k % 32:
        raise ValueError(f"int4_matmul takes weights whose sizes are multiples of 32, got {n} x {k}")
    nb = k // 32
    # [panel, tile, column, block, half, chunk, t]: input 16 * half + 2 * chunk + t of a block
    codes = q.reshape(n // 32, 2, 16, nb, 2, 8, 2)
    bytes_ = (codes[:, :, :, :, 0] | (codes[:, :, :, :, 1] << 4)).astype(np.uint8)
    packed = np.ascontiguousarray(bytes_.transpose(0, 3, 1, 4, 2, 5))  # panel, block, tile, chunk, column, t
    d, m = _blocks_d_m(parts)
    both = np.stack([d, m]).astype(np.float16).reshape(2, n // 32, 2, 16, nb)  # which, panel, tile, column, block
    scales = np.ascontiguousarray(both.transpose(1, 4, 2, 0, 3))  # panel, block, tile, which, column
    return Int4Pack(torch.from_numpy(packed.reshape(-1)), torch.from_numpy(scales.reshape(-1).view(np.uint16)), n, k)


@attrs.frozen
class Int8Pack:
    """An 8-bit weight [N, K] in `int8_matmul`'s layout (drawn in the C
    source): ``packed`` int8 in panels of 32 outputs by input pairs,
    ``scale`` [N] fp32."""

    packed: torch.Tensor
    scale: torch.Tensor
    n: int
    k: int


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> Int8Pack:
    """Lay out int8 codes [N, K] with one scale per output for `int8_matmul`."""
    return Int8Pack(pack_int8_codes(q), scale.float().contiguous(), *q.shape)


def pack_int8_codes(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in `int8_matmul`'s layout, flat. Panels of 32 outputs
    are laid out one after another, so any slice of whole panels packs alone:
    rows [32 a, 32 b) become elements [32 a K, 32 b K) of the whole's layout."""
    n, k = q.shape
    if n % 32 or k % 2:
        raise ValueError(f"int8_matmul takes weights of a multiple of 32 outputs and an even number of inputs, got {n} x {k}")
    # [panel, tile, column, pair, t] -> [panel, pair, tile, column, t]
    return q.reshape(n // 32, 2, 16, k // 2, 2).permute(0, 3, 1, 2, 4).contiguous().reshape(-1)


def unpack_int8_codes(pack: Int8Pack) -> torch.Tensor:
    """The codes [N, K] of an `Int8Pack` (the inverse of `pack_int8_codes`)."""
    n, k = pack.n, pack.k
    return pack.packed.reshape(n // 32, k // 2, 2, 16, 2).permute(0, 2, 3, 1, 4).reshape(n, k)
