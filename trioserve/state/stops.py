"""Stop strings over streamed text. Pure Python: no torch, no trio.

Generated text arrives one piece per token. `StopMatcher` publishes each
piece as soon as no stop string can still begin inside it, holds back the
rest, and ends the output before the earliest-starting stop string — with the
same result however the text was cut into pieces.

Matching runs an Aho–Corasick automaton over the stop strings, one character
at a time, so a push costs O(len(piece) + longest stop) and the matcher keeps
only the held-back tail, never the whole output. Building the automaton costs
one node per character of the stop strings (the HTTP schemas bound them); it
is never changed once built, so matchers with the same stops — the choices
of one request, or requests that share their stops — share one.

One case needs care: a short stop can complete inside a longer one that began
earlier (stops "abcd" and "bc", text "abc"). The earliest start wins, so the
matcher cannot end the output until the longer stop has either completed or
failed; until then the short match stays held back. Should the output end in
that state, `flush` resolves it: it returns the text before the short match
and sets `matched`."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence

# Stop sets up to this many characters in all are kept for reuse (a few
# dozen of them, the most recently used); larger ones are built per matcher.
_SHARED_CHARS = 4096


class _Automaton:
    """Trie of the stop strings with failure links. Node 0 is the root; every
    node stands for one prefix of some stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.children: list[dict[str, int]] = [{}]
        self.fail = [0]
        self.depth = [0]
        # The longest stop string that is a suffix of this node's prefix.
        self.out: list[str | None] = [None]
        # Length of the longest suffix of this node's prefix that is a proper
        # prefix of some stop string, i.e. what must be held back here.
        self.live = [0]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self.children[node].get(ch)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][ch] = nxt
                    self.children.append({})
                    self.fail.append(0)
                    self.depth.append(self.depth[node] + 1)
                    self.out.append(None)
                    self.live.append(0)
                node = nxt
            self.out[node] = stop
        # Breadth first, so a node's failure target is finished before it.
        queue = deque(self.children[0].values())
        while queue:
            node = queue.popleft()
            fail = self.fail[node]
            if self.out[node] is None:
                self.out[node] = self.out[fail]
            self.live[node] = self.depth[node] if self.children[node] else self.live[fail]
            for ch, child in self.children[node].items():
                target = fail
                while target and ch not in self.children[target]:
                    target = self.fail[target]
                self.fail[child] = self.children[target].get(ch, 0)
                queue.append(child)

    def step(self, node: int, ch: str) -> int:
        while node and ch not in self.children[node]:
            node = self.fail[node]
        return self.children[node].get(ch, 0)


@functools.lru_cache(maxsize=32)
def _shared(stops: tuple[str, ...]) -> _Automaton:
    return _Automaton(stops)


def _automaton(stops: Sequence[str]) -> _Automaton:
    stops = tuple(stops)
    if sum(map(len, stops)) <= _SHARED_CHARS:
        return _shared(stops)
    return _Automaton(stops)


class StopMatcher:
    """Watches one output stream for any of ``stops``. Call `push` with each
    piece of text; call `flush` when the output ends without a stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not one string")
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self._auto = _automaton(stops)
        self._node = 0
        self._pos = 0  # characters pushed so far
        self._held = ""  # unpublished text: the last len(_held) characters
        self._best: tuple[int, str] | None = None  # earliest completed match (start, stop)
        self._matched: str | None = None
        self._done = False

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._matched

    @property
    def held(self) -> int:
        """How many characters are held back, unpublished."""
        return len(self._held)

    def push(self, text: str) -> tuple[str, bool]:
        """Take the next piece. Returns the text now safe to publish and
        whether a stop string ended the output; once it has, the text from the
        stop on is dropped and further pushes raise RuntimeError."""
        if self._done:
            raise RuntimeError("push after the output ended (stopped or flushed)")
        auto = self._auto
        node, pos, best = self._node, self._pos, self._best
        for ch in text:
            node = auto.step(node, ch)
            pos += 1
            stop = auto.out[node]
            if stop is not None:
                start = pos - len(stop)
                if best is None or start < best[0]:
                    best = (start, stop)
        self._node, self._pos, self._best = node, pos, best

        buf = self._held + text
        buf_start = pos - len(buf)
        live_start = pos - auto.live[node]
        # No stop can begin before live_start any more, so a completed match
        # at or before it is the earliest there will ever be.
        if best is not None and best[0] <= live_start:
            return self._finish(buf[: best[0] - buf_start], best[1]), True
        cut = live_start - buf_start
        self._held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """The output ended: return the text still held back. If a completed
        match was waiting on a longer stop that began earlier, the output ends
        before that match instead and `matched` is set. Later pushes raise
        RuntimeError; a second flush returns ""."""
        if self._done:
            return ""
        if self._best is not None:
            start, stop = self._best
            return self._finish(self._held[: start - (self._pos - len(self._held))], stop)
        return self._finish(self._held, None)

    def _finish(self, text: str, stop: str | None) -> str:
        self._done = True
        self._held = ""
        self._matched = stop
        return text
