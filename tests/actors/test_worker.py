"""The worker's heap trimmer: at most one malloc_trim per interval, between
steps, and none when disabled."""

from __future__ import annotations

import sys

import pytest

from trioserve.actors.worker import HeapTrimmer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trims_once_per_interval():
    clock = Clock()
    trimmer = HeapTrimmer(10.0, clock=clock)
    assert not trimmer.due()  # not right at start
    clock.now += 9.9
    assert not trimmer.due()
    clock.now += 0.2
    assert trimmer.due()
    trimmer.trim()
    assert trimmer.trims == 1
    assert not trimmer.due()  # the next one is an interval after this trim
    clock.now += 10.0
    assert trimmer.due()


def test_interval_zero_never_trims():
    clock = Clock()
    trimmer = HeapTrimmer(0.0, clock=clock)
    clock.now += 1e6
    assert not trimmer.due()
