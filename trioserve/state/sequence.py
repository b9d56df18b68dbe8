"""One request as the scheduler tracks it: its tokens, how many of them are in
the KV cache, its random-draw position, and the text it has produced. Plain
Python; owned by the scheduler alone."""

from __future__ import annotations

from collections.abc import Collection

import attrs

from trioserve.state.stops import StopMatcher
from trioserve.types import Guide, PromptLogprob, SamplingParams, TextDecoder


@attrs.frozen
class Commit:
    """What committing one sampled token produced: text safe to publish now,
    and the finish reason when this token ended the output."""

    text: str
    finish_reason: str | None = None


@attrs.define(eq=False)
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: Collection[int]
    detokenizer: TextDecoder
    stops: StopMatcher
    arrival: float
    output_ids: list[int] = attrs.field(factory=list)
    generated: int = 0  # tokens sampled, the one that ended the output included
    num_cached: int = 0  # tokens of prompt + output already in the KV cache
    cached_prompt: int = 0  # of the prompt, tokens the prefix cache held at admission (usage's cached_tokens)
    draw_index: int = 0
    cancelled: bool = False
    error: str | None = None  # cancelled as failed, with this cause (EngineCore.cancel)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    retain: str | None = None  # owner (a session) that keeps this sequence's KV when it commits
    guide: Guide | None = None  # the output constraint, if any
    # An embedding request (types.GenerateRequest.pooling): "last" or
    # "mean", the fixed-point sums pooled so far and how many rows they hold.
    pooling: str | None = None
    adapter: str | None = None  # the LoRA adapter's key (types.GenerateRequest.adapter); its KV is its own
    cache_salt: str | None = None  # its prefix-cache salt (types.GenerateRequest.cache_salt)
    tenant: str | None = None  # whose request it is (types.GenerateRequest.tenant): the prefill budget is shared between tenants
    pool_sums: list[int] | None = None
    pooled_rows: int = 0
    # A scored prompt (SamplingParams.prompt_logprobs): its tokens' scores
    # so far, from the first chunk on; None when the prompt is not scored.
    prompt_scores: list[PromptLogprob] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total(self) -> int:
        """Most tokens this sequence can ever hold: the KV room it reserves
        (an embedding request generates nothing)."""
        return len(self.prompt_ids) + (0 if self.pooling is not None else self.params.max_tokens)

    def pending(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that are not in the cache yet, in order."""
        start = self.num_cached
        prompt_len = len(self.prompt_ids)
        if start < prompt_len:
            return self.prompt_ids[start : start + limit]
        return self.output_ids[start - prompt_len : start - prompt_len + limit]

    def history(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def commit(self, token: int, draws: int, now: float) -> Commit:
        """Take one sampled token: advance the draw index, decide whether the
        output ends here (stop id, stop string, max_tokens) and return the
        text that became safe to publish."""
        self.draw_index += draws
        self.generated += 1
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        if token in self.stop_ids:
            text, _ = self._drain()
            return Commit(text, "stop")
        self.output_ids.append(token)
        text, stopped = self.stops.push(self.detokenizer.push(token))
        if stopped:
            return Commit(text, "stop")
        if self.guide is not None and self.guide.done:
            tail, _ = self._drain()  # the constraint is complete: only a stop token could follow
            return Commit(text + tail, "stop")
        if self.generated >= self.params.max_tokens:
            tail, stopped = self._drain()
            return Commit(text + tail, "stop" if stopped else "length")
        return Commit(text)

    def _drain(self) -> tuple[str, bool]:
        """End of output: release bytes the detokenizer holds and text the
        stop matcher holds back. True when that completes a stop string."""
        text, stopped = self.stops.push(self.detokenizer.flush())
        if stopped:
            return text, True
        # flush() can still settle a short stop nested in a longer one that
        # could have completed (stops "abcd" and "bc", output ending "abc").
        text += self.stops.flush()
        return text, self.stops.matched is not None
