"""Reading a `POST /v1/messages` body (Anthropic's Messages API) into the
chat request it means (`parse_messages_request`), so that it runs on the
same parser, sampling, tools, forced calls and output parsing as
/v1/chat/completions.

How the conversation becomes chat messages:

- ``system`` (a string, or text blocks joined by newlines) is a system
  message in front;
- a user message's text blocks are a user message; each ``tool_result``
  block is a tool message (``tool_use_id`` its ``tool_call_id``; its text,
  marked when ``is_error``), in the order the blocks come;
- an assistant message's text blocks are its content and its ``tool_use``
  blocks its tool calls (``input`` as JSON text); ``thinking`` and
  ``redacted_thinking`` blocks are dropped, as chat templates show no
  earlier reasoning;
- a final assistant message of text only is a prefill: it is not a message
  but the start of the reply, which the model continues.

Every top-level field is in one of the tables below: passed to chat as it
is, read here, accepted and ignored, or refused when it asks for
something. Anything else is refused as unknown, as Anthropic does. Chat's
own parser then checks the whole request, and `anthropic_field` tells its
errors in this request's field names (``messages[1].content[2]`` for the
block a chat message came from).
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from trioserve.errors import RequestError
from trioserve.http.schemas import ChatCompletionRequest, parse_chat_request
from trioserve.http.structuring import expect_list, expect_object, expect_string, got, is_int, refuse, renamed_field, short
from trioserve.http.tools import message_dict

# Fields passed to chat as they are: Anthropic's sampling fields, and this
# server's sampling and guided-decoding extensions (as on /v1/chat/completions).
PASSED = (
    "model", "temperature", "top_p", "top_k", "stream",
    "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "stop_token_ids",
    "guided_json", "guided_regex", "guided_grammar", "guided_choice",
)  # fmt: skip
# What this module reads itself.
HANDLED = ("messages", "system", "max_tokens", "stop_sequences", "tools", "tool_choice", "metadata", "thinking", "output_config")
# Accepted and ignored: they ask for nothing this server does differently
# (prompt caching here is automatic, and there is one tier and one region).
IGNORED = ("cache_control", "service_tier", "inference_geo", "speed", "diagnostics", "context_management", "user_profile_id", "workspace_id")
# Refused whenever they ask for something (null, an empty list or object ask for nothing).
REFUSED = {
    "container": "containers (Anthropic's code execution) are not supported",
    "mcp_servers": "MCP servers are not supported; give their tools in tools and run them yourself",
}
ROLES = ("user", "assistant")
SUPPORTED_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
TOOL_CHOICES = ("auto", "any", "tool", "none")
THINKING = ("enabled", "disabled", "adaptive", "between_tools")
ERROR_MARK = "Error: "  # what a tool_result with is_error true starts with in the prompt


@attrs.frozen
class MessagesRequest:
    """A Messages request: the chat request it means, its messages as the
    template sees them, and what only this API has."""

    chat: ChatCompletionRequest
    messages: tuple[dict[str, Any], ...]  # system first, as `message_dict` makes them
    origins: tuple[str, ...]  # each chat message's place in the request (for errors)
    prefill: str | None  # a final assistant message's text: the reply continues it
    stop_sequences: tuple[str, ...]


# --- content blocks


def _text_blocks(value: object, field: str) -> str:
    """A string, or a list of text blocks joined by newlines (``system``,
    a tool_result's content)."""
    if isinstance(value, str):
        return value
    texts = []
    for j, block in enumerate(expect_list(value, field)):
        at = f"{field}[{j}]"
        kind = expect_object(block, at).get("type")
        if kind != "text":
            refuse(f"{at}.type", f"only text blocks are supported here, got {got(kind)}")
        texts.append(expect_string(block.get("text"), f"{at}.text"))
    return "\n".join(texts)


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        refuse(f"{at}.input", f"expected an object, got {got(arguments)}")
    return {
        "id": expect_string(block.get("id"), f"{at}.id"),
        "type": "function",
        "function": {"name": expect_string(block.get("name"), f"{at}.name"), "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    content = block.get("content")
    text = "" if content is None else _text_blocks(content, f"{at}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        refuse(f"{at}.is_error", f"expected true or false, got {got(is_error)}")
    if is_error:
        text = ERROR_MARK + text
    return {"role": "tool", "tool_call_id": expect_string(block.get("tool_use_id"), f"{at}.tool_use_id"), "content": text}


def _blocks(role: str, content: list, at: str) -> tuple[list[tuple[dict[str, Any], str]], bool]:
    """The chat messages of one message's content blocks, each with the path
    it came from; and whether they hold anything but text."""
    out: list[tuple[dict[str, Any], str]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    text_at = None
    other = False

    def flush_text() -> None:
        nonlocal text_at
        if texts:
            out.append(({"role": role, "content": "\n".join(texts)}, text_at))
            texts.clear()
            text_at = None

    for j, block in enumerate(content):
        where = f"{at}[{j}]"
        kind = expect_object(block, where).get("type")
        if kind not in SUPPORTED_BLOCKS[role]:
            other_role = "assistant" if role == "user" else "user"
            if kind in SUPPORTED_BLOCKS[other_role] and kind != "text":
                refuse(f"{where}.type", f"{kind} blocks belong in {other_role} messages, not in {role} messages")
            supported = ", ".join(map(repr, SUPPORTED_BLOCKS[role]))
            named = short(kind) if isinstance(kind, str) else got(kind)
            refuse(f"{where}.type", f"{named} blocks are not supported in {role} messages (supported: {supported})")
        if kind == "text":
            texts.append(expect_string(block.get("text"), f"{where}.text"))
            text_at = text_at or where
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
            other = True
        elif kind == "tool_result":
            flush_text()
            out.append((_tool_result(block, where), where))
            other = True
        # thinking and redacted_thinking: earlier reasoning, which no template shows again
    if role == "assistant":
        if texts or calls:
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if calls:
                message["tool_calls"] = calls
            out.append((message, at))
        return out, other
    flush_text()
    return out, other


def _conversation(value: object) -> tuple[list[dict[str, Any]], list[str], str | None]:
    """(chat messages, the path each came from, the prefill) of ``messages``."""
    if value is None:
        refuse("messages", "this field is required")
    items = expect_list(value, "messages")
    if not items:
        refuse("messages", "must hold at least one message")
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    prefill = None
    for i, item in enumerate(items):
        at = f"messages[{i}]"
        role = expect_object(item, at).get("role")
        if role not in ROLES:
            hint = " (send a system prompt in the top-level system field)" if role == "system" else ""
            refuse(f"{at}.role", f"must be 'user' or 'assistant', got {got(role)}{hint}")
        content = item.get("content")
        if isinstance(content, str):
            if role == "assistant" and i == len(items) - 1:
                prefill = content
                continue
            messages.append({"role": role, "content": content})
            origins.append(at)
            continue
        if content is None:
            refuse(f"{at}.content", "this field is required")
        if not isinstance(content, list):
            refuse(f"{at}.content", f"expected a string or a list of content blocks, got {got(content)}")
        made, other = _blocks(role, content, f"{at}.content")
        if role == "assistant" and i == len(items) - 1 and not other:
            prefill = made[0][0]["content"] if made else ""
            continue
        for message, origin in made:
            messages.append(message)
            origins.append(origin)
    if not messages:
        refuse("messages", "must hold a message before a final assistant message (its text is where the reply starts)")
    return messages, origins, prefill


# --- tools and the other fields


def _chat_tools(value: object) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    out = []
    for i, tool in enumerate(expect_list(value, "tools")):
        at = f"tools[{i}]"
        kind = expect_object(tool, at).get("type")
        if kind not in (None, "custom"):
            refuse(f"{at}.type", f"only custom tools (name, description, input_schema) are supported; {got(kind)} is a server tool this server does not have")
        if tool.get("input_schema") is None:
            refuse(f"{at}.input_schema", "this field is required")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(value: object, tools: list[dict[str, Any]] | None) -> tuple[str | dict[str, Any] | None, bool]:
    """(chat's tool_choice, chat's parallel_tool_calls) of ``tool_choice``."""
    if value is None:
        return None, True
    choice = expect_object(value, "tool_choice")
    kind = choice.get("type")
    if kind not in TOOL_CHOICES:
        refuse("tool_choice.type", f"must be one of {', '.join(map(repr, TOOL_CHOICES))}, got {got(kind)}")
    serial = choice.get("disable_parallel_tool_use")
    if serial is not None and not isinstance(serial, bool):
        refuse("tool_choice.disable_parallel_tool_use", f"expected true or false, got {got(serial)}")
    names = [t["function"]["name"] for t in tools or ()]
    if kind in ("any", "tool") and not names:
        refuse("tool_choice", f"{kind!r} needs tools")
    if kind == "tool":
        name = expect_string(choice.get("name"), "tool_choice.name")
        if name not in names:
            refuse("tool_choice.name", f"no tool named {short(name)} (tools: {', '.join(map(str, names))})")
        return {"type": "function", "function": {"name": name}}, not serial
    return {"auto": "auto", "any": "required", "none": "none"}[kind], not serial


def _user(value: object) -> str | None:
    if value is None:
        return None
    metadata = expect_object(value, "metadata")
    for key in metadata:
        if key != "user_id":
            refuse(f"metadata.{str(key)[:64]}", "unknown field (metadata takes user_id)")
    user = metadata.get("user_id")
    return None if user is None else expect_string(user, "metadata.user_id")


def _check_thinking(value: object, max_tokens: object) -> None:
    """``thinking`` is checked and accepted; it changes nothing (the
    reasoning channel, where the model has one, is split out regardless)."""
    if value is None:
        return
    kind = expect_object(value, "thinking").get("type")
    if kind not in THINKING:
        refuse("thinking.type", f"must be one of {', '.join(map(repr, THINKING))}, got {got(kind)}")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if not is_int(budget) or budget < 1:
            refuse("thinking.budget_tokens", f"expected a whole number of at least 1, got {got(budget)}")
        if is_int(max_tokens) and budget >= max_tokens:
            refuse("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens}), got {budget}")


def _response_format(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    fmt = expect_object(value, "output_config").get("format")
    effort = value.get("effort")
    if effort is not None:
        expect_string(effort, "output_config.effort")  # accepted; there is one way to generate here
    if fmt is None:
        return None
    kind = expect_object(fmt, "output_config.format").get("type")
    if kind != "json_schema":
        refuse("output_config.format.type", f"must be 'json_schema', got {got(kind)}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def _stop_sequences(value: object) -> list[str] | None:
    if value is None:
        return None
    return expect_list(value, "stop_sequences")  # chat's stop checks each (renamed back by anthropic_field)


# Chat's field paths, as a Messages request names them.
_RENAMES = (
    (re.compile(r"max_(completion_)?tokens"), "max_tokens"),
    (re.compile(r"stop\b"), "stop_sequences"),
    (re.compile(r"tools(\[\d+\])\.function\.parameters"), r"tools\1.input_schema"),
    (re.compile(r"tools(\[\d+\])\.function"), r"tools\1"),
    (re.compile(r"parallel_tool_calls"), "tool_choice.disable_parallel_tool_use"),
    (re.compile(r"user\b"), "metadata.user_id"),
    (re.compile(r"response_format\.json_schema"), "output_config.format"),
    (re.compile(r"response_format"), "output_config.format"),
    (re.compile(r"prompt\b"), "messages"),  # the engine's word for the rendered conversation
)


def anthropic_field(error: RequestError, origins: tuple[str, ...] | list[str] = ()) -> RequestError:
    """A RequestError about the chat request, told in the Messages request's
    fields: ``messages[2]`` is the block or message it came from."""
    field = error.field
    if field is None:
        return error
    renamed = renamed_field(field, origins, _RENAMES, "messages")
    if renamed == field:
        return error
    message = str(error)
    message = renamed + message[len(field):] if message.startswith(field + ":") else f"{renamed}: {message}"
    return type(error)(message, field=renamed)  # RequestTooLarge stays one


def parse_messages_request(body: object, *, counting: bool = False) -> MessagesRequest:
    """The Messages request in ``body`` (parsed JSON), or RequestError naming
    the field in the request's own terms. ``counting``: a count_tokens body,
    which needs no max_tokens."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field=None)
    for name, value in body.items():
        if value is None or name in PASSED or name in HANDLED or name in IGNORED:
            continue
        if name in REFUSED:
            if value not in ([], {}, False):
                refuse(name, REFUSED[name])
            continue
        refuse(str(name)[:64], "unknown field (docs/api.md lists the fields /v1/messages takes)")
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not counting:
        refuse("max_tokens", "this field is required (the most tokens the reply may have)")
    _check_thinking(body.get("thinking"), max_tokens)
    system = body.get("system")
    head = [] if system is None else [{"role": "system", "content": _text_blocks(system, "system")}]
    messages, origins, prefill = _conversation(body.get("messages"))
    tools = _chat_tools(body.get("tools"))
    tool_choice, parallel = _chat_tool_choice(body.get("tool_choice"), tools)
    chat: dict[str, Any] = {name: body[name] for name in PASSED if body.get(name) is not None}
    chat["messages"] = head + messages
    chat["parallel_tool_calls"] = parallel
    for name, value in (
        ("max_tokens", None if counting else max_tokens),
        ("stop", _stop_sequences(body.get("stop_sequences"))),
        ("tools", tools),
        ("tool_choice", tool_choice),
        ("user", _user(body.get("metadata"))),
        ("response_format", _response_format(body.get("output_config"))),
    ):
        if value is not None:
            chat[name] = value
    origins = ["system"] * len(head) + origins
    try:
        request = parse_chat_request(chat)
    except RequestError as exc:
        raise anthropic_field(exc, origins) from None
    stop = request.stop if isinstance(request.stop, tuple) else ()
    return MessagesRequest(
        chat=request,
        messages=tuple(message_dict(m) for m in request.messages),
        origins=tuple(origins),
        prefill=prefill,
        stop_sequences=stop,
    )
