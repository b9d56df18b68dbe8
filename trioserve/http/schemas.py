"""Request bodies of `POST /v1/chat/completions` and `POST /v1/completions`:
frozen attrs records, each field with the checks or the parser it needs,
structured from the parsed JSON by the converter `make_converter` builds.
That converter is http/structuring.py's strict one, so a wrong type is
refused rather than converted, JSON null means a field's default, and every
problem is one `RequestError` that names its JSON path.

A feature the server does not offer is refused by name rather than ignored:
functions, function_call other than "none" (send tools), suffix, best_of
other than 1 or n, completion logprobs above 5, stream_options without
stream, more than one output constraint (response_format, guided_*),
prompt_logprobs with stream, completion max_tokens 0 without echo.

Fields whose cost grows with their size before generation starts are
bounded (docs/api.md lists the limits): stop strings (matched by an
automaton the scheduler builds on the event loop), logit_bias entries
(applied at every step), the number of tools, and the text of output
constraints (regex, grammar, choices, JSON schemas; http/constraints.py
parses and bounds those). Text that only becomes prompt tokens is bounded
by the body size and the model's context.

The records of a chat request's messages and tools, and their checks, are
http/chat_parts.py's. `sampling_params` (trioserve/http/edge.py) maps a
parsed request onto the engine's `SamplingParams`.
"""

from __future__ import annotations

import functools
import json
from typing import Any, NoReturn

import attrs
import cattrs
from cattrs.errors import BaseValidationError

from trioserve.errors import RequestError
from trioserve.http.chat_parts import CalledFunction, ChatMessage, ContentPart, FunctionDef, MessageToolCall, Tool, ToolChoice, parse_tool_choice, tool_count, tools_offered
from trioserve.http.constraints import MAX_CONSTRAINT_CHARS, ResponseFormat, constraint_text, given_constraints, parse_choices, parse_json_object, parse_response_format, parse_template_kwargs, schema_size
from trioserve.http.structuring import Check, Invalid, Nested, field, got, is_int, num, raise_request_error, short, strict_converter
from trioserve.types import MAX_STOP_BYTES, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, RANGES, Range

MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS_TOKENS = 1024  # entries in logit_bias (the sampler walks them every step)
MAX_CACHE_SALT_CHARS = 256


# --- per-field checks and parsers, declared in field metadata (structuring.field)


def _within(allowed: Range) -> Check:
    # Range.holds lets a value through only when its comparisons hold, so NaN is refused too.
    def check(value: float) -> None:
        if not allowed.holds(value):
            raise Invalid(f"must be {allowed.describe()}, got {num(value)}")

    return check


def _sampling_range(name: str) -> Check:
    """The check of sampling field ``name``: its range in `trioserve.types.RANGES`,
    the one the engine's `SamplingParams.validate` applies too."""
    return _within(RANGES[name])


def _at_least_one(value: int) -> None:
    if value < 1:
        raise Invalid(f"must be at least 1, got {num(value)}")


def _top_k(value: int) -> None:
    if value < -1:
        raise Invalid(f"must be -1 or a whole number of at least 0 (-1 and 0 turn it off), got {num(value)}")


def _completion_max_tokens(value: int) -> None:
    if value < 0:  # 0 (with echo) scores the prompt alone: parse_completion_request checks echo
        raise Invalid(f"must be at least 1 (or 0 with echo), got {num(value)}")


def _not_empty(value: tuple) -> None:
    if not value:
        raise Invalid("must not be empty")


def _completion_logprobs(value: int) -> None:
    if value < 0:
        raise Invalid(f"must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {num(value)}")
    if value > MAX_COMPLETION_LOGPROBS:
        raise Invalid(f"at most {MAX_COMPLETION_LOGPROBS} log probabilities per token are supported, got {num(value)}")


def _cache_salt(value: str) -> None:
    if not 1 <= len(value) <= MAX_CACHE_SALT_CHARS:
        raise Invalid(f"must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(value)}")


MAX_STOP_TOKEN_IDS = 64


def _stop_token_ids(value: tuple[int, ...]) -> None:
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise Invalid(f"at most {MAX_STOP_TOKEN_IDS} token ids are allowed, got {len(value)}")


def _stop_text(text: str, at: str = "") -> None:
    if not text:
        raise Invalid("stop strings must not be empty", at=at)
    if len(text) > MAX_STOP_CHARS:
        raise Invalid(f"a stop string may be at most {MAX_STOP_CHARS} characters, got {len(text)}", at=at)


