"""Work whose cost a file decides, run where it can be stopped.

A chat template comes with the model and a ``target_modules`` regex with a
LoRA adapter; either can run for ever (a template's loops, a regex's
backtracking), and a Python thread cannot be stopped: Python's ``re``
even holds the GIL for a whole match, so the event loop stops with it.
Such work runs here instead, in a child process (``python -m
trioserve.models.bounded``) that is killed when the work is late:

- a deadline: the waiting thread kills the child when it passes; the
  child also arms SIGALRM a little later, so it dies on its own if its
  parent is gone;
- a memory limit (RLIMIT_AS, set by the child before each job): running
  out is a MemoryError there, reported as an overrun;
- an output limit, checked by the job itself as it produces output, and
  by the reader before it reads a reply;
- an interruption: the waiting thread polls `set_interrupt_check`'s
  function every POLL_S (the HTTP layer installs one that raises
  trio.Cancelled once the request that waits was cancelled), and kills
  the child before letting it propagate.

Children are kept (at most MAX_IDLE of them) and reused for the next job;
one killed is replaced by a fresh one on the next call. The jobs:

- ``{"op": "compile", "source"}``: a chat template compiled (Jinja
  evaluates constant expressions while compiling); ``{}`` or ``{"error"}``.
- ``{"op": "render", "source", "context", "output_limit"}``: a chat
  template (models/chat_template.py's sandbox) rendered with ``context``;
  the reply is ``{"text"}``, ``{"error"}`` (the template failed or
  refused), or an overrun.
- ``{"op": "fullmatch", "pattern", "names"}``: which ``names`` the regex
  matches whole; ``{"matches": [bool, ...]}`` or ``{"error"}`` (the
  pattern does not compile).

No trio here (models/ has none): the waiting is a blocking call, made
from a worker thread by the routes."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trioserve.errors import TrioserveError

POLL_S = 0.05  # how often a waiting thread looks at its deadline and its interruption
MAX_IDLE = 4  # children kept for the next job
ALARM_GRACE_S = 2.0  # a child outliving its deadline by this much kills itself
_HEADER = struct.Struct("<Q")  # each message: its length, then that much UTF-8 JSON


class Overrun(TrioserveError):
    """Work stopped because it ran past its budget. ``kind`` says which:
    "time" (killed at the deadline), "memory", "output", or "crash" (the
    child died on its own)."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


_interrupt_check: Callable[[], None] | None = None


def set_interrupt_check(check: Callable[[], None] | None) -> None:
    """Install the function every waiting thread calls every POLL_S; what it
    raises (trio.Cancelled, for a request that was cancelled) ends the wait:
    the child is killed, and the exception propagates unchanged."""
    global _interrupt_check
    _interrupt_check = check


class _Child:
    """One child process and its pipes; used by one thread at a time."""

    def __init__(self) -> None:
        package_root = str(Path(__file__).resolve().parent.parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trioserve.models.bounded"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
            close_fds=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        with _lock:
            _live.add(self)
        self._in = self.process.stdin.fileno()
        self._out = self.process.stdout.fileno()

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, payload: bytes) -> None:
        _write_all(self._in, _HEADER.pack(len(payload)) + payload)

    def receive(self, timeout_s: float, limit: int, what: str) -> dict[str, Any]:
        """The child's reply, waiting at most ``timeout_s``; Overrun when it
        is late, too long or the child is gone."""
        deadline = time.monotonic() + timeout_s
        late = f"{what} ran for more than {timeout_s:g} s and was stopped"
        header = self._read(_HEADER.size, deadline, what, late)
        (size,) = _HEADER.unpack(header)
        if size > limit:
            raise Overrun("output", f"{what} produced {size} bytes, more than its limit of {limit}")
        return json.loads(self._read(size, deadline, what, late))

    def _read(self, size: int, deadline: float, what: str, late: str) -> bytes:
        poller = select.poll()
        poller.register(self._out, select.POLLIN | select.POLLHUP | select.POLLERR)
        parts: list[bytes] = []
        got = 0
        while got < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Overrun("time", late)
            ready = poller.poll(min(left, POLL_S) * 1000)
            check = _interrupt_check
            if check is not None:
                check()
            if not ready:
                continue
            chunk = os.read(self._out, min(size - got, 1 << 20))
            if not chunk:
                status = self.process.wait()
                raise Overrun("crash", f"{what} ended its worker process (exit status {status})")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self._close_pipes()
        with _lock:
            _live.discard(self)

    def close(self) -> None:
        """Let an idle child end (it exits when its input ends)."""
        self._close_pipes()
        self.process.wait()
        with _lock:
            _live.discard(self)

    def _close_pipes(self) -> None:
        self.process.stdin.close()  # unbuffered: nothing left to flush
        self.process.stdout.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


