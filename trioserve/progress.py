"""A load-progress bar on stderr. On a terminal it redraws in place; in a log
(not a TTY) it prints a line every tenth of the way, so long loads still
show life without flooding the log."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Callable as ``progress(done, total)``; `finish` prints the summary."""

    def __init__(self, label: str, *, unit: str = "tensors", stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.started = time.monotonic()
        self._tty = self.stream.isatty()
        self._last_tenth = -1

    def __call__(self, done: int, total: int) -> None:
        if done == 0:  # the work starts now: `finish` times it from here
            self.started = time.monotonic()
        if self._tty:
            filled = self.width * done // max(total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {self.unit}")
            if done >= total:
                self.stream.write("\n")
            self.stream.flush()
            return
        tenth = 10 * done // max(total, 1)
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(f"{self.label}: {done}/{total} {self.unit}\n")
            self.stream.flush()

    def finish(self, note: str = "") -> None:
        elapsed = time.monotonic() - self.started
        self.stream.write(f"{self.label}: done in {elapsed:.1f} s{note}\n")
        self.stream.flush()
