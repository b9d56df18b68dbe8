"""OpenAI response shapes: whole bodies, stream chunks and logprobs, built
from the engine's events. Pure functions of their inputs."""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Sequence

import attrs

from trioserve import __version__
from trioserve.types import FinalEvent, PromptEvent, TokenEvent
from trioserve.models.output_parser import THINK_CLOSE, Delta, OutputParser, Parsed, ToolCall
from trioserve.models.tokenizer import Tokenizer

FINGERPRINT = f"trioserve-{__version__}"


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


# Characters that JSON leaves raw (ensure_ascii=False) but that line readers
# built on str.splitlines take for line ends: httpx's `aiter_lines`, for one,
# cuts an event's `data:` line at a generated U+0085, U+2028 or U+2029. SSE
# ends lines only at CR and LF, so the event is valid either way; written as
# JSON escapes (the same text once parsed) it reaches such clients whole.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKERS)
    return f"data: {data}\n\n".encode()


def _finite(x: float) -> float:
    # JSON has no -Infinity; a token the model rules out gets the most negative float.
    return x if math.isfinite(x) else -3.4e38


@attrs.define
class Choice:
    """One choice's output, accumulated from its events. With a ``parser``
    the text is split into content, reasoning and tool calls as it comes."""

    index: int
    parser: OutputParser | None = None
    text: list[str] = attrs.field(factory=list)
    tokens: list[TokenEvent] = attrs.field(factory=list)
    final: FinalEvent | None = None
    prompt: PromptEvent | None = None  # the prompt's scores, when asked for

    def add(self, event) -> list[Delta]:
        """Take one event; return the output it made certain."""
        if isinstance(event, PromptEvent):
            self.prompt = event
            return []
        if isinstance(event, TokenEvent):
            self.tokens.append(event)
        else:
            self.final = event
        self.text.append(event.text)
        if self.parser is None:
            return [Delta(content=event.text)] if event.text else []
        deltas = self.parser.feed(event.text)
        if isinstance(event, FinalEvent):
            deltas += self.parser.finish()
        return deltas

    @property
    def scored(self) -> list[TokenEvent]:
        """Every generated token, for logprobs: the output's, then the stop
        token that ended the choice, if one did (its text is not output)."""
        stop = self.final.stop_token if self.final is not None else None
        return self.tokens if stop is None else [*self.tokens, stop]

    @property
    def content(self) -> str:
        """The raw text the model produced (tags and all)."""
        return "".join(self.text)

    @property
    def reasoning_tokens(self) -> int:
        """Usage's completion_tokens_details.reasoning_tokens: the generated
        tokens through the one whose text completes the reasoning's closing
        tag (all of them while it is open); 0 without reasoning."""
        if self.parser is None or not self.parsed().reasoning:
            return 0
        raw = self.content
        close = raw.find(THINK_CLOSE)
        end = len(raw) if close < 0 else close + len(THINK_CLOSE)
        reached = 0
        for count, token in enumerate(self.tokens, start=1):
            reached += len(token.text)
            if reached >= end:
                return count
        return self.final.usage.completion_tokens if self.final is not None else len(self.tokens)

    def parsed(self) -> Parsed:
        return self.parser.result() if self.parser is not None else Parsed(self.content, "", ())

    @property
    def finish_reason(self) -> str:
        """"tool_calls" when calls end a turn that stopped by itself; a cut
        (length) stays a cut even if a call was recovered from it."""
        reason = self.final.finish_reason
        return "tool_calls" if reason == "stop" and self.parsed().tool_calls else reason

    def message(self) -> dict:
        """The assistant message: content, reasoning_content and tool_calls."""
        parsed = self.parsed()
        out: dict = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            out["content"] = parsed.content if parsed.content.strip() else None
            out["tool_calls"] = [tool_call_body(c) for c in parsed.tool_calls]
        if parsed.reasoning:
            out["reasoning_content"] = parsed.reasoning
        return out


def tool_call_body(call: ToolCall, *, with_index: bool = False) -> dict:
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **body} if with_index else body


def delta_body(delta: Delta) -> dict:
    """A chat chunk's delta for one piece of parsed output."""
    if delta.tool_call is not None:  # a call comes whole, so this is its first chunk: content null, as OpenAI's
        return {"content": None, "tool_calls": [tool_call_body(delta.tool_call, with_index=True)]}
    if delta.reasoning:
        return {"reasoning_content": delta.reasoning}
    return {"content": delta.content}


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprob_entries(tokenizer: Tokenizer, events: Sequence[TokenEvent]) -> list[dict]:
    """OpenAI chat logprobs: one entry per token, with its alternatives."""
    out = []
    for e in events:
        text, raw = token_text(tokenizer, e.token_id)
        alternatives = []
        for tid, lp in e.top_logprobs:
            alt_text, alt_raw = token_text(tokenizer, tid)
            alternatives.append({"token": alt_text, "logprob": _finite(lp), "bytes": alt_raw})
        out.append({"token": text, "logprob": _finite(e.logprob), "bytes": raw, "top_logprobs": alternatives})
    return out


