"""Every message the actors exchange, as frozen attrs records, plus the
events a request's consumer receives. Reply paths travel inside messages."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import attrs
import torch
import trio

from trioserve.models.guided import Guide
from trioserve.models.sampling import Row, Sampled, SamplingParams
from trioserve.models.step import SeqChunk


# -- what a caller asks for and receives --------------------------------------
@attrs.frozen
class GenerateRequest:
    """draw_start: the first draw index of this request's random stream; a
    session's turn continues where its last committed turn stopped.
    retain: an owner (a session id) for whom the finished request's KV is
    held until `Engine.settle_retained` commits or drops it."""

    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    params: SamplingParams = SamplingParams()
    request_id: str | None = None
    draw_start: int = 0
    retain: str | None = None
    guide: Guide | None = attrs.field(default=None, eq=False)  # this request's own output constraint


@attrs.frozen
class TokenEvent:
    request_id: str
    token_id: int
    text: str  # text that became final with this token ('' while held back)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class Timings:
    queue_s: float | None  # arrival to admission
    ttft_s: float | None  # arrival to first token
    total_s: float  # arrival to the end


@attrs.frozen
class FinalEvent:
    """The last event of every request. ``text`` is output that was held back
    until the end (a possible stop string's start, an unfinished character)."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    usage: Usage
    seed: int
    text: str = ""
    error: str | None = None
    timings: Timings | None = None
    draw_end: int = 0  # the next unused draw index of the request's stream


Event = TokenEvent | FinalEvent


# -- scheduler inbox -----------------------------------------------------------
@attrs.frozen
class Submit:
    request_id: str
    request: GenerateRequest
    events: trio.MemorySendChannel  # bounded by max_tokens + 2: publishing never blocks
    reply: trio.MemorySendChannel  # one message: None (accepted) or the exception refusing it


@attrs.frozen
class Cancel:
    request_id: str


# -- worker inbox --------------------------------------------------------------
@attrs.frozen
class StepRequest:
    chunks: tuple[SeqChunk, ...]
    sample_rows: tuple[int, ...]  # rows whose logits are wanted
    reply: trio.MemorySendChannel


@attrs.frozen
class StepReply:
    logits: torch.Tensor | None  # [len(sample_rows), vocab] fp32
    refused: str | None = None  # the step did not run: only its rows fail
    fatal: str | None = None  # the step may have half-run: the engine is dead
    seconds: float = 0.0


# -- sampler inbox -------------------------------------------------------------
@attrs.frozen
class SampleRequest:
    logits: torch.Tensor
    rows: Seq[Row]
    reply: trio.MemorySendChannel
    masks: torch.Tensor | None = None  # int32 bitmask [rows, words] of allowed tokens (guided decoding)


@attrs.frozen
class SampleReply:
    sampled: list[Sampled] | None
    error: str | None = None


def deliver(channel: trio.MemorySendChannel, message) -> bool:
    """Hand ``message`` to a reply channel without waiting. False when the
    asker stopped waiting (its end is closed): there is no one to tell."""
    try:
        channel.send_nowait(message)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        return False
    return True