def _parse_stop(value: object, _: cattrs.Converter) -> str | tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        _stop_text(value)
        return value
    if not isinstance(value, list):
        raise Invalid(f"expected a string or a list of strings, got {got(value)}")
    if len(value) > MAX_STOP_STRINGS:
        raise Invalid(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise Invalid(f"expected a string, got {got(text)}", at=f"[{i}]")
        _stop_text(text, f"[{i}]")
    total = sum(len(text.encode("utf-8", "surrogatepass")) for text in value)
    if total > MAX_STOP_BYTES:
        raise Invalid(f"the stop strings may total at most {MAX_STOP_BYTES} bytes (UTF-8), got {total}")
    return tuple(value)


def token_ids(value: object, at: str) -> tuple[int, ...]:
    """A non-empty JSON list of token ids (whole numbers of at least 0),
    any problem reported at ``at``; embeddings' input takes them too."""
    if not isinstance(value, list):
        raise Invalid(f"expected a list of token ids, got {got(value)}", at=at)
    if not value:
        raise Invalid("must not be empty", at=at)
    for j, token in enumerate(value):
        if not is_int(token) or token < 0:
            raise Invalid(f"expected a token id (a whole number of at least 0), got {got(token)}", at=f"{at}[{j}]")
    return tuple(value)


def _parse_prompt(
    value: object, _: cattrs.Converter
) -> str | tuple[str, ...] | tuple[int, ...] | tuple[tuple[int, ...], ...]:
    if isinstance(value, str):
        if not value:
            raise Invalid("must not be empty")
        return value
    if not isinstance(value, list):
        raise Invalid(f"expected a string, a list of strings or a list of token ids, got {got(value)}")
    if not value:
        raise Invalid("must not be empty")
    first = value[0]
    if isinstance(first, str):  # a batch of text prompts
        for i, text in enumerate(value):
            if not isinstance(text, str):
                raise Invalid(f"expected a string like the first prompt, got {got(text)}", at=f"[{i}]")
            if not text:
                raise Invalid("must not be empty", at=f"[{i}]")
        return tuple(value)
    if is_int(first):  # one prompt as token ids
        return token_ids(value, "")
    if isinstance(first, list):  # a batch of token-id prompts
        return tuple(token_ids(ids, f"[{i}]") for i, ids in enumerate(value))
    raise Invalid(f"expected a string, a token id or a list of token ids, got {got(first)}", at="[0]")


def _parse_logit_bias(value: object, _: cattrs.Converter) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Invalid(f"expected an object mapping token ids to biases, got {got(value)}")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise Invalid(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens may be biased, got {len(value)}")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        elif is_int(key) and key >= 0:
            token = key
        else:
            raise Invalid(f"key {short(str(key))} is not a token id")
        if token in biases:
            raise Invalid(f"token {token} appears more than once")
        if not isinstance(bias, int | float) or isinstance(bias, bool):
            raise Invalid(f"the bias for token {token} must be a number, got {got(bias)}")
        if not RANGES["logit_bias"].holds(bias):
            raise Invalid(f"the bias for token {token} must be {RANGES['logit_bias'].describe()}, got {num(bias)}")
        biases[token] = float(bias)
    return biases


# --- the records (a chat request's messages and tools are http/chat_parts.py's)


@attrs.frozen
class StreamOptions:
    include_usage: bool = False


@attrs.frozen
class ChatCompletionRequest:
    messages: tuple[ChatMessage, ...] = field(check=_not_empty)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = field(None, check=_at_least_one)
    max_completion_tokens: int | None = field(None, check=_at_least_one)  # wins over max_tokens
    temperature: float | None = field(None, check=_sampling_range("temperature"))
    top_p: float | None = field(None, check=_sampling_range("top_p"))
    top_k: int | None = field(None, check=_top_k)  # -1 and 0 mean off
    min_p: float | None = field(None, check=_sampling_range("min_p"))
    presence_penalty: float | None = field(None, check=_sampling_range("presence_penalty"))
    frequency_penalty: float | None = field(None, check=_sampling_range("frequency_penalty"))
    repetition_penalty: float | None = field(None, check=_sampling_range("repetition_penalty"))
    stop: str | tuple[str, ...] | None = field(None, parse=_parse_stop)
    seed: int | None = None  # any integer, as OpenAI allows; edge.resolve_seed folds it into [0, 2**63)
    n: int = field(1, check=_within(Range(1, MAX_N)))
    logit_bias: dict[int, float] | None = field(None, parse=_parse_logit_bias)
    logprobs: bool = False
    top_logprobs: int | None = field(None, check=_within(Range(0, MAX_TOP_LOGPROBS)))  # needs logprobs
    prompt_logprobs: int | None = field(None, check=_within(Range(0, MAX_TOP_LOGPROBS)))  # vLLM's: score the prompt
    user: str | None = None
    cache_salt: str | None = field(None, check=_cache_salt)  # vLLM's: share cached prompt blocks only with the same salt
    ignore_eos: bool = False  # an extension (vLLM has it)
    stop_token_ids: tuple[int, ...] | None = field(None, check=_stop_token_ids)  # vLLM's: more ids that end the output
    tools: tuple[Tool, ...] | None = field(None, check=tool_count)
    tool_choice: ToolChoice | None = field(None, parse=parse_tool_choice)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = field(None, parse=parse_response_format)
    # Guided decoding extensions (vLLM's names); at most one constraint per request.
    guided_json: dict | None = field(None, parse=parse_json_object, check=schema_size)
    guided_regex: str | None = field(None, check=constraint_text)
    guided_grammar: str | None = field(None, check=constraint_text)
    guided_choice: tuple[str, ...] | None = field(None, parse=parse_choices)
    chat_template_kwargs: dict | None = field(None, parse=parse_template_kwargs)  # vLLM's: template variables (enable_thinking)


@attrs.frozen
class CompletionRequest:
    prompt: str | tuple[str, ...] | tuple[int, ...] | tuple[tuple[int, ...], ...] = field(parse=_parse_prompt)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = field(None, check=_completion_max_tokens)
    temperature: float | None = field(None, check=_sampling_range("temperature"))
    top_p: float | None = field(None, check=_sampling_range("top_p"))
    top_k: int | None = field(None, check=_top_k)
    min_p: float | None = field(None, check=_sampling_range("min_p"))
    presence_penalty: float | None = field(None, check=_sampling_range("presence_penalty"))
    frequency_penalty: float | None = field(None, check=_sampling_range("frequency_penalty"))
    repetition_penalty: float | None = field(None, check=_sampling_range("repetition_penalty"))
    stop: str | tuple[str, ...] | None = field(None, parse=_parse_stop)
    seed: int | None = None
    n: int = field(1, check=_within(Range(1, MAX_N)))
    logit_bias: dict[int, float] | None = field(None, parse=_parse_logit_bias)
    user: str | None = None
    cache_salt: str | None = field(None, check=_cache_salt)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | None = field(None, check=_stop_token_ids)
    echo: bool = False
    logprobs: int | None = field(None, check=_completion_logprobs)  # top logprobs per token
    prompt_logprobs: int | None = field(None, check=_within(Range(0, MAX_TOP_LOGPROBS)))  # vLLM's: score the prompt
    response_format: ResponseFormat | None = field(None, parse=parse_response_format)
    guided_json: dict | None = field(None, parse=parse_json_object, check=schema_size)
    guided_regex: str | None = field(None, check=constraint_text)
    guided_grammar: str | None = field(None, check=constraint_text)
    guided_choice: tuple[str, ...] | None = field(None, parse=parse_choices)


_RECORDS = (
    ContentPart, CalledFunction, MessageToolCall, FunctionDef, Tool, ChatMessage, StreamOptions,
    ChatCompletionRequest, CompletionRequest,
)  # dependencies first; fmt: skip


# --- the converter


def make_converter() -> cattrs.Converter:
    """The converter for the request records: strict scalars, lists only from
    JSON lists, and the per-field checks the records declare."""
    return strict_converter(*_RECORDS)


@functools.cache
def _converter() -> cattrs.Converter:
    return make_converter()


# --- parsing a body


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field=None)
    return body


def _structure(body: dict, cls: type) -> Any:
    try:
        return _converter().structure(body, cls)
    except (BaseValidationError, Invalid, Nested) as exc:
        raise_request_error(exc)


def _refuse(field: str, message: str) -> NoReturn:
    raise RequestError(f"{field}: {message}", field=field)


MAX_REQUEST_CONSTRAINT_CHARS = 4 * MAX_CONSTRAINT_CHARS  # tools, schemas, grammars and choices of one request, together


def _check_constraint_total(request: ChatCompletionRequest) -> None:
    """Each tool's schema, and each constraint, has its bound: so do all of
    them together (63 tools of 62 KB each held ~95 MB once parsed)."""
    sizes = {"tools": sum(len(compact(t.function.parameters)) + len(t.function.description or "") for t in request.tools or ())}
    if request.response_format is not None and request.response_format.schema is not None:
        sizes["response_format"] = len(compact(request.response_format.schema))
    sizes["guided_json"] = len(compact(request.guided_json)) if request.guided_json is not None else 0
    sizes["guided_regex"] = len(request.guided_regex or "")
    sizes["guided_grammar"] = len(request.guided_grammar or "")
    sizes["guided_choice"] = sum(map(len, request.guided_choice or ()))
    total = sum(sizes.values())
    if total > MAX_REQUEST_CONSTRAINT_CHARS:
        field = max(sizes, key=sizes.__getitem__)
        _refuse(field, f"tools, schemas, grammars and choices may total {MAX_REQUEST_CONSTRAINT_CHARS} characters in one request, got {total}")


def compact(value: object) -> str:
    return "" if value is None else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def parse_chat_request(body: object) -> ChatCompletionRequest:
    """The chat request in ``body`` (parsed JSON), or RequestError."""
    data = _object(body)
    if data.get("functions") not in (None, []):
        _refuse("functions", "the deprecated functions field is not supported; send tools")
    if data.get("function_call") not in (None, "none"):
        _refuse("function_call", "the deprecated function_call field is not supported; send tool_choice")
    request: ChatCompletionRequest = _structure(data, ChatCompletionRequest)
    _check_stream_options(request)
    _check_prompt_logprobs(request)
    _check_constraint_total(request)
    if request.top_logprobs and not request.logprobs:
        _refuse("top_logprobs", "needs logprobs to be true")
    choice = request.tool_choice
    if choice is not None and choice.mode in ("required", "function") and not request.tools:
        _refuse("tool_choice", f"{short(choice.name or choice.mode)} needs tools")
    names = [t.function.name for t in request.tools or ()]
    if len(set(names)) != len(names):
        _refuse("tools", "two tools have the same name")
    if choice is not None and choice.mode == "function" and choice.name not in names:
        _refuse("tool_choice", f"no tool named {short(choice.name)} (tools: {', '.join(names)})")
    if one_call_only(request) and isinstance(request.stop, tuple) and len(request.stop) >= MAX_STOP_STRINGS:
        _refuse("stop", f"with parallel_tool_calls false at most {MAX_STOP_STRINGS - 1} stop strings are allowed (one is used to end the call)")
    constraints = [c for c in given_constraints(request) if c != "response_format"]
    if choice is not None and choice.mode in ("required", "function") and constraints:
        # response_format shapes replies in words, which a forced call is
        # not: it applies to the turns after (OpenAI's reading); the guided_*
        # extensions constrain this very reply, so they cannot.
        _refuse(constraints[0], "cannot be combined with a tool_choice that forces a call")
    return request


def one_call_only(request: ChatCompletionRequest) -> bool:
    """Tools offered with parallel_tool_calls false: the reply ends after its
    first call (its closing tag is a stop string)."""
    return tools_offered(request.tools, request.tool_choice) and not request.parallel_tool_calls


def parse_completion_request(body: object) -> CompletionRequest:
    """The completion request in ``body`` (parsed JSON), or RequestError."""
    data = _object(body)
    if data.get("suffix") not in (None, ""):
        _refuse("suffix", "suffix (insertion) is not supported")
    request: CompletionRequest = _structure(data, CompletionRequest)
    best_of = data.get("best_of")
    if best_of is not None:
        if not is_int(best_of):
            _refuse("best_of", f"expected an integer, got {got(best_of)}")
        if best_of not in (1, request.n):
            _refuse("best_of", f"only best_of equal to n is supported, got {num(best_of)} with n {request.n}")
    _check_stream_options(request)
    _check_prompt_logprobs(request)
    if request.max_tokens == 0 and not request.echo:
        _refuse("max_tokens", "must be at least 1, got 0 (0 is only for echo: true, to score the prompt alone)")
    given_constraints(request)
    return request


def _check_prompt_logprobs(request: ChatCompletionRequest | CompletionRequest) -> None:
    if request.prompt_logprobs is not None and request.stream:
        _refuse("prompt_logprobs", "is not supported with stream (as in vLLM); for a streamed prompt's scores use echo with logprobs on /v1/completions")


def _check_stream_options(request: ChatCompletionRequest | CompletionRequest) -> None:
    if request.stream_options is not None and not request.stream:
        _refuse("stream_options", "only allowed when stream is true")
