"""Reading a GGUF file's metadata and tensors with the `gguf` package.

Only this module touches `gguf.GGUFReader`; it turns the reader's fields into
plain Python values and its failures into CheckpointError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from trioserve.errors import CheckpointError
from trioserve.models.gguf_header import check_header

GGUF_MAGIC = b"GGUF"


def open_reader(path: str | Path) -> gguf.GGUFReader:
    """Open ``path`` as GGUF, checking existence and the magic first so the
    common mistakes get a precise message instead of a numpy traceback."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(path, "no such file")
    if not path.is_file():
        raise CheckpointError(path, "not a file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(path, f"not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    check_header(path)
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as exc:
        # A file cut short or with garbage after the magic surfaces as a numpy
        # read past the end or an absurd length; name it as what it is.
        raise CheckpointError(path, f"truncated or corrupt GGUF file ({exc})") from exc


def metadata(reader: gguf.GGUFReader, path: str | Path) -> dict[str, Any]:
    """All key/value fields as Python values (str, int, float, bool, lists).
    A string that is not UTF-8 is a CheckpointError naming ``path``."""
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        try:
            value = field.contents()
        except UnicodeDecodeError as exc:
            raise CheckpointError(path, f"corrupt metadata: the value of {name!r} is not UTF-8 text") from exc
        if isinstance(value, np.generic):
            value = value.item()
        out[name] = value
    return out


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of the GGUF file at ``path`` (see `metadata`)."""
    return metadata(open_reader(path), path)