_lock = threading.Lock()
_idle: list[_Child] = []
_live: set[_Child] = set()  # every child not yet ended, busy or idle


def _take() -> _Child:
    while True:
        with _lock:
            child = _idle.pop() if _idle else None
        if child is None:
            return _Child()
        if child.alive():
            return child
        child.close()  # ended since (killed from outside): reaped and forgotten


def _give_back(child: _Child) -> None:
    with _lock:
        if len(_idle) < MAX_IDLE:
            _idle.append(child)
            return
    child.close()


def close_idle() -> None:
    """End the idle children (at exit, so none outlives the process)."""
    with _lock:
        children = _idle[:]
        _idle.clear()
    for child in children:
        child.close()


atexit.register(close_idle)


def kill_all() -> None:
    """Kill every child, busy ones too (a process about to end at once)."""
    with _lock:
        children = list(_live)
    for child in children:
        child.process.kill()


def run(job: dict[str, Any], *, timeout_s: float, memory_bytes: int, reply_limit: int, what: str) -> dict[str, Any]:
    """``job``'s reply from a child process (see the module's docstring).
    Blocking. Overrun when the job runs past ``timeout_s`` seconds, past
    ``memory_bytes`` of memory beyond the child's own, or its reply past
    ``reply_limit`` bytes; ``what`` names the work in Overrun's message.
    What the interrupt check raises propagates; the child is killed."""
    payload = json.dumps({**job, "timeout_s": timeout_s, "memory_bytes": memory_bytes}, ensure_ascii=False).encode("utf-8")
    try:
        child = _take()
    except OSError as exc:  # no process to be had (out of processes, of memory)
        raise Overrun("crash", f"{what} could not start a worker process: {exc}") from exc
    ok = False
    try:
        try:
            child.send(payload)
        except OSError:  # an idle child gone since (killed from outside): one fresh try
            child.kill()
            try:
                child = _Child()
                child.send(payload)
            except OSError as exc:
                raise Overrun("crash", f"{what} could not start a worker process: {exc}") from exc
        reply = child.receive(timeout_s, reply_limit, what)
        ok = True
    finally:
        if ok:
            _give_back(child)
        else:
            child.kill()
    overrun = reply.get("overrun")
    if overrun is not None:
        raise Overrun(overrun, f"{what} {reply['message']}")
    return reply


# -- the child's side -------------------------------------------------------------


def _render_job(job: dict[str, Any]) -> dict[str, Any]:
    from trioserve.models.chat_template import render_in_child

    return render_in_child(job["source"], job["context"], job["output_limit"])


def _compile_job(job: dict[str, Any]) -> dict[str, Any]:
    from trioserve.models.chat_template import compile_in_child

    return compile_in_child(job["source"])


def _fullmatch_job(job: dict[str, Any]) -> dict[str, Any]:
    import re

    try:
        pattern = re.compile(job["pattern"])
    except re.error as exc:
        return {"error": f"not a valid regular expression: {exc}"}
    return {"matches": [pattern.fullmatch(name) is not None for name in job["names"]]}


_JOBS = {"compile": _compile_job, "render": _render_job, "fullmatch": _fullmatch_job}


def _address_space() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _limit_memory(extra: int | None) -> None:
    """Limit the address space to what it is now plus ``extra`` bytes;
    None: lift the limit (to the hard one) between jobs."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = hard if extra is None else _address_space() + extra
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _read_exactly(fd: int, size: int) -> bytes | None:
    parts = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            return None
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


def _child_main() -> None:
    """Answer jobs on stdin/stdout until stdin ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle; it kills us
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # nothing a job prints can corrupt a reply
    while True:
        header = _read_exactly(0, _HEADER.size)
        if header is None:
            return
        body = _read_exactly(0, _HEADER.unpack(header)[0])
        if body is None:
            return
        job = json.loads(body)
        del body
        signal.setitimer(signal.ITIMER_REAL, job["timeout_s"] + ALARM_GRACE_S)  # SIGALRM's default: the process ends
        try:
            _limit_memory(job["memory_bytes"])
            data = json.dumps(_JOBS[job["op"]](job), ensure_ascii=False).encode("utf-8")
        except MemoryError:
            data = json.dumps({"overrun": "memory", "message": f"ran out of its memory ({job['memory_bytes'] >> 20} MiB)"}).encode()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _limit_memory(None)
        del job
        _write_all(reply_fd, _HEADER.pack(len(data)) + data)


if __name__ == "__main__":
    _child_main()
