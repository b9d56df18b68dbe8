"""Request bodies of `POST /v1/chat/completions` and `POST /v1/completions`:
frozen attrs records, structured from the parsed JSON by one cattrs converter
that `make_converter` builds.

Structuring is strict: a boolean field takes only true or false, an integer
field refuses 2.5 and booleans, a float field takes any number, a string field
takes only strings. Unknown keys are ignored. Every failure becomes one
`RequestError` whose ``field`` is the JSON path of the first problem (fields in
the order the record declares them; list items in order) and whose message
starts with that path: ``messages[1].content: expected a string or a list of
content parts, got 5``.

JSON null for a field that has a default means the default (OpenAI marks
its optional fields nullable), so ``"n": null`` is ``n = 1``.

A feature the server does not offer is refused by name rather than ignored:
functions, function_call other than "none" (send tools), suffix, best_of
other than 1 or n, completion logprobs above 5, stream_options without
stream, more than one output constraint (response_format, guided_*).

Fields whose cost grows with their size before generation starts are
bounded (docs/api.md lists the limits): stop strings (matched by an
automaton the scheduler builds on the event loop), logit_bias entries
(applied at every step), the number of tools, and the text of output
constraints (regex, grammar, choices, JSON schemas). Text that only becomes
prompt tokens is bounded by the body size and the model's context.

`check_json_body` is run on every decoded body before it is parsed (the
app's `_body` does): a string holding a lone UTF-16 surrogate, or nesting
deeper than MAX_JSON_DEPTH, is refused with its JSON path.

`sampling_params` (trioserve/http/edge.py) maps a parsed request onto the
engine's `SamplingParams`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any, Literal, NoReturn, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, BaseValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn, override

from trioserve.errors import RequestError
from trioserve.models.guided import GuideSpec
from trioserve.types import MAX_STOP_BYTES, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, RANGES, Range

MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS_TOKENS = 1024  # entries in logit_bias (the sampler walks them every step)
MAX_TOOLS = 128  # as OpenAI allows
MAX_CONSTRAINT_CHARS = 65536  # a regex, a grammar, all guided choices, or one JSON schema as compact JSON
MAX_JSON_DEPTH = 100  # objects and lists nested in a body (schemas, templates and tojson recurse)

# --- the errors that structuring raises inside, and the walk that reads them


class _Invalid(ValueError):
    """One problem with one value. ``at`` is a path below the value the hook
    was given ("" for the value itself, "[2]" for its third item)."""

    def __init__(self, message: str, at: str = "") -> None:
        self.message = message
        self.at = at
        super().__init__(message)


class _Nested(ValueError):
    """``cause`` happened at ``at`` below the value a hook was given."""

    def __init__(self, at: str, cause: BaseException) -> None:
        self.at = at
        self.cause = cause
        super().__init__(f"{at}: {cause}")


def _join(path: str, step: str) -> str:
    if not step or not path or step.startswith("["):
        return path + step
    return f"{path}.{step}"


def _first_problem(exc: BaseException) -> tuple[str, str]:
    """(JSON path, message) of the first leaf under a structuring failure."""
    path = ""
    while True:
        if isinstance(exc, _Nested):
            path, exc = _join(path, exc.at), exc.cause
        elif isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
            for note in getattr(exc, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    path = _join(path, note.name)
                elif isinstance(note, IterableValidationNote):
                    path = _join(path, f"[{note.index}]")
        elif isinstance(exc, _Invalid):
            return _join(path, exc.at), exc.message
        elif isinstance(exc, KeyError):  # cattrs reading a required key that is absent
            return path, "this field is required"
        else:
            return path, "invalid value"


def _raise_request_error(exc: BaseException) -> None:
    path, message = _first_problem(exc)
    raise RequestError(f"{path}: {message}" if path else message, field=path or None) from None


# --- describing values in messages


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _num(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, int) and abs(value) >= 10**30:
        return "a number that large"
    return repr(value)


def _got(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return _num(value)
    if isinstance(value, str):
        return f"the string {_short(value)}"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- strict hooks for JSON scalars


def _structure_str(value: object, _: object) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"expected a string, got {_got(value)}")
    return value


def _structure_bool(value: object, _: object) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {_got(value)}")
    return value


def _structure_int(value: object, _: object) -> int:
    if not _is_int(value):
        raise _Invalid(f"expected an integer, got {_got(value)}")
    return value  # type: ignore[return-value]


def _structure_float(value: object, _: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _Invalid(f"expected a number, got {_got(value)}")
    try:
        return float(value)
    except OverflowError:
        raise _Invalid(f"the number {_num(value)} is out of range") from None


def _structure_literal(value: object, type_: Any) -> object:
    choices = get_args(type_)
    if not isinstance(value, str | int | float | bool) or value not in choices:
        names = ", ".join(repr(choice) for choice in choices)
        raise _Invalid(f"must be one of {names}, got {_got(value)}")
    return value


def _is_homogeneous_tuple(type_: object) -> bool:
    args = get_args(type_)
    return get_origin(type_) is tuple and len(args) == 2 and args[1] is Ellipsis


def _tuple_hook(type_: Any, converter: cattrs.Converter) -> Callable[[object, object], tuple]:
    """tuple[X, ...] from a JSON list only (never from a string or an object)."""
    item_type = get_args(type_)[0]
    item_hook = converter.get_structure_hook(item_type)

    def structure(value: object, _: object) -> tuple:
        if not isinstance(value, list | tuple):
            raise _Invalid(f"expected a list, got {_got(value)}")
        items = []
        for i, item in enumerate(value):
            try:
                items.append(item_hook(item, item_type))
            except Exception as exc:
                raise _Nested(f"[{i}]", exc) from None
        return tuple(items)

    return structure


# --- per-field checks and parsers, declared in field metadata

_CHECK = "trioserve.check"  # (structured value) -> None, raises _Invalid; not called for None
_PARSE = "trioserve.parse"  # (JSON value, converter) -> value, raises; replaces the type's hook

Check = Callable[[Any], None]


def _field(default: object = attrs.NOTHING, *, check: Check | None = None, parse: Callable | None = None) -> Any:
    metadata: dict[str, object] = {}
    if check is not None:
        metadata[_CHECK] = check
    if parse is not None:
        metadata[_PARSE] = parse
    return attrs.field(default=default, metadata=metadata)


def _within(allowed: Range) -> Check:
    # Range.holds lets a value through only when its comparisons hold, so NaN is refused too.
    def check(value: float) -> None:
        if not allowed.holds(value):
            raise _Invalid(f"must be {allowed.describe()}, got {_num(value)}")

    return check


def _sampling_range(name: str) -> Check:
    """The check of sampling field ``name``: its range in `trioserve.types.RANGES`,
    the one the engine's `SamplingParams.validate` applies too."""
    return _within(RANGES[name])


