"""Splitting a model's output text into answer, reasoning and tool calls, as
it streams. Pure Python; one parser per choice.

The text arrives in pieces of any size (a token's worth, a character, a
chunk). Three channels come out:

- content: everything that is neither of the below;
- reasoning: text between ``<think>`` and ``</think>``;
- tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  each parsed into a name and its arguments as a JSON string.

A marker may be split across pieces, so the parser holds back only the
longest tail of the text that could still grow into a marker; everything
before it goes out at once. A call is reported whole when its closing tag
arrives (or when the output ends with a parseable call whose tag never
came); a call that does not parse is given back as plain content, tags and
all, so nothing the model wrote is lost and nothing fails.

The streamed deltas and the final result come from the same state: the
concatenated content deltas equal ``result().content`` and so on."""

from __future__ import annotations

import json
from collections.abc import Iterable

import attrs

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_DECODER = json.JSONDecoder()
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@attrs.frozen
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI sends arguments as a string)


@attrs.frozen
class Delta:
    """One piece of output for one channel: ``content`` or ``reasoning`` text,
    or one complete ``tool_call``."""

    content: str = ""
    reasoning: str = ""
    tool_call: ToolCall | None = None


@attrs.frozen
class Parsed:
    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]


def _held_tail(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as compact JSON) from a call's JSON text, or None."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


class OutputParser:
    def __init__(self, *, tools: bool, reasoning: bool, call_id_prefix: str = "call") -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.call_id_prefix = call_id_prefix
        self._mode = "content"  # or "reasoning", "call"
        self._pending = ""  # text not yet given out
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self._spaces = ""  # whitespace-only content held back (see _emit)

    def _openers(self) -> list[str]:
        return [m for m, on in ((THINK_OPEN, self.reasoning), (CALL_OPEN, self.tools)) if on]

    def feed(self, text: str) -> list[Delta]:
        """Take the next piece of output; return what became certain."""
        self._pending += text
        out: list[Delta | None] = []
        while True:
            if self._mode == "call":
                end = self._call_end()
                if end is None:
                    return [d for d in out if d is not None]
                body, self._pending = self._pending[:end], self._pending[end + len(CALL_CLOSE) :]
                self._mode = "content"
                out.append(self._close_call(body, raw=CALL_OPEN + body + CALL_CLOSE))
                continue
            closers = [THINK_CLOSE] if self._mode == "reasoning" else self._openers()
            hit = min(((self._pending.find(m), m) for m in closers if m in self._pending), default=None)
            if hit is None:
                keep = _held_tail(self._pending, closers)
                certain = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(certain) :]
                if certain:
                    out.append(self._emit(certain))
                return [d for d in out if d is not None]
            at, marker = hit
            if at:
                out.append(self._emit(self._pending[:at]))
            self._pending = self._pending[at + len(marker) :]
            self._mode = {THINK_OPEN: "reasoning", THINK_CLOSE: "content", CALL_OPEN: "call"}[marker]

    def _call_end(self) -> int | None:
        """Where the closing tag that ends the call being read starts, or
        None while it may still be coming. The call's JSON is read first, so
        a closing tag inside one of its strings does not end it; after JSON
        that does not parse, the first closing tag does."""
        text = self._pending
        start = len(text) - len(text.lstrip())
        search_from = start
        try:
            _, after = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            if exc.pos >= len(text) or exc.msg.startswith("Unterminated string"):
                return None  # the JSON is not complete yet
        else:
            gap = len(text) - after - len(text[after:].lstrip())
            tail = text[after + gap :]
            if tail.startswith(CALL_CLOSE):
                return after + gap
            if CALL_CLOSE.startswith(tail):
                return None  # the tag may be on its way
            search_from = after
        at = text.find(CALL_CLOSE, search_from)
        return at if at >= 0 else None

    def finish(self) -> list[Delta]:
        """The output ended: give out what was held back. An unclosed call
        that parses is still a call; one that does not is content, and so is
        whitespace that no content followed, when there are calls."""
        out: list[Delta | None] = []
        rest, self._pending = self._pending, ""
        if self._mode == "call":
            at = rest.find(CALL_CLOSE)
            self._mode = "content"
            if at >= 0:  # a malformed call, then more text
                out.append(self._close_call(rest[:at], raw=CALL_OPEN + rest[: at + len(CALL_CLOSE)]))
                out += self.feed(rest[at + len(CALL_CLOSE) :])
                return out + self.finish()
            out.append(self._close_call(rest.rstrip(), raw=CALL_OPEN + rest))
        elif rest:
            out.append(self._emit(rest))
        self._mode = "content"
        if self._spaces and not self._calls:
            out.append(self._release_spaces(""))
        self._spaces = ""
        return [d for d in out if d is not None and (d.content or d.reasoning or d.tool_call)]

    def result(self) -> Parsed:
        return Parsed("".join(self._content), "".join(self._reasoning), tuple(self._calls))

    def _emit(self, text: str) -> Delta | None:
        if self._mode == "reasoning":
            self._reasoning.append(text)
            return Delta(reasoning=text)
        # Trailing whitespace (before a call, between calls) waits for more
        # content; if none comes and there are calls, it is dropped. However
        # the text is cut, the same whitespace is held.
        combined = self._spaces + text
        kept = combined.rstrip()
        self._spaces = combined[len(kept) :]
        if not kept:
            return None
        self._content.append(kept)
        return Delta(content=kept)

    def _release_spaces(self, text: str) -> Delta:
        text, self._spaces = self._spaces + text, ""
        self._content.append(text)
        return Delta(content=text)

    def _close_call(self, body: str, *, raw: str) -> Delta:
        parsed = parse_call(body.strip())
        if parsed is None:
            return self._release_spaces(raw)
        call = ToolCall(len(self._calls), f"{self.call_id_prefix}-{len(self._calls)}", *parsed)
        self._calls.append(call)
        return Delta(tool_call=call)


def merge(deltas: Iterable[Delta]) -> Parsed:
    """What a client gets by concatenating streamed deltas."""
    content, reasoning, calls = [], [], []
    for d in deltas:
        content.append(d.content)
        reasoning.append(d.reasoning)
        if d.tool_call is not None:
            calls.append(d.tool_call)
    return Parsed("".join(content), "".join(reasoning), tuple(calls))
