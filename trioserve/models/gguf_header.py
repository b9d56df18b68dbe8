"""Reading a GGUF file: a bounds-checked walk over its header, into plain
Python metadata and a table of tensors whose data are views of one read-only
mapping of the file.

Every length and count is checked against the bytes that remain before it
is used, so one flipped byte in an array count is a CheckpointError naming
the field, never an attempt to allocate petabytes. The `gguf` package's own
reader is not used to load: it keeps a numpy object for every part of every
metadata value, which for a 49,152-token vocabulary is ~150 MB of resident
memory held as long as the reader lives (the loader's closures keep it for
the life of the model). Here the metadata are plain values, made once, and
a tensor holds a view of the mapping and nothing else. The `gguf` package
still names the types and dequantizes (`gguf.quants`)."""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np

from trioserve.errors import CheckpointError

# GGUF value types -> struct format of one scalar (8: string, 9: array).
_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR = {kind: struct.calcsize("<" + fmt) for kind, fmt in _FORMAT.items()}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
MAX_DIMS = 8
# Counts in the header, bounded before anything is made per item. A count
# is also bounded by the bytes left (each item takes some), but an item of a
# few bytes becomes a Python object of tens: a 100 MB file could still ask
# for gigabytes. Generous: published files have ~30-60 metadata keys, a few
# thousand tensors, vocabularies up to 262,144 tokens and as many merges.
MAX_METADATA = 1 << 16
MAX_TENSORS = 1 << 18
MAX_ARRAY_ITEMS = 1 << 22
# Tensor types whose data are plain numbers: the numpy type of their view (the rest are bytes).
_PLAIN = {
    gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file. ``shape`` is in the file's order (columns
    first); ``data`` a read-only view of the mapped file: numbers in numpy's
    order for plain types, else [rows..., bytes of a row] of uint8."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file read: ``metadata`` (key -> str, int, float, bool or a list
    of them), ``tensors`` in the file's order, and ``data``, the read-only
    mapping their views share (``mapping`` is its mmap, for madvise)."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: list[GGUFTensor], data: np.memmap) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self.data = data

    @property
    def mapping(self) -> mmap.mmap | None:
        return getattr(self.data, "_mmap", None)