def completion_logprobs(
    tokenizer: Tokenizer, events: Sequence[TokenEvent], offset: int, prompt: tuple[Sequence[int], PromptEvent, int] | None = None
) -> dict:
    """The legacy completions logprobs object. With ``prompt`` (an echoed
    prompt's ids, their scores and how many alternatives to list), the
    prompt's tokens come first, as OpenAI's legacy API gives them: the
    first with null for its logprob and its alternatives, text offsets from
    0; the generated tokens' offsets start at ``offset`` all the same."""
    tokens, lps, tops, offsets = [], [], [], []
    if prompt is not None:
        ids, scored, top = prompt
        at = 0
        for i, token in enumerate(ids):
            text, _ = token_text(tokenizer, token)
            tokens.append(text)
            offsets.append(at)
            at += len(text)
            if i == 0:
                lps.append(None)
                tops.append(None)
                continue
            p = scored.logprobs[i - 1]
            lps.append(_finite(p.logprob))
            tops.append({token_text(tokenizer, t)[0]: _finite(lp) for t, lp in p.top[:top]})
    at = offset
    for e in events:
        text, _ = token_text(tokenizer, e.token_id)
        tokens.append(text)
        lps.append(_finite(e.logprob))
        tops.append({token_text(tokenizer, t)[0]: _finite(lp) for t, lp in e.top_logprobs})
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_body(tokenizer: Tokenizer, scored: PromptEvent, top: int) -> list:
    """vLLM's prompt_logprobs: null for the first prompt token, then for
    each later one a dict from token id (a string, as JSON keys are) to its
    logprob, rank and text: the prompt's token first, then the ``top``
    likeliest there (rank 1 first), the prompt's token among them at most once."""
    out: list = [None]
    for p in scored.logprobs:
        entry = {str(p.token): _prompt_entry(tokenizer, p.token, p.logprob, p.rank)}
        for rank, (token, lp) in enumerate(p.top[:top], start=1):
            entry.setdefault(str(token), _prompt_entry(tokenizer, token, lp, rank))
        out.append(entry)
    return out


def _prompt_entry(tokenizer: Tokenizer, token: int, logprob: float, rank: int) -> dict:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": token_text(tokenizer, token)[0]}


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object; with ``cached_tokens`` (prompt tokens whose KV
    was already held, from the prefix cache) its prompt_tokens_details, with
    ``reasoning_tokens`` its completion_tokens_details."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def envelope(kind: str, response_id: str, created: int, model: str) -> dict:
    return {"id": response_id, "object": kind, "created": created, "model": model, "system_fingerprint": FINGERPRINT}


def chat_body(
    response_id: str, created: int, model: str, choices: Sequence[Choice], prompt_tokens: int, tokenizer: Tokenizer, logprobs: bool,
    prompt_logprobs: int | None = None,
) -> dict:  # fmt: skip
    """A chat.completion; with ``prompt_logprobs`` (vLLM's field) the
    prompt's scores beside the choices, at the top level, as vLLM puts them."""
    body = envelope("chat.completion", response_id, created, model)
    body["choices"] = [
        {
            "index": c.index,
            "message": c.message(),
            "logprobs": {"content": chat_logprob_entries(tokenizer, c.scored)} if logprobs else None,
            "finish_reason": c.finish_reason,
        }
        for c in choices
    ]
    body["usage"] = usage_body(
        prompt_tokens, sum(c.final.usage.completion_tokens for c in choices), choices[0].final.usage.cached_tokens,
        sum(c.reasoning_tokens for c in choices),
    )  # fmt: skip
    if prompt_logprobs is not None and choices[0].prompt is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(tokenizer, choices[0].prompt, prompt_logprobs)
    return body


def chat_chunk(response_id: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> dict:
    body = envelope("chat.completion.chunk", response_id, created, model)
    choice = {"index": index, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish_reason}
    body["choices"] = [choice]
    return body


def completion_chunk(response_id: str, created: int, model: str, index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    body = envelope("text_completion", response_id, created, model)
    body["choices"] = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
    return body


def usage_chunk(
    kind: str, response_id: str, created: int, model: str, prompt_tokens: int, completion_tokens: int,
    cached_tokens: int | None = None, reasoning_tokens: int | None = None,
) -> dict:  # fmt: skip
    body = envelope(kind, response_id, created, model)
    body["choices"] = []
    body["usage"] = usage_body(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)
    return body