def _at_least_one(value: int) -> None:
    if value < 1:
        raise _Invalid(f"must be at least 1, got {_num(value)}")


def _top_k(value: int) -> None:
    if value < -1:
        raise _Invalid(f"must be -1 or a whole number of at least 0 (-1 and 0 turn it off), got {_num(value)}")


def _not_empty(value: tuple) -> None:
    if not value:
        raise _Invalid("must not be empty")


def _only_text(value: str) -> None:
    if value != "text":
        raise _Invalid(f"only 'text' parts are supported, got {_short(value)}")


def _completion_logprobs(value: int) -> None:
    if value < 0:
        raise _Invalid(f"must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {_num(value)}")
    if value > MAX_COMPLETION_LOGPROBS:
        raise _Invalid(f"at most {MAX_COMPLETION_LOGPROBS} log probabilities per token are supported, got {_num(value)}")


def _parse_content(value: object, converter: cattrs.Converter) -> str | tuple[ContentPart, ...] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return converter.structure(value, tuple[ContentPart, ...])
    raise _Invalid(f"expected a string or a list of content parts, got {_got(value)}")


def _stop_text(text: str, at: str = "") -> None:
    if not text:
        raise _Invalid("stop strings must not be empty", at=at)
    if len(text) > MAX_STOP_CHARS:
        raise _Invalid(f"a stop string may be at most {MAX_STOP_CHARS} characters, got {len(text)}", at=at)


