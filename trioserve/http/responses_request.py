"""Reading a `POST /v1/responses` body into the chat request it means
(`parse_responses_request`), so the Responses API runs on the same parser,
sampling, tools and structured output as /v1/chat/completions.

Input items become chat messages (`input_messages`): a run of
``function_call`` items is one assistant message holding those calls, a
``function_call_output`` is a tool message, and reasoning items are
dropped. ``instructions`` are kept apart, to go in front as a system
message; function tools and ``tool_choice`` take their chat shapes,
``text.format`` becomes response_format and ``max_output_tokens``
max_completion_tokens. Chat's own parser then checks the whole request,
and `responses_field` tells its errors in the Responses request's own
field names (``messages[2]`` is the input item it came from).

Each top-level field is in one of the tables below: passed to chat as it
is, accepted and ignored, read here, refused with what to send instead (a
chat field sent by habit), or refused whenever it asks for something. A
field in none of them is refused as unknown, as OpenAI does.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from trioserve.errors import RequestError
from trioserve.http.schemas import ChatCompletionRequest, parse_chat_request
from trioserve.http.structuring import expect_string, got, refuse, renamed_field, short
from trioserve.http.tools import message_dict

# Chat fields a Responses request may send as they are: OpenAI's own, and
# this server's sampling extensions (as on /v1/chat/completions).
PASSED = (
    "model", "temperature", "top_p", "parallel_tool_calls", "stream", "user", "cache_salt",
    "seed", "top_k", "min_p", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "stop_token_ids",
)  # fmt: skip
# Fields accepted and ignored: they ask for nothing this server does differently.
IGNORED = (
    "reasoning", "include", "service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
    "safety_identifier", "stream_options", "max_tool_calls",
)  # fmt: skip
# What this module reads itself.
HANDLED = ("input", "instructions", "previous_response_id", "store", "tools", "tool_choice", "text", "max_output_tokens", "metadata", "truncation")
# Chat fields a client may send here by habit: each is refused, naming what to send instead.
CHAT_ONLY = {
    "messages": "send input (a string or a list of items)",
    "max_tokens": "send max_output_tokens",
    "max_completion_tokens": "send max_output_tokens",
    "response_format": "send text.format",
    "n": "a response has one output; send n requests, or use /v1/chat/completions",
    "logprobs": "log probabilities are not supported on /v1/responses; use /v1/chat/completions with logprobs",
    "functions": "send tools",
    "function_call": "send tool_choice",
}
# Fields refused whenever they ask for something (null, false, 0 or their default ask for nothing).
REFUSED = {
    "background": "background responses are not supported; send stream true to read a long response as it comes",
    "conversation": "conversations are not supported; chain responses with previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "top_logprobs": "log probabilities are not supported on /v1/responses; use /v1/chat/completions with logprobs",
}
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")


# --- the request


@attrs.frozen
class ResponsesRequest:
    """A Responses request: the chat request it means, its new messages as
    the template sees them, and what the response object repeats back."""

    chat: ChatCompletionRequest
    messages: tuple[dict[str, Any], ...]  # the input's, after message_dict
    instructions: str | None
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    max_output_tokens: int | None
    tools: tuple[dict[str, Any], ...]  # as the request sent them, for the echo
    tool_choice: str | dict[str, Any]
    text_format: dict[str, Any]
    truncation: str


def _content_text(content: object, at: str, role: str) -> str | None:
    """A message's content as one string: parts joined by newlines."""
    if content is None and role == "assistant":
        return None
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        refuse(at, f"expected a string or a list of content parts, got {got(content)}")
    texts = []
    for j, part in enumerate(content):
        where = f"{at}[{j}]"
        if not isinstance(part, dict):
            refuse(where, f"expected a content part (an object), got {got(part)}")
        kind = part.get("type")
        if kind == "refusal" and role == "assistant":
            texts.append(expect_string(part.get("refusal"), f"{where}.refusal"))
            continue
        if not isinstance(kind, str) or kind not in TEXT_PARTS:
            refuse(f"{where}.type", f"only text parts are supported ('input_text', 'output_text'), got {got(kind)}")
        texts.append(expect_string(part.get("text"), f"{where}.text"))
    return "\n".join(texts)


def input_messages(value: object) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages an ``input`` means, each with the path it came from."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    if value is None:
        refuse("input", "this field is required")
    if not isinstance(value, list):
        refuse("input", f"expected a string or a list of input items, got {got(value)}")
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    calls_open = False  # the last message is an assistant message that calls may join
    for i, item in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            refuse(at, f"expected an input item (an object), got {got(item)}")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                refuse(f"{at}.role", f"must be one of {', '.join(map(repr, MESSAGE_ROLES))}, got {got(role)}")
            messages.append({"role": role, "content": _content_text(item.get("content"), f"{at}.content", role)})
            origins.append(at)
            calls_open = role == "assistant"
        elif kind == "function_call":
            call = {
                "id": expect_string(item.get("call_id"), f"{at}.call_id"),
                "type": "function",
                "function": {"name": expect_string(item.get("name"), f"{at}.name"), "arguments": expect_string(item.get("arguments"), f"{at}.arguments")},
            }
            if calls_open:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(at)
                calls_open = True
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{at}.output", "tool")
            messages.append({"role": "tool", "tool_call_id": expect_string(item.get("call_id"), f"{at}.call_id"), "content": text})
            origins.append(at)
            calls_open = False
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: templates show none of it again
        elif kind == "item_reference":
            refuse(f"{at}.type", "item references are not supported; send previous_response_id, or the items themselves")
        else:
            refuse(
                f"{at}.type",
                f"{got(kind)} items are not supported (supported: 'message', 'function_call', 'function_call_output', 'reasoning')",
            )
    if not messages:
        refuse("input", "must hold at least one message or function call output")
    return messages, origins


