"""The parts of a chat request body (http/schemas.py's
`ChatCompletionRequest`): its messages, with their content parts and the
tool calls earlier replies made, and the tools it offers, with its
tool_choice. Frozen attrs records like the request's own, each field with
the check or the parser it needs (http/structuring.py's `field`), structured
by the converter schemas.py makes.

The number of tools is bounded, and so is each tool's parameter schema
(http/constraints.py's `schema_size`); docs/api.md lists the limits."""

from __future__ import annotations

import re
from typing import Literal

import attrs
import cattrs

from trioserve.http.constraints import parse_json_object, schema_size
from trioserve.http.structuring import Invalid, field, got, short

MAX_TOOLS = 128  # as OpenAI allows


# --- per-field checks and parsers


def _only_text(value: str) -> None:
    if value != "text":
        raise Invalid(f"only 'text' parts are supported, got {short(value)}")


def _parse_content(value: object, converter: cattrs.Converter) -> str | tuple[ContentPart, ...] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return converter.structure(value, tuple[ContentPart, ...])
    raise Invalid(f"expected a string or a list of content parts, got {got(value)}")


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _function_name(value: str) -> None:
    if not _FUNCTION_NAME.fullmatch(value):
        raise Invalid(f"a function name is 1 to 64 letters, digits, '_', '.' or '-', got {short(value)}")


def _object_schema(value: dict) -> None:
    if "type" in value and value["type"] != "object":
        raise Invalid(f"must be a JSON schema of an object (type 'object'), got type {got(value['type'])}")


def _tool_parameters(value: dict) -> None:
    _object_schema(value)
    schema_size(value)


def tool_count(value: tuple) -> None:
    """The check of a request's tools: at most MAX_TOOLS."""
    if len(value) > MAX_TOOLS:
        raise Invalid(f"at most {MAX_TOOLS} tools are allowed, got {len(value)}")


def parse_tool_choice(value: object, _: cattrs.Converter) -> ToolChoice | None:
    """The parser of a request's tool_choice: a mode, or the function to call."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise Invalid(f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {got(value)}")
        return ToolChoice(value)
    if not isinstance(value, dict):
        raise Invalid(f"expected a string or an object, got {got(value)}")
    if value.get("type") != "function":
        raise Invalid(f"must be 'function', got {got(value.get('type'))}", at="type")
    function = value.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Invalid("expected an object with the function's name", at="function")
    return ToolChoice("function", function["name"])


# --- the records


@attrs.frozen
class ContentPart:
    """One part of a message's content; only text parts are supported."""

    type: str = field(check=_only_text)
    text: str = field()


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
    name: str = field(check=_function_name)
    description: str | None = None
    parameters: dict | None = field(None, parse=parse_json_object, check=_tool_parameters)  # a JSON schema
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
class ChatMessage:
    # "developer" is OpenAI's newer name for "system"; templates see "system" (tools.message_dict).
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | tuple[ContentPart, ...] | None = field(None, parse=_parse_content)
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


def tools_offered(tools: tuple[Tool, ...] | None, choice: ToolChoice | None) -> bool:
    """Whether the model is shown tools (and its calls are parsed)."""
    return bool(tools) and (choice is None or choice.mode != "none")
