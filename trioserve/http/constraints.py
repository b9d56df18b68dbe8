"""The output constraints a chat or completion request may ask for
(response_format, guided_json, guided_regex, guided_grammar, guided_choice):
the parsers and checks that http/schemas.py's records declare for those
fields, the rule that a request holds at most one of them
(`given_constraints`), and the `GuideSpec` the one it holds becomes
(`guide_spec`), which `compile_guides` in http/tools.py compiles.

A constraint is compiled before generation starts, at a cost that grows
with its text, so each is bounded: a regex or a grammar to
MAX_CONSTRAINT_CHARS characters, the guided choices to MAX_GUIDED_CHOICES
strings of that many characters in all, and a JSON schema (a tool's
parameters too) to that many characters written as compact JSON.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

import attrs
import cattrs

from trioserve.errors import RequestError
from trioserve.http.structuring import Invalid, got
from trioserve.models.guided import GuideSpec

if TYPE_CHECKING:
    from trioserve.http.schemas import ChatCompletionRequest, CompletionRequest

MAX_CONSTRAINT_CHARS = 65536  # a regex, a grammar, all guided choices, or one JSON schema as compact JSON
MAX_GUIDED_CHOICES = 256


def parse_json_object(value: object, _: cattrs.Converter) -> dict | None:
    """A JSON object (a schema, say) taken as it is, or null."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Invalid(f"expected a JSON object, got {got(value)}")
    return value


def schema_size(value: dict | bool, at: str = "") -> None:
    """Refuse a JSON schema longer than MAX_CONSTRAINT_CHARS as compact JSON."""
    try:
        size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except RecursionError:
        raise Invalid("the schema is nested too deeply", at=at) from None
    if size > MAX_CONSTRAINT_CHARS:
        raise Invalid(f"a schema may be at most {MAX_CONSTRAINT_CHARS} characters of JSON, got {size}", at=at)


def constraint_text(value: str) -> None:
    """Refuse a regex or a grammar longer than MAX_CONSTRAINT_CHARS."""
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise Invalid(f"may be at most {MAX_CONSTRAINT_CHARS} characters, got {len(value)}")


@attrs.frozen
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"]
    schema: dict | bool | None = None
    name: str | None = None


def parse_response_format(value: object, _: cattrs.Converter) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Invalid(f"expected an object, got {got(value)}")
    kind = value.get("type")
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise Invalid(f"must be one of 'text', 'json_object', 'json_schema', got {got(kind)}", at="type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise Invalid(f"expected an object with the schema, got {got(spec)}", at="json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict | bool):
        raise Invalid(f"expected a JSON schema (an object), got {got(schema)}", at="json_schema.schema")
    schema_size(schema, "json_schema.schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise Invalid(f"expected a string, got {got(name)}", at="json_schema.name")
    return ResponseFormat("json_schema", schema, name)


def parse_choices(value: object, _: cattrs.Converter) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise Invalid(f"expected a non-empty list of strings, got {got(value)}")
    if len(value) > MAX_GUIDED_CHOICES:
        raise Invalid(f"at most {MAX_GUIDED_CHOICES} choices are allowed, got {len(value)}")
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text:
            raise Invalid(f"expected a non-empty string, got {got(text)}", at=f"[{i}]")
    total = sum(map(len, value))
    if total > MAX_CONSTRAINT_CHARS:
        raise Invalid(f"the choices may total at most {MAX_CONSTRAINT_CHARS} characters, got {total}")
    return tuple(value)


# --- which constraint a request holds

# The fields that constrain the output; a request may set one of them.
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")


def given_constraints(request: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """The guided-decoding fields a request sets; more than one is refused."""
    given = [name for name in CONSTRAINT_FIELDS if getattr(request, name) is not None]
    if request.response_format is not None and request.response_format.type == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise RequestError(f"{given[1]}: only one output constraint per request; {given[0]} is already set", field=given[1])
    return given


# --- onto the engine's output constraint


def guide_spec(request: ChatCompletionRequest | CompletionRequest) -> GuideSpec | None:
    """The output constraint a request asks for (at most one, see
    `given_constraints`), or None."""
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


# chat_template_kwargs (vLLM's and llama.cpp's field): template variables a
# request sets, e.g. Qwen3's {"enable_thinking": false}. Names the renderer
# sets itself cannot be overridden; the whole is bounded like a schema.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"})
MAX_TEMPLATE_KWARGS = 32


def parse_template_kwargs(value: object, _: cattrs.Converter) -> dict | None:
    """chat_template_kwargs: a JSON object of template variables, or null."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Invalid(f"expected a JSON object of template variables, got {got(value)}")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise Invalid(f"at most {MAX_TEMPLATE_KWARGS} template variables, got {len(value)}")
    for name in value:
        if not name.isidentifier():
            raise Invalid(f"{name!r} is not a template variable name (letters, digits and _, not starting with a digit)")
        if name in RESERVED_TEMPLATE_NAMES:
            raise Invalid(f"{name!r} is set by the server and cannot be given", at=name)
    schema_size(value)
    return value