class _Cursor:
    def __init__(self, data: memoryview, path: Path) -> None:
        self.data = data
        self.at = 0
        self.path = path

    def need(self, size: int, what: str) -> None:
        if size < 0 or self.at + size > len(self.data):
            raise CheckpointError(
                self.path, f"truncated or corrupt GGUF file: {what} needs {size} bytes at offset {self.at}, the file has {len(self.data)}"
            )

    def take(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value

    def skip(self, size: int, what: str) -> None:
        self.need(size, what)
        self.at += size

    def string(self, what: str) -> bytes:
        length = self.take("<Q", f"the length of {what}")
        self.need(length, what)
        value = bytes(self.data[self.at : self.at + length])
        self.at += length
        return value

    def text(self, what: str, key: str) -> str:
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(self.path, f"corrupt metadata: the value of {key!r} is not UTF-8 text") from None


def check_header(path: Path) -> None:
    """Walk the header of the GGUF file at ``path`` (magic already checked)."""
    read_gguf(path)


def read_gguf(path: Path) -> GGUFFile:
    """The GGUF file at ``path`` (magic already checked): its metadata and
    tensor table read and checked, the data mapped, read-only."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            cur = _Cursor(view, path)
            metadata, table = _walk(cur, path)
            start = _data_start(cur.at, metadata, path)
        finally:
            view.release()
    data = np.memmap(path, mode="r")
    return GGUFFile(path, metadata, [_tensor(path, data, start, *entry) for entry in table], data)


def _walk(cur: _Cursor, path: Path) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
    cur.skip(4, "the magic")
    version = cur.take("<I", "the version")
    if version not in (2, 3) and int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
        raise CheckpointError(path, "a big-endian GGUF file: trioserve reads little-endian ones (llama.cpp's convert_hf_to_gguf.py writes them by default)")
    if version not in (2, 3):
        raise CheckpointError(path, f"unsupported GGUF version {version} (trioserve reads versions 2 and 3)")
    tensors = cur.take("<Q", "the tensor count")
    fields = cur.take("<Q", "the metadata count")
    if tensors > MAX_TENSORS:
        raise CheckpointError(path, f"corrupt GGUF file: it claims {tensors} tensors (trioserve reads at most {MAX_TENSORS})")
    if fields > MAX_METADATA:
        raise CheckpointError(path, f"corrupt GGUF file: it claims {fields} metadata keys (trioserve reads at most {MAX_METADATA})")
    metadata: dict[str, Any] = {}
    for i in range(fields):
        key = cur.string(f"metadata key {i}").decode("utf-8", errors="replace")
        kind = cur.take("<I", f"the type of {key!r}")
        if key == "general.alignment" and kind != _UINT32:
            raise CheckpointError(path, "corrupt GGUF file: 'general.alignment' is not a uint32")
        metadata[key] = _value(cur, kind, key)
    table = []
    names = set()
    for i in range(tensors):
        name = cur.string(f"tensor name {i}").decode("utf-8", errors="replace")
        dims = cur.take("<I", f"the dimension count of tensor {name!r}")
        if dims > MAX_DIMS:
            raise CheckpointError(path, f"corrupt GGUF file: tensor {name!r} claims {dims} dimensions")
        cur.need(8 * dims + 4 + 8, f"the shape, type and offset of tensor {name!r}")
        shape = struct.unpack_from(f"<{dims}Q", cur.data, cur.at)
        cur.at += 8 * dims
        kind = cur.take("<I", f"the type of tensor {name!r}")
        offset = cur.take("<Q", f"the offset of tensor {name!r}")
        if name in names:
            raise CheckpointError(path, f"corrupt GGUF file: tensor {name!r} appears twice")
        names.add(name)
        table.append((name, shape, kind, offset))
    return metadata, table


def _data_start(end: int, metadata: dict[str, Any], path: Path) -> int:
    """Where the tensor data begin: the header's end rounded up to the file's alignment."""
    align = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if align <= 0 or align & (align - 1):
        raise CheckpointError(path, f"corrupt GGUF file: 'general.alignment' is {align!r}, not a power of two")
    return -(-end // align) * align


def _tensor(path: Path, data: np.memmap, start: int, name: str, shape: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
    try:
        tensor_type = gguf.GGMLQuantizationType(kind)
        block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    except (ValueError, KeyError):
        raise CheckpointError(path, f"corrupt GGUF file: tensor {name!r} has unknown type {kind}") from None
    dims = tuple(reversed(shape))  # numpy's order: rows first
    if not shape or 0 in shape:
        raise CheckpointError(path, f"corrupt GGUF file: tensor {name!r} has shape {list(shape)}, with no elements")
    if shape[0] % block:
        raise CheckpointError(path, f"corrupt GGUF file: tensor {name!r} of shape {list(shape)} is not whole {tensor_type.name} blocks of {block}")
    n_bytes = math.prod(shape) // block * type_size
    at = start + offset
    if at + n_bytes > len(data):
        raise CheckpointError(
            path, f"truncated or corrupt GGUF file: tensor {name!r} needs {n_bytes} bytes at offset {at}, the file has {len(data)}"
        )
    raw = data[at : at + n_bytes]
    if tensor_type in _PLAIN:
        view = raw.view(_PLAIN[tensor_type]).reshape(dims)
    else:
        view = raw.reshape(*dims[:-1], dims[-1] // block * type_size)
    return GGUFTensor(name, tensor_type, shape, n_bytes, at, view)


_LENGTH = struct.Struct("<Q")


def _strings(cur: _Cursor, count: int, key: str) -> list[str]:
    """``count`` strings (a vocabulary's 49,152 tokens, its merges) in one
    tight loop; where one runs past the file or is not UTF-8, read again
    one by one from the same place, for `_Cursor`'s message naming it."""
    data, at, end = cur.data, cur.at, len(cur.data)
    unpack = _LENGTH.unpack_from
    out = []
    try:
        for _ in range(count):
            (length,) = unpack(data, at)
            start, at = at + 8, at + 8 + length
            if at > end:
                raise ValueError
            out.append(str(data[start:at], "utf-8"))
    except (ValueError, struct.error):  # UnicodeDecodeError is a ValueError
        return [cur.text(f"an item of {key!r}", key) for _ in range(count)]
    cur.at = at
    return out


def _value(cur: _Cursor, kind: int, key: str) -> Any:
    if kind in _FORMAT:
        return cur.take("<" + _FORMAT[kind], f"the value of {key!r}")
    if kind == _STRING:
        return cur.text(f"the value of {key!r}", key)
    if kind == _ARRAY:
        item = cur.take("<I", f"the item type of {key!r}")
        count = cur.take("<Q", f"the item count of {key!r}")
        # Every item takes at least its scalar, or a string's 8-byte length: first the bytes left, then the bound.
        cur.need(count * _SCALAR.get(item, 8), f"the {count} items of {key!r}")
        if count > MAX_ARRAY_ITEMS:
            raise CheckpointError(cur.path, f"corrupt GGUF file: {key!r} claims {count} items (trioserve reads at most {MAX_ARRAY_ITEMS})")
        if item in _FORMAT:
            size = count * _SCALAR[item]
            values = np.frombuffer(cur.data, dtype="<" + _FORMAT[item], count=count, offset=cur.at).tolist()
            cur.at += size
            return values
        if item == _STRING:
            return _strings(cur, count, key)
        raise CheckpointError(cur.path, f"corrupt GGUF file: {key!r} is an array of unknown type {item}")
    raise CheckpointError(cur.path, f"corrupt GGUF file: {key!r} has unknown value type {kind}")
