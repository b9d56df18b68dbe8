"""The plain types every layer shares: what a request asks for (its sampling
parameters, with each field's range written once), what one engine step
computes (a plan) and returns (a result), and what a request's consumer
receives (events). No torch, no trio, nothing that does I/O: `state/`,
`models/`, `core/`, the actors and the HTTP layer all import from here, so
none of them has to import another to share a record.

A step result carries a tuple of sampled tokens per row, so a step that
yields several tokens for one sequence (speculative decoding) fits the
same contract."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from trioserve.errors import TrioserveError

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# Stop strings are matched by an automaton built on the event loop, one node
# per character: the HTTP schemas bound each string and all of them together.
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_STOP_BYTES = 2048  # UTF-8 bytes in all of a request's stop strings
SEED_LIMIT = 2**63  # seeds are in [0, SEED_LIMIT)
# How an embedding request pools its prompt's final hidden states
# (GenerateRequest.pooling): the last token's, or the mean over all of them;
# or the first token's ([CLS]), for an encoder, whose input runs whole in one step;
# or "score": a cross-encoder's classification head on its first token, as values, not scaled.
POOLING_MODES = ("last", "mean", "first", "score")


@attrs.frozen
class Range:
    """A numeric field's allowed values: lo <= x <= hi, or lo < x <= hi
    when ``lo_open``. Only comparisons that hold let a value through, so NaN
    is never allowed."""

    lo: float
    hi: float
    lo_open: bool = False

    def holds(self, value: float) -> bool:
        return (value > self.lo if self.lo_open else value >= self.lo) and value <= self.hi

    def describe(self) -> str:
        if self.lo_open:
            return f"greater than {self.lo:g} and at most {self.hi:g}"
        return f"between {self.lo:g} and {self.hi:g}"


# The one place each numeric sampling field's range is written. The HTTP
# schemas check request bodies against it and `SamplingParams.validate`
# checks the engine's input against it; defaults are SamplingParams' own.
RANGES: dict[str, Range] = {
    "temperature": Range(0, 2),
    "top_p": Range(0, 1, lo_open=True),
    "min_p": Range(0, 1),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 2, lo_open=True),
    "logit_bias": Range(-100, 100),  # each bias
}


class SamplingError(TrioserveError, ValueError):
    """Sampling parameters the engine refuses. ``field`` names the offending
    parameter; ``str()`` is the message for the client."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(message)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(field: str, value: object) -> None:
    allowed = RANGES[field]
    if isinstance(value, int | float) and not isinstance(value, bool) and allowed.holds(value):
        return
    raise SamplingError(field, f"{field} must be {allowed.describe()}, got {value!r}")


def _check_token(field: str, token: object, vocab_size: int) -> None:
    if is_int(token) and 0 <= token < vocab_size:  # type: ignore[operator]
        return
    raise SamplingError(field, f"{field}: {token!r} is not a token id (the vocabulary has {vocab_size})")