def _chat_tools(value: object) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        refuse("tools", f"expected a list of tools, got {got(value)}")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            refuse(f"tools[{i}]", f"expected a tool (an object), got {got(tool)}")
        if tool.get("type") != "function":
            refuse(f"tools[{i}].type", f"only function tools are supported; {got(tool.get('type'))} is not one this server has")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    return out


def _chat_tool_choice(value: object) -> str | dict[str, Any] | None:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": expect_string(value.get("name"), "tool_choice.name")}}
    if isinstance(value, dict):
        refuse("tool_choice.type", f"only function tools can be chosen, got {got(value.get('type'))}")
    refuse("tool_choice", f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"name\": ...}}, got {got(value)}")


def _response_format(text: object) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(chat's response_format, the text.format to repeat back)."""
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict):
        refuse("text", f"expected an object, got {got(text)}")
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict):
        refuse("text.format", f"expected an object, got {got(fmt)}")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}, {"type": kind}
    if kind != "json_schema":
        refuse("text.format.type", f"must be one of 'text', 'json_object', 'json_schema', got {got(kind)}")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}, {"type": "json_schema", **spec}


def _metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        refuse("metadata", f"expected an object of strings, got {got(value)}")
    if len(value) > 16:
        refuse("metadata", f"at most 16 keys are allowed, got {len(value)}")
    for key, item in value.items():
        if len(key) > 64:
            refuse("metadata", f"a key may be at most 64 characters, got {short(key)}")
        if not isinstance(item, str) or len(item) > 512:
            refuse(f"metadata.{key}", f"expected a string of at most 512 characters, got {got(item)}")
    return dict(value)


# Chat's field paths, as the Responses request names them.
_RENAMES = (
    (re.compile(r"max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"max_tokens"), "max_output_tokens"),  # the scheduler's refusals name the engine's field
    (re.compile(r"tools(\[\d+\])\.function"), r"tools\1"),
    (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"response_format\.json_schema"), "text.format"),
    (re.compile(r"response_format"), "text.format"),
    (re.compile(r"messages$"), "input"),
)


def responses_field(error: RequestError, origins: list[str]) -> RequestError:
    """A RequestError about the chat request, told in the Responses
    request's fields: ``messages[2]`` is the input item it came from."""
    field = error.field
    if field is None:
        return error
    renamed = renamed_field(field, origins, _RENAMES, "input")
    if renamed == field:
        return error
    message = str(error)
    message = renamed + message[len(field):] if message.startswith(field) else message
    if renamed == "max_output_tokens":  # the engine's words for it, inside the message too
        message = re.sub(r"\bmax_(completion_)?tokens\b", "max_output_tokens", message)
    return type(error)(message, field=renamed)  # RequestTooLarge stays one


def parse_responses_request(body: object) -> ResponsesRequest:
    """The Responses request in ``body`` (parsed JSON), or RequestError
    naming the field in the request's own terms."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field=None)
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, 0, {}):
            refuse(name, why)
    _check_fields(body)
    truncation = body.get("truncation") or "disabled"
    if truncation != "disabled":
        refuse("truncation", f"only 'disabled' is supported (a prompt too long for the model is refused, never cut), got {got(truncation)}")
    instructions = body.get("instructions")
    if instructions is not None:
        expect_string(instructions, "instructions")
    previous = body.get("previous_response_id")
    if previous is not None:
        expect_string(previous, "previous_response_id")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        refuse("store", f"expected true or false, got {got(store)}")
    messages, origins = input_messages(body.get("input"))
    response_format, text_format = _response_format(body.get("text"))
    chat: dict[str, Any] = {name: body[name] for name in PASSED if name in body}
    chat["messages"] = messages
    for name, value in (
        ("tools", _chat_tools(body.get("tools"))),
        ("tool_choice", _chat_tool_choice(body.get("tool_choice"))),
        ("response_format", response_format),
        ("max_completion_tokens", body.get("max_output_tokens")),
    ):
        if value is not None:
            chat[name] = value
    try:
        request = parse_chat_request(chat)
    except RequestError as exc:
        raise responses_field(exc, origins) from None
    choice = body.get("tool_choice")
    return ResponsesRequest(
        chat=request,
        messages=tuple(message_dict(m) for m in request.messages),
        instructions=instructions,
        previous_response_id=previous,
        store=store is not False,
        metadata=_metadata(body.get("metadata")),
        max_output_tokens=request.max_completion_tokens,
        tools=tuple(_echo_tool(t) for t in body.get("tools") or ()),
        tool_choice=choice if choice is not None else "auto",
        text_format=text_format,
        truncation=truncation,
    )


def _check_fields(body: dict[str, Any]) -> None:
    """Refuse, by name, a field this API does not have (as OpenAI does) or
    a chat field sent here by habit; null asks for nothing and passes."""
    for name, value in body.items():
        if value is None:
            continue
        if name in CHAT_ONLY:
            refuse(name, f"not a field of the Responses API; {CHAT_ONLY[name]}")
        if name not in PASSED and name not in IGNORED and name not in HANDLED and name not in REFUSED:
            refuse(name[:64], "unknown field (docs/responses.md lists the fields this server takes)")
    include = body.get("include")
    if isinstance(include, list) and "message.output_text.logprobs" in include:
        refuse("include", "log probabilities are not supported on /v1/responses; use /v1/chat/completions with logprobs")


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "description": None, "parameters": None, "strict": None, **tool}
