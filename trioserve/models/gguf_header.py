"""A bounds-checked walk over a GGUF file's header before the `gguf` package
reads it. The package trusts every length and count it finds, so one flipped
byte in an array count makes it try to allocate petabytes and the process is
killed. This walk reads only the header's fixed-size fields and checks each
length and count against the bytes that remain; it raises CheckpointError
naming the first field that cannot be right."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from trioserve.errors import CheckpointError

# GGUF value types -> byte size of one scalar (8: string, 9: array).
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 8


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


def check_header(path: Path) -> None:
    """Walk the header of the GGUF file at ``path`` (magic already checked)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        data = memoryview(mapped)
        try:
            _walk(_Cursor(data, path), path)
        finally:
            data.release()


def _walk(cur: _Cursor, path: Path) -> None:
    cur.skip(4, "the magic")
    version = cur.take("<I", "the version")
    if version not in (2, 3):
        raise CheckpointError(path, f"unsupported GGUF version {version} (trioserve reads versions 2 and 3)")
    tensors = cur.take("<Q", "the tensor count")
    fields = cur.take("<Q", "the metadata count")
    for i in range(fields):
        key = cur.string(f"metadata key {i}").decode("utf-8", errors="replace")
        kind = cur.take("<I", f"the type of {key!r}")
        _skip_value(cur, kind, key)
    for i in range(tensors):
        name = cur.string(f"tensor name {i}").decode("utf-8", errors="replace")
        dims = cur.take("<I", f"the dimension count of tensor {name!r}")
        if dims > MAX_DIMS:
            raise CheckpointError(path, f"corrupt GGUF file: tensor {name!r} claims {dims} dimensions")
        cur.skip(8 * dims + 4 + 8, f"the shape, type and offset of tensor {name!r}")


def _skip_value(cur: _Cursor, kind: int, key: str) -> None:
    if kind in _SCALAR:
        cur.skip(_SCALAR[kind], f"the value of {key!r}")
    elif kind == _STRING:
        cur.string(f"the value of {key!r}")
    elif kind == _ARRAY:
        item = cur.take("<I", f"the item type of {key!r}")
        count = cur.take("<Q", f"the item count of {key!r}")
        if item in _SCALAR:
            cur.skip(count * _SCALAR[item], f"the {count} items of {key!r}")
        elif item == _STRING:
            # Every string item has at least its 8-byte length.
            cur.need(count * 8, f"the {count} items of {key!r}")
            for _ in range(count):
                cur.string(f"an item of {key!r}")
        else:
            raise CheckpointError(cur.path, f"corrupt GGUF file: {key!r} is an array of unknown type {item}")
    else:
        raise CheckpointError(cur.path, f"corrupt GGUF file: {key!r} has unknown value type {kind}")
