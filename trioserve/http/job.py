"""The request spec: everything one HTTP request asks of the engine, as one
frozen record, built in one place by its route and never changed after.

A `GenerationJob` holds the prompts (each with its text, its token ids and
its sampling parameters, seed already resolved: trioserve/http/edge.py), how
many choices of each, and the output's shape:

    chat      /v1/chat/completions: chat.completion, or its chunks
    text      /v1/completions: text_completion, or its chunks
    response  /v1/responses: a response object, or its events
    message   /v1/messages: an Anthropic message, or its events
    turn      /v1/sessions/{id}/turns: a chat completion that continues the
              session's random stream and keeps its KV for the session

A connection (trioserve/http/connection.py) runs the job against the engine
and renders what comes back in its shape; a session's actor runs a turn's.
"""

from __future__ import annotations

import re
from typing import Literal

import attrs

from trioserve.http.edge import resolve_seed
from trioserve.models.guided import Guide
from trioserve.models.output_parser import OutputParser
from trioserve.types import GenerateRequest, SamplingParams

Shape = Literal["chat", "text", "response", "message", "turn"]
CHAT_SHAPES = ("chat", "response", "message", "turn")  # shapes whose output may be parsed into tool calls and reasoning


@attrs.frozen
class Prompt:
    """One prompt: its text (echoed by completions), its ids, and how to sample."""

    text: str
    ids: tuple[int, ...] = attrs.field(converter=tuple)
    params: SamplingParams


@attrs.frozen
class GenerationJob:
    """One request's generations. Choice i is choice i % n of prompt i // n
    (OpenAI's numbering for a completions request with several prompts).

    calls: tool calls are parsed out of the reply (tools offered).
    reasoning: <think> text is split out into reasoning.
    forced_call: tool_choice forces a call, so the reply can only be calls:
    a chat stream's role chunk then says content null, as OpenAI's does.
    draw_start, retain: a session turn's place in its random stream, and
    the session that keeps the turn's KV.
    prompt_logprobs: the request's vLLM field (how many likeliest tokens to
    list at each prompt position; None: not asked), rendered beside the
    choices; echo with logprobs renders the prompt's scores in the legacy
    logprobs instead (completions)."""

    id: str
    shape: Shape
    model: str
    created: int
    prompts: tuple[Prompt, ...] = attrs.field(converter=tuple)
    n: int = 1
    logprobs: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None
    guides: tuple[Guide | None, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple), eq=False)
    calls: bool = False
    reasoning: bool = False
    forced_call: bool = False
    stream: bool = False
    include_usage: bool = False
    draw_start: int = 0
    retain: str | None = None
    adapter: str | None = None  # the LoRA adapter's key its rows run with (registry.Adapter), None for the base model
    cache_salt: str | None = None  # the prefix cache's salt (edge.cache_salt: the tenant's, and the request's own)
    tenant: str | None = None  # whose request (edge.tenant): steps share their prefill budget between tenants

    def __attrs_post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("a job needs at least one prompt")
        if self.guides is not None and len(self.guides) != self.choices:
            raise ValueError(f"{len(self.guides)} guides for {self.choices} choices")

    @property
    def choices(self) -> int:
        return self.n * len(self.prompts)

    @property
    def request_id(self) -> str:
        """Choice 0's engine request (a session keeps its KV under this id)."""
        return f"{self.id}-0"

    @property
    def prompt_tokens(self) -> int:
        """Usage's prompt_tokens: every prompt's, once each (not per choice)."""
        return sum(len(p.ids) for p in self.prompts)

    def prompt(self, index: int) -> Prompt:
        return self.prompts[index // self.n]

    def scorer(self, index: int) -> int:
        """The choice that scores choice ``index``'s prompt (its first)."""
        return index - index % self.n

    def request(self, index: int) -> GenerateRequest:
        """Choice ``index``'s engine request. Its seed is the prompt's plus
        its place among the n choices, so every choice is reproducible."""
        prompt = self.prompt(index)
        guide = self.guides[index] if self.guides is not None else None
        params = prompt.params
        if index % self.n:
            # A prompt is scored once, by its first choice: the others render
            # those scores (completion_render.py) and may take the prompt's
            # KV from the prefix cache, which a scoring request cannot.
            params = attrs.evolve(params, seed=resolve_seed(params.seed, index % self.n), prompt_logprobs=None)
        if index == 0:
            return GenerateRequest(
                prompt.ids, params, self.request_id, draw_start=self.draw_start, retain=self.retain, guide=guide, adapter=self.adapter,
                cache_salt=self.cache_salt, tenant=self.tenant,
            )  # fmt: skip
        return GenerateRequest(prompt.ids, params, guide=guide, adapter=self.adapter, cache_salt=self.cache_salt, tenant=self.tenant)

    def parser(self, index: int) -> OutputParser | None:
        """Choice ``index``'s output parser, when there is anything to split
        out of a chat-shaped reply; None otherwise."""
        if self.shape not in CHAT_SHAPES or not (self.calls or self.reasoning):
            return None
        suffix = re.split("[-_]", self.id)[-1][:12]  # the id's random part (chatcmpl-..., resp_...)
        return OutputParser(tools=self.calls, reasoning=self.reasoning, call_id_prefix=f"call_{suffix}{index}")
