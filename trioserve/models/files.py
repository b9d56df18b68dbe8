"""Reading a checkpoint's small files (JSON settings, tokenizer.json, a chat
template) as untrusted input: only a regular file, and only up to a bound.

A name in a model directory can be a FIFO (opening it waits for a writer
that never comes), a link to /dev/zero (endless bytes) or a file of
gigabytes. The file is opened without blocking (O_NONBLOCK: a FIFO opens at
once, and is then seen for what it is), its type and size are checked on
the open descriptor (no race between the check and the read), and no more
than the bound plus one byte is ever read. Links are followed: a Hugging
Face cache's snapshot directory is all links into its blob store."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MIB = 1 << 20
# The largest of each kind of file read whole. Generous: published
# tokenizer.json files reach ~35 MB (Gemma 3's), tokenizer_config.json a few MB,
# configs and indexes far less, chat templates tens of KB.
MAX_TOKENIZER_JSON = 256 * MIB
MAX_JSON = 64 * MIB
MAX_TEMPLATE = 4 * MIB

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class FileRefused(Exception):
    """A file that will not be read: missing, not a regular file, or over
    its bound. ``problem`` is one line without the path; ``missing`` tells
    a name that does not exist from one that is refused; ``oversize``, one
    refused for its size (so a caller can say why its bound is what it is)."""

    def __init__(self, path: Path, problem: str, *, missing: bool = False, oversize: bool = False) -> None:
        self.path = path
        self.problem = problem
        self.missing = missing
        self.oversize = oversize
        super().__init__(f"{path}: {problem}")


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_bytes(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path`` (links followed), at most
    ``limit`` of them; FileRefused otherwise. Never blocks on a FIFO or a
    device, never reads more than ``limit`` + 1 bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileRefused(path, "no such file", missing=True) from None
    except OSError as exc:
        # A Unix socket cannot be opened at all (ENXIO): say what it is, as for a FIFO.
        kind = _not_regular(path) if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP) else None
        if kind is not None:
            raise FileRefused(path, f"is {kind}, not a regular file") from None
        raise FileRefused(path, f"cannot open it ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(path, f"is {kind_of(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise FileRefused(path, f"is {info.st_size} bytes, more than the {limit} trioserve reads for it", oversize=True)
        chunks = []
        left = limit + 1  # one byte past the bound tells a file that grew since fstat
        while left > 0:
            chunk = os.read(fd, min(left, 4 * MIB))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise FileRefused(path, f"cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileRefused(path, f"is more than the {limit} bytes trioserve reads for it", oversize=True)
    return data


def read_text(path: Path, limit: int) -> str:
    """`read_bytes` decoded as UTF-8; FileRefused if it is not."""
    data = read_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileRefused(path, f"is not UTF-8 text (byte {exc.start})") from None


def is_regular_file(path: Path) -> bool:
    """Whether ``path`` names a regular file (links followed), without opening it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _not_regular(path: Path) -> str | None:
    """What ``path`` is, in words, when it is not a regular file (links
    followed); None for a regular file or a name that cannot be looked at."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else kind_of(mode)
