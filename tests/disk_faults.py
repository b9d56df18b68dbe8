"""Disk faults made for real, as root can make them, for the state store's
tests: a small disk filled to its last byte (a tmpfs of its own) and a file
made immutable (`chattr +i`). Where this machine does not allow one, the
test is skipped saying why."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(where: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (made), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is a small tmpfs mounted for the test, and mounting needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill here: {done.stderr.strip() or done.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], capture_output=True, check=False)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to its last byte with one file: that file (delete it to
    free the space again)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
        try:
            os.write(fd, b"\0")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        else:
            raise AssertionError(f"{disk} is not full")
    finally:
        os.close(fd)
    return filler


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[Path]:
    """``path`` made immutable (`chattr +i`: not even root may write it),
    made mutable again after."""
    if os.geteuid() != 0:
        pytest.skip("an immutable file (chattr +i) needs root")
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not supported here: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