@attrs.frozen
class SamplingParams:
    """How one request turns logits into tokens. `validate` checks the values;
    the constructor does not, so that the HTTP layer can build one first and
    report the first bad field. The defaults here are the server's defaults."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    seed: int | None = None  # None = the engine's edge picks one and reports it
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Score the prompt (vLLM's prompt_logprobs): each prompt token after the
    # first gets its log-probability given the tokens before it, its rank, and
    # the likeliest this many tokens there. None: the prompt is not scored.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty differs from its default (no effect)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise SamplingError for the first field out of range; token ids
        must be below ``vocab_size``."""
        # 0: the prompt is prefilled (and scored, with prompt_logprobs) and nothing is generated.
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise SamplingError("max_tokens", f"max_tokens must be a whole number of at least 0, got {self.max_tokens!r}")
        _check_number("temperature", self.temperature)
        if not is_int(self.top_k) or self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be a whole number of at least 0 (0 turns it off), got {self.top_k!r}")
        for field in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check_number(field, getattr(self, field))
        seen: set[int] = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise SamplingError("logit_bias", f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
            token, bias = pair
            _check_token("logit_bias", token, vocab_size)
            if token in seen:
                raise SamplingError("logit_bias", f"logit_bias: token {token} appears more than once")
            seen.add(token)
            _check_number("logit_bias", bias)
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise SamplingError("seed", f"seed must be a whole number from 0 to 2**63 - 1, got {self.seed!r}")
        if not isinstance(self.logprobs, bool):
            raise SamplingError("logprobs", f"logprobs must be true or false, got {self.logprobs!r}")
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError("top_logprobs", f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise SamplingError("top_logprobs", "top_logprobs needs logprobs to be true")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError("stop", f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise SamplingError("stop", f"stop strings must be non-empty strings, got {text!r}")
        for token in self.stop_token_ids:
            _check_token("stop_token_ids", token, vocab_size)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise SamplingError("prompt_logprobs", f"prompt_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {self.prompt_logprobs!r}")


def fold_seed(seed: int) -> int:
    """Any integer seed (OpenAI allows any) folded into [0, SEED_LIMIT)."""
    return seed % SEED_LIMIT


class TextDecoder(Protocol):
    """A request's token-to-text stream as the core sees it (implemented by
    models.detokenizer.IncrementalDetokenizer): each token's text once it is
    whole UTF-8, and at the end whatever it still holds."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class Guide(Protocol):
    """One request's output constraint as the core sees it (implemented by
    models.guided.Guide): it takes each sampled token and says when nothing
    but a stop token can follow. ``spec`` is what it was compiled from."""

    spec: Any

    def advance(self, token: int) -> None: ...

    @property
    def done(self) -> bool: ...


@attrs.frozen
class GenerateRequest:
    """draw_start: the first draw index of this request's random stream; a
    session's turn continues where its last committed turn stopped.
    retain: an owner (a session id) for whom the finished request's KV is
    held until the owner settles it (commit or cancel).
    pooling: set ("last" or "mean", POOLING_MODES), this is an embedding
    request: its prompt is prefilled like any other, nothing is generated,
    and its FinalEvent carries the pooled, L2-normalised final hidden state
    (``params`` then only needs to be valid; state/pooling.py).
    adapter: the LoRA adapter the request runs with (its key: its name and
    load number, so a reloaded adapter never meets its predecessor's KV),
    None for the base model.
    cache_salt: the prefix cache's salt: a request shares cached blocks only
    with requests of the same salt (its tenant's, and its own cache_salt
    field's: http/edge.py); None shares with every unsalted request.
    tenant: whose request it is (an API key's tenant, http/tenants.py):
    when several tenants' prompts wait, each step's prefill budget is
    shared between them (state/scheduling.py `prefill_shares`)."""

    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    params: SamplingParams = SamplingParams()
    request_id: str | None = None
    draw_start: int = 0
    retain: str | None = None
    guide: Guide | None = attrs.field(default=None, eq=False)  # this request's own output constraint
    pooling: str | None = None
    adapter: str | None = None
    cache_salt: str | None = None
    tenant: str | None = None


# -- one step: its plan and its result -------------------------------------
@attrs.frozen
class SampleRow:
    """What sampling one row needs: the request's parameters, its seed
    (resolved: never None here), the next unused draw of its stream, and
    its history (prompt + output) when a penalty needs it."""

    params: SamplingParams
    seed: int
    draw_index: int
    history: Sequence[int] = ()
    # Speculative tokens after the next one (the row's logits then come one
    # per position): the sampler keeps the tokens it would have drawn anyway,
    # up to and including the first that differs from the draft.
    draft: tuple[int, ...] = ()


@attrs.frozen
class ScoreRow:
    """Scoring a prompt chunk (SamplingParams.prompt_logprobs): the logits of
    the row's first ``len(targets)`` positions each score the prompt token
    that follows it, ``targets`` in order, and list the ``top`` likeliest."""

    targets: tuple[int, ...]
    top: int = 0


@attrs.frozen
class PlanRow:
    """One sequence's part of a step: ``token_ids`` go in at positions
    start, start + 1, ...; ``block_table`` covers every position up to
    their end. ``sample`` is set when this row's logits pick a token (its
    chunk reaches the end of what the sequence holds); ``guide`` is its
    output constraint then, if any. ``pool`` > 0 (an embedding request's
    prefill chunk): the final hidden states of this row's last ``pool``
    tokens are summed into the step's result (StepResult.pooled).
    ``score``: this prompt chunk's positions are scored (StepResult.scored)."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    decode: bool
    sample: SampleRow | None = None
    guide: Guide | None = attrs.field(default=None, eq=False)
    pool: int = 0
    adapter: str | None = None  # the LoRA adapter this row runs with (GenerateRequest.adapter)
    score: ScoreRow | None = None
    pool_first: bool = False  # the pooled token is the chunk's first, not its last (an encoder's [CLS])


@attrs.frozen
class StepPlan:
    """The rows of step ``number`` (numbered from 1 in a core's life)."""

    number: int
    rows: tuple[PlanRow, ...]

    @property
    def sampling(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self.rows if r.sample is not None)

    @property
    def pooling(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self.rows if r.pool > 0)

    @property
    def scoring(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self.rows if r.score is not None)


@attrs.frozen
class Sampled:
    """One token chosen for one row."""

    token: int
    draws: int  # draws consumed: 0 for greedy, 1 otherwise
    logprob: float | None = None  # of the chosen token, when params.logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (id, logprob), best first


@attrs.frozen
class PromptLogprob:
    """One prompt token scored by the tokens before it: its log-probability
    (of the model's raw distribution, as Sampled's), its rank among the
    vocabulary (1 + how many other tokens are at least as likely), and the
    likeliest ``top`` (id, logprob) there, best first, ties by id."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class StepResult:
    """What running a plan gave. Exactly one of:
    - ``sampled``: for each sampling row of the plan, in order, its tokens;
    - ``refused``: the step did not run (nothing was written): its rows fail;
    - ``fatal``: the step may have half-run: the engine is dead;
    - ``failed``: the forward pass ran but choosing tokens failed (a
      constraint or sampling error): the sampling rows fail.
    Beside ``sampled`` or ``failed`` (the forward pass ran), ``pooled``
    holds, for each pooling row of the plan (PlanRow.pool), in order, the
    sum of its pooled hidden states in fixed point (state/pooling.py), and
    ``scored``, for each scoring row (PlanRow.score), in order, its scores."""

    step: int
    sampled: tuple[tuple[Sampled, ...], ...] = ()
    refused: str | None = None
    fatal: str | None = None
    failed: str | None = None
    pooled: tuple[tuple[int, ...], ...] = ()
    scored: tuple[tuple[PromptLogprob, ...], ...] = ()


# -- what a request's consumer receives --------------------------------------
@attrs.frozen
class TokenEvent:
    request_id: str
    token_id: int
    text: str  # text that became final with this token ('' while held back)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class PromptEvent:
    """A scored prompt (SamplingParams.prompt_logprobs), sent once its
    prefill is done, before any token: the scores of prompt tokens 1, 2, ...
    (the first token has none)."""

    request_id: str
    logprobs: tuple[PromptLogprob, ...]


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV the prefix cache already held: a report of the
    # cache's state, not of the output, so not compared (eq=False).
    cached_tokens: int = attrs.field(default=0, eq=False)

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
    embedding: tuple[float, ...] | None = None  # an embedding request's vector (float32 values), when it ends with "stop"
    # The generated token that ended the request by being a stop id (an
    # end-of-text or end-of-turn token, or one of stop_token_ids): it has no
    # TokenEvent (its text is never output) but it was sampled and counts in
    # completion_tokens, so logprobs list it, with its logprob and top. Not
    # written to traces: it follows from the step result recorded there.
    stop_token: TokenEvent | None = None
    # With finish_reason "error": the request field at fault when the request
    # itself made it fail (an output constraint that broke down while it
    # ran: a 400 naming the field), None for the server's own faults.
    error_field: str | None = None


Event = TokenEvent | PromptEvent | FinalEvent
