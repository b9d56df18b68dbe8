"""Opening a GGUF file (models/gguf_header.py reads it) with precise
messages for the common mistakes, and its metadata as plain Python values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trioserve.errors import CheckpointError
from trioserve.models.gguf_header import GGUFFile, read_gguf

GGUF_MAGIC = b"GGUF"


def open_reader(path: str | Path) -> GGUFFile:
    """Open ``path`` as GGUF, checking existence and the magic first so the
    common mistakes get a precise message."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(path, "no such file")
    if not path.is_file():
        raise CheckpointError(path, "not a file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(path, f"not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    return read_gguf(path)


def metadata(reader: GGUFFile, path: str | Path) -> dict[str, Any]:
    """All key/value fields as Python values (str, int, float, bool, lists);
    a string that is not UTF-8 was refused when the file was read."""
    return dict(reader.metadata)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of the GGUF file at ``path`` (see `metadata`)."""
    return metadata(open_reader(path), path)