def _parse_stop(value: object, _: cattrs.Converter) -> str | tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        _stop_text(value)
        return value
    if not isinstance(value, list):
        raise _Invalid(f"expected a string or a list of strings, got {_got(value)}")
    if len(value) > MAX_STOP_STRINGS:
        raise _Invalid(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise _Invalid(f"expected a string, got {_got(text)}", at=f"[{i}]")
        _stop_text(text, f"[{i}]")
    total = sum(len(text.encode("utf-8", "surrogatepass")) for text in value)
    if total > MAX_STOP_BYTES:
        raise _Invalid(f"the stop strings may total at most {MAX_STOP_BYTES} bytes (UTF-8), got {total}")
    return tuple(value)


def _token_ids(value: object, at: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _Invalid(f"expected a list of token ids, got {_got(value)}", at=at)
    if not value:
        raise _Invalid("must not be empty", at=at)
    for j, token in enumerate(value):
        if not _is_int(token) or token < 0:
            raise _Invalid(f"expected a token id (a whole number of at least 0), got {_got(token)}", at=f"{at}[{j}]")
    return tuple(value)


def _parse_prompt(
    value: object, _: cattrs.Converter
) -> str | tuple[str, ...] | tuple[int, ...] | tuple[tuple[int, ...], ...]:
    if isinstance(value, str):
        if not value:
            raise _Invalid("must not be empty")
        return value
    if not isinstance(value, list):
        raise _Invalid(f"expected a string, a list of strings or a list of token ids, got {_got(value)}")
    if not value:
        raise _Invalid("must not be empty")
    first = value[0]
    if isinstance(first, str):  # a batch of text prompts
        for i, text in enumerate(value):
            if not isinstance(text, str):
                raise _Invalid(f"expected a string like the first prompt, got {_got(text)}", at=f"[{i}]")
            if not text:
                raise _Invalid("must not be empty", at=f"[{i}]")
        return tuple(value)
    if _is_int(first):  # one prompt as token ids
        return _token_ids(value, "")
    if isinstance(first, list):  # a batch of token-id prompts
        return tuple(_token_ids(ids, f"[{i}]") for i, ids in enumerate(value))
    raise _Invalid(f"expected a string, a token id or a list of token ids, got {_got(first)}", at="[0]")


def _parse_logit_bias(value: object, _: cattrs.Converter) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _Invalid(f"expected an object mapping token ids to biases, got {_got(value)}")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise _Invalid(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens may be biased, got {len(value)}")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        elif _is_int(key) and key >= 0:
            token = key
        else:
            raise _Invalid(f"key {_short(str(key))} is not a token id")
        if token in biases:
            raise _Invalid(f"token {token} appears more than once")
        if not isinstance(bias, int | float) or isinstance(bias, bool):
            raise _Invalid(f"the bias for token {token} must be a number, got {_got(bias)}")
        if not RANGES["logit_bias"].holds(bias):
            raise _Invalid(f"the bias for token {token} must be {RANGES['logit_bias'].describe()}, got {_num(bias)}")
        biases[token] = float(bias)
    return biases


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_GUIDED_CHOICES = 256


def _function_name(value: str) -> None:
    if not _FUNCTION_NAME.fullmatch(value):
        raise _Invalid(f"a function name is 1 to 64 letters, digits, '_', '.' or '-', got {_short(value)}")


def _parse_json_object(value: object, _: cattrs.Converter) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _Invalid(f"expected a JSON object, got {_got(value)}")
    return value


def _object_schema(value: dict) -> None:
    if "type" in value and value["type"] != "object":
        raise _Invalid(f"must be a JSON schema of an object (type 'object'), got type {_got(value['type'])}")


def _schema_size(value: dict | bool, at: str = "") -> None:
    try:
        size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except RecursionError:
        raise _Invalid("the schema is nested too deeply", at=at) from None
    if size > MAX_CONSTRAINT_CHARS:
        raise _Invalid(f"a schema may be at most {MAX_CONSTRAINT_CHARS} characters of JSON, got {size}", at=at)


def _tool_parameters(value: dict) -> None:
    _object_schema(value)
    _schema_size(value)


def _constraint_text(value: str) -> None:
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise _Invalid(f"may be at most {MAX_CONSTRAINT_CHARS} characters, got {len(value)}")


def _tool_count(value: tuple) -> None:
    if len(value) > MAX_TOOLS:
        raise _Invalid(f"at most {MAX_TOOLS} tools are allowed, got {len(value)}")


def _parse_tool_choice(value: object, _: cattrs.Converter) -> ToolChoice | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _Invalid(f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {_got(value)}")
        return ToolChoice(value)
    if not isinstance(value, dict):
        raise _Invalid(f"expected a string or an object, got {_got(value)}")
    if value.get("type") != "function":
        raise _Invalid(f"must be 'function', got {_got(value.get('type'))}", at="type")
    function = value.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _Invalid("expected an object with the function's name", at="function")
    return ToolChoice("function", function["name"])


def _parse_response_format(value: object, _: cattrs.Converter) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _Invalid(f"expected an object, got {_got(value)}")
    kind = value.get("type")
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise _Invalid(f"must be one of 'text', 'json_object', 'json_schema', got {_got(kind)}", at="type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _Invalid(f"expected an object with the schema, got {_got(spec)}", at="json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict | bool):
        raise _Invalid(f"expected a JSON schema (an object), got {_got(schema)}", at="json_schema.schema")
    _schema_size(schema, "json_schema.schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise _Invalid(f"expected a string, got {_got(name)}", at="json_schema.name")
    return ResponseFormat("json_schema", schema, name)


def _parse_choices(value: object, _: cattrs.Converter) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise _Invalid(f"expected a non-empty list of strings, got {_got(value)}")
    if len(value) > MAX_GUIDED_CHOICES:
        raise _Invalid(f"at most {MAX_GUIDED_CHOICES} choices are allowed, got {len(value)}")
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text:
            raise _Invalid(f"expected a non-empty string, got {_got(text)}", at=f"[{i}]")
    total = sum(map(len, value))
    if total > MAX_CONSTRAINT_CHARS:
        raise _Invalid(f"the choices may total at most {MAX_CONSTRAINT_CHARS} characters, got {total}")
    return tuple(value)


# --- the records


@attrs.frozen
class ContentPart:
    """One part of a message's content; only text parts are supported."""

    type: str = _field(check=_only_text)
    text: str = _field()


@attrs.frozen
class CalledFunction:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@attrs.frozen
class MessageToolCall:
    """A call an earlier assistant message made (sent back in the history)."""

    id: str
    function: CalledFunction
    type: Literal["function"] = "function"


@attrs.frozen
class FunctionDef:
    name: str = _field(check=_function_name)
    description: str | None = None
    parameters: dict | None = _field(None, parse=_parse_json_object, check=_tool_parameters)  # a JSON schema
    strict: bool | None = None


@attrs.frozen
class Tool:
    function: FunctionDef
    type: Literal["function"] = "function"


@attrs.frozen
class ToolChoice:
    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None  # the function, when mode is "function"


@attrs.frozen
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"]
    schema: dict | bool | None = None
    name: str | None = None


@attrs.frozen
class ChatMessage:
    # "developer" is OpenAI's newer name for "system"; templates see "system" (tools.message_dict).
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | tuple[ContentPart, ...] | None = _field(None, parse=_parse_content)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: tuple[MessageToolCall, ...] | None = None

    def text(self) -> str:
        """The content as one string: parts joined by newlines, None as ""."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


@attrs.frozen
class StreamOptions:
    include_usage: bool = False


@attrs.frozen
class ChatCompletionRequest:
    messages: tuple[ChatMessage, ...] = _field(check=_not_empty)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = _field(None, check=_at_least_one)
    max_completion_tokens: int | None = _field(None, check=_at_least_one)  # wins over max_tokens
    temperature: float | None = _field(None, check=_sampling_range("temperature"))
    top_p: float | None = _field(None, check=_sampling_range("top_p"))
    top_k: int | None = _field(None, check=_top_k)  # -1 and 0 mean off
    min_p: float | None = _field(None, check=_sampling_range("min_p"))
    presence_penalty: float | None = _field(None, check=_sampling_range("presence_penalty"))
    frequency_penalty: float | None = _field(None, check=_sampling_range("frequency_penalty"))
    repetition_penalty: float | None = _field(None, check=_sampling_range("repetition_penalty"))
    stop: str | tuple[str, ...] | None = _field(None, parse=_parse_stop)
    seed: int | None = None  # any integer, as OpenAI allows; edge.resolve_seed folds it into [0, 2**63)
    n: int = _field(1, check=_within(Range(1, MAX_N)))
    logit_bias: dict[int, float] | None = _field(None, parse=_parse_logit_bias)
    logprobs: bool = False
    top_logprobs: int | None = _field(None, check=_within(Range(0, MAX_TOP_LOGPROBS)))  # needs logprobs
    user: str | None = None
    ignore_eos: bool = False  # an extension (vLLM has it)
    tools: tuple[Tool, ...] | None = _field(None, check=_tool_count)
    tool_choice: ToolChoice | None = _field(None, parse=_parse_tool_choice)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = _field(None, parse=_parse_response_format)
    # Guided decoding extensions (vLLM's names); at most one constraint per request.
    guided_json: dict | None = _field(None, parse=_parse_json_object, check=_schema_size)
    guided_regex: str | None = _field(None, check=_constraint_text)
    guided_grammar: str | None = _field(None, check=_constraint_text)
    guided_choice: tuple[str, ...] | None = _field(None, parse=_parse_choices)


@attrs.frozen
class CompletionRequest:
    prompt: str | tuple[str, ...] | tuple[int, ...] | tuple[tuple[int, ...], ...] = _field(parse=_parse_prompt)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = _field(None, check=_at_least_one)
    temperature: float | None = _field(None, check=_sampling_range("temperature"))
    top_p: float | None = _field(None, check=_sampling_range("top_p"))
    top_k: int | None = _field(None, check=_top_k)
    min_p: float | None = _field(None, check=_sampling_range("min_p"))
    presence_penalty: float | None = _field(None, check=_sampling_range("presence_penalty"))
    frequency_penalty: float | None = _field(None, check=_sampling_range("frequency_penalty"))
    repetition_penalty: float | None = _field(None, check=_sampling_range("repetition_penalty"))
    stop: str | tuple[str, ...] | None = _field(None, parse=_parse_stop)
    seed: int | None = None
    n: int = _field(1, check=_within(Range(1, MAX_N)))
    logit_bias: dict[int, float] | None = _field(None, parse=_parse_logit_bias)
    user: str | None = None
    ignore_eos: bool = False
    echo: bool = False
    logprobs: int | None = _field(None, check=_completion_logprobs)  # top logprobs per token
    response_format: ResponseFormat | None = _field(None, parse=_parse_response_format)
    guided_json: dict | None = _field(None, parse=_parse_json_object, check=_schema_size)
    guided_regex: str | None = _field(None, check=_constraint_text)
    guided_grammar: str | None = _field(None, check=_constraint_text)
    guided_choice: tuple[str, ...] | None = _field(None, parse=_parse_choices)


_RECORDS = (
    ContentPart, CalledFunction, MessageToolCall, FunctionDef, Tool, ChatMessage, StreamOptions,
    ChatCompletionRequest, CompletionRequest,
)  # dependencies first; fmt: skip


# --- the converter


def _field_hook(field: attrs.Attribute, converter: cattrs.Converter) -> Callable[[object, object], object]:
    parse = field.metadata.get(_PARSE)
    check = field.metadata.get(_CHECK)
    base = converter.get_structure_hook(field.type) if parse is None else None

    def structure(value: object, type_: object) -> object:
        result = parse(value, converter) if parse is not None else base(value, type_)
        if check is not None and result is not None:
            check(result)
        return result

    return structure


def _record_hook(cls: type, converter: cattrs.Converter) -> Callable[[object, object], object]:
    overrides = {
        field.name: override(struct_hook=_field_hook(field, converter))
        for field in attrs.fields(cls)
        if _PARSE in field.metadata or _CHECK in field.metadata
    }
    generated = make_dict_structure_fn(cls, converter, _cattrs_detailed_validation=True, **overrides)
    # JSON null for a field with a default means that default, as OpenAI's
    # nullable fields do ("n": null, "stream": null, "logprobs": null, ...);
    # fields whose default is None take null as it is.
    defaulted = frozenset(f.name for f in attrs.fields(cls) if f.default is not attrs.NOTHING and f.default is not None)

    def structure(value: object, type_: object) -> object:
        if not isinstance(value, dict):
            raise _Invalid(f"expected an object, got {_got(value)}")
        if any(value.get(name, 0) is None for name in defaulted):
            value = {key: item for key, item in value.items() if not (item is None and key in defaulted)}
        return generated(value, type_)

    return structure


def make_converter() -> cattrs.Converter:
    """The converter for the request records: strict scalars, lists only from
    JSON lists, and the per-field checks the records declare."""
    converter = cattrs.Converter(detailed_validation=True)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook_func(lambda t: get_origin(t) is Literal, _structure_literal)
    converter.register_structure_hook_factory(_is_homogeneous_tuple, _tuple_hook)
    for cls in _RECORDS:
        attrs.resolve_types(cls)
        converter.register_structure_hook(cls, _record_hook(cls, converter))
    return converter


@functools.cache
def _converter() -> cattrs.Converter:
    return make_converter()


# --- parsing a body

_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(text: str) -> str | None:
    """The first UTF-16 surrogate in ``text``, or None. In a Python string
    every surrogate is a lone one: JSON's escaped pairs decode to one
    character, and UTF-8 has no valid encoding of any."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    return None if found is None else found.group()


def _path_key(key: str) -> str:
    return key if len(key) <= 64 else key[:61] + "..."


def check_json_body(body: object) -> None:
    """Raise RequestError naming the first problem in the parsed JSON
    ``body``, in document order: a string (a key or a value, at any depth)
    holding a lone UTF-16 surrogate, or an object or list nested more than
    MAX_JSON_DEPTH deep. JSON lets a lone surrogate through ("\\ud800"),
    but it is not Unicode: nothing can encode it, tokenize it or send it
    back. The walk keeps its own stack, so any depth json.loads accepted
    is walked."""
    stack: list[tuple[str, object, bool, int]] = [("", body, False, 0)]
    while stack:
        path, value, is_key, depth = stack.pop()
        if isinstance(value, dict | list) and depth >= MAX_JSON_DEPTH:
            raise RequestError(f"{path}: objects and lists may nest at most {MAX_JSON_DEPTH} deep", field=path)
        if isinstance(value, str):
            char = _lone_surrogate(value)
            if char is not None:
                what = "a key" if is_key else "the text"
                raise RequestError(
                    f"{path or 'the request body'}: {what} contains a lone UTF-16 surrogate (\\u{ord(char):04x}), which is not valid Unicode",
                    field=path or None,
                )
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                stack.append((_join(path, _path_key(str(key))), item, False, depth + 1))
                stack.append((path, key, True, depth))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", value[i], False, depth + 1) for i in range(len(value) - 1, -1, -1))


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field=None)
    return body


def _structure(body: dict, cls: type) -> Any:
    try:
        return _converter().structure(body, cls)
    except (BaseValidationError, _Invalid, _Nested) as exc:
        _raise_request_error(exc)


def _refuse(field: str, message: str) -> NoReturn:
    raise RequestError(f"{field}: {message}", field=field)


def parse_chat_request(body: object) -> ChatCompletionRequest:
    """The chat request in ``body`` (parsed JSON), or RequestError."""
    data = _object(body)
    if data.get("functions") not in (None, []):
        _refuse("functions", "the deprecated functions field is not supported; send tools")
    if data.get("function_call") not in (None, "none"):
        _refuse("function_call", "the deprecated function_call field is not supported; send tool_choice")
    request: ChatCompletionRequest = _structure(data, ChatCompletionRequest)
    _check_stream_options(request)
    if request.top_logprobs and not request.logprobs:
        _refuse("top_logprobs", "needs logprobs to be true")
    choice = request.tool_choice
    if choice is not None and choice.mode in ("required", "function") and not request.tools:
        _refuse("tool_choice", f"{_short(choice.name or choice.mode)} needs tools")
    names = [t.function.name for t in request.tools or ()]
    if len(set(names)) != len(names):
        _refuse("tools", "two tools have the same name")
    if choice is not None and choice.mode == "function" and choice.name not in names:
        _refuse("tool_choice", f"no tool named {_short(choice.name)} (tools: {', '.join(names)})")
    if one_call_only(request) and isinstance(request.stop, tuple) and len(request.stop) >= MAX_STOP_STRINGS:
        _refuse("stop", f"with parallel_tool_calls false at most {MAX_STOP_STRINGS - 1} stop strings are allowed (one is used to end the call)")
    constraints = [c for c in _constraints(request) if c != "response_format"]
    if choice is not None and choice.mode in ("required", "function") and constraints:
        # response_format shapes replies in words, which a forced call is
        # not: it applies to the turns after (OpenAI's reading); the guided_*
        # extensions constrain this very reply, so they cannot.
        _refuse(constraints[0], "cannot be combined with a tool_choice that forces a call")
    return request


def tools_offered(tools: tuple[Tool, ...] | None, choice: ToolChoice | None) -> bool:
    """Whether the model is shown tools (and its calls are parsed)."""
    return bool(tools) and (choice is None or choice.mode != "none")


def one_call_only(request: ChatCompletionRequest) -> bool:
    """Tools offered with parallel_tool_calls false: the reply ends after its
    first call (its closing tag is a stop string)."""
    return tools_offered(request.tools, request.tool_choice) and not request.parallel_tool_calls


# The fields that constrain the output; a request may set one of them.
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")


def _constraints(request: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """The guided-decoding fields a request sets; more than one is refused."""
    given = [name for name in CONSTRAINT_FIELDS if getattr(request, name) is not None]
    if request.response_format is not None and request.response_format.type == "text":
        given.remove("response_format")
    if len(given) > 1:
        _refuse(given[1], f"only one output constraint per request; {given[0]} is already set")
    return given


def parse_completion_request(body: object) -> CompletionRequest:
    """The completion request in ``body`` (parsed JSON), or RequestError."""
    data = _object(body)
    if data.get("suffix") not in (None, ""):
        _refuse("suffix", "suffix (insertion) is not supported")
    request: CompletionRequest = _structure(data, CompletionRequest)
    best_of = data.get("best_of")
    if best_of is not None:
        if not _is_int(best_of):
            _refuse("best_of", f"expected an integer, got {_got(best_of)}")
        if best_of not in (1, request.n):
            _refuse("best_of", f"only best_of equal to n is supported, got {_num(best_of)} with n {request.n}")
    _check_stream_options(request)
    _constraints(request)
    return request


def _check_stream_options(request: ChatCompletionRequest | CompletionRequest) -> None:
    if request.stream_options is not None and not request.stream:
        _refuse("stream_options", "only allowed when stream is true")


# --- onto the engine's output constraint


def guide_spec(request: ChatCompletionRequest | CompletionRequest) -> GuideSpec | None:
    """The output constraint a request asks for (at most one, see
    `_constraints`), or None."""
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        return GuideSpec("json_object", None, "response_format")
    if fmt is not None and fmt.type == "json_schema":
        return GuideSpec("json_schema", fmt.schema, "response_format.json_schema.schema")
    if request.guided_json is not None:
        return GuideSpec("json_schema", request.guided_json, "guided_json")
    if request.guided_regex is not None:
        return GuideSpec("regex", request.guided_regex, "guided_regex")
    if request.guided_grammar is not None:
        return GuideSpec("grammar", request.guided_grammar, "guided_grammar")
    if request.guided_choice is not None:
        return GuideSpec("choice", request.guided_choice, "guided_choice")
    return None
