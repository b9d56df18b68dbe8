"""The device thread: one OS thread that runs all of an engine's torch work
(building the model, every forward step, every sampling step), reached
from trio by `DeviceThread.run`.

Why one thread and not trio's thread cache. torch's CPU kernels run on
OpenMP, and OpenMP (libgomp, which torch ships) gives every OS thread that
starts parallel work a pool of helper threads of its own. As soon as a
process has more such helpers than CPUs, libgomp stops letting them
busy-wait between parallel regions, and each of the few hundred small
regions of a decode step then pays a wake-up: a one-row step of the
default model measured 15 ms on a second thread against 7 ms on the first
(bench/README.md, "Performance"). So the engine's torch work stays on one
thread, and `release_openmp_threads` frees the helpers of any other thread
that did torch work (the thread that opens the engine; the one `serve`
loads the checkpoint in, through `without_openmp_helpers`): a thread keeps
its helpers for as long as it lives, and trio's cached threads live on.

Each call's function runs to its end: like `trio.to_thread.run_sync`, a
cancelled caller waits for it (threads cannot be interrupted), then sees
the cancellation."""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

# How long closing waits for a step that is still running (seconds).
JOIN_TIMEOUT_S = 30.0


class DeviceThread:
    def __init__(self, name: str = "trioserve-device") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, done = job
            try:
                result = (True, fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                result = (False, exc)
            done(result)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the device thread; its result, or its exception
        raised here. Waits for it even when cancelled, then raises Cancelled."""
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        box: list[tuple[bool, Any]] = []

        def done(result: tuple[bool, Any]) -> None:
            box.append(result)
            token.run_sync_soon(finished.set)

        self._jobs.put((fn, args, done))
        with trio.CancelScope(shield=True):
            await finished.wait()
        await trio.lowlevel.checkpoint_if_cancelled()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Stop after the jobs already given; blocks until then (or ``timeout``)."""
        self._jobs.put(None)
        self._thread.join(timeout)


async def run_blocking(device: DeviceThread | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on ``device``, or in trio's worker threads without one."""
    if device is None:
        return await trio.to_thread.run_sync(fn, *args)
    return await device.run(fn, *args)


@contextlib.asynccontextmanager
async def open_device_thread() -> AsyncIterator[DeviceThread]:
    """A device thread for the duration; on exit it finishes what it was
    given and ends (the join runs in a trio thread, so the loop stays free)."""
    device = DeviceThread()
    try:
        yield device
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(device.close)


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP helper threads, if it has any
    (OpenMP 5's omp_pause_resource_all, in the libgomp torch loaded). True
    when the call was made and succeeded; False where there is no such
    library or function. torch works on afterwards: a thread that starts
    parallel work again gets new helpers."""
    try:
        # Only a libgomp already loaded (torch's): never load one for this.
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(2) == 0  # omp_pause_hard


def without_openmp_helpers(fn: Callable[[], T]) -> T:
    """``fn()``, then the calling thread's OpenMP helpers released: for torch
    work done outside the device thread (loading a checkpoint in one of
    trio's threads, which then live on serving other jobs)."""
    try:
        return fn()
    finally:
        release_openmp_threads()
