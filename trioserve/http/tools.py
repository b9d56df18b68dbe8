"""Tools in the prompt: rendering `tools`, earlier calls and their results
into the text the model reads.

A checkpoint whose chat template knows about tools (it reads the `tools`
variable) gets them as the template expects: the tool list, assistant
messages with `tool_calls`, tool messages with `tool_call_id`. Any other
template (SmolLM2's, ChatML) gets the documented fallback (docs/tools.md):

- the system message gains a paragraph listing each function as one line of
  JSON ({"name", "description", "parameters"}) and asking for calls written
  as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an earlier assistant message's calls are appended to its content in that
  same form, so the model sees what it wrote;
- a tool message keeps the role "tool"; its content is wrapped in
  ``<tool_response>`` tags.

Special tokens come only from the template and from what the server adds
here: every string a request brings (message fields, call arguments once
decoded, tool definitions) passes through a `SpecialTextShield` before it
is rendered, and `render_prompt_ids` tokenizes the pieces it hid as text.

Preparing a request (parsing it, rendering and tokenizing its prompt,
compiling its output constraint) may take long for a large body, so the
routes run it in a thread through `off_loop`, a few at a time, with a limit
of their own so that they never hold the threads the engine's steps need.

The output side (parsing calls out of the reply) is models/output_parser.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import trio

from trioserve.errors import RequestError
from trioserve.http.chat_parts import ChatMessage, Tool, ToolChoice, tools_offered
from trioserve.http.constraints import guide_spec
from trioserve.models.chat_template import ChatTemplate, SpecialTextShield
from trioserve.models.guided import GuideSpec
from trioserve.models.output_parser import CALL_CLOSE, CALL_OPEN
from trioserve.models.tokenizer import Tokenizer

FALLBACK_INTRO = "Functions you can call (one JSON line each: name, description, parameters schema):"
FALLBACK_HOW = f'To call one, reply with {CALL_OPEN}{{"name": <name>, "arguments": <object>}}{CALL_CLOSE}'

FORCED = "You must call a function now."
FORCED_NAMED = "You must call the function {name} now."

PREPARE_THREADS = 4  # requests prepared in threads at once (per trio run)
_PREPARE_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("trioserve_prepare_limiter")
T = TypeVar("T")


def _unchanged(value: Any) -> Any:
    return value


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, at most PREPARE_THREADS at once;
    its result or its exception. The engine's own threads are not counted
    against this limit. Cancelled while waiting for a thread: nothing ran.
    Cancelled while ``fn`` runs: it runs to the end (a thread cannot be
    interrupted), then Cancelled is raised."""
    try:
        limiter = _PREPARE_LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(PREPARE_THREADS)
        _PREPARE_LIMITER.set(limiter)
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)


def template_knows_tools(template: ChatTemplate) -> bool:
    return not template.is_default and "tools" in template.source


def tool_json(tool: Tool) -> dict[str, Any]:
    f = tool.function
    out: dict[str, Any] = {"name": f.name}
    if f.description:
        out["description"] = f.description
    out["parameters"] = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
    return out


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """A request message as the template (and a session's history) sees it."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls
        ]
    return out


def _arguments_value(arguments: str) -> Any:
    """A call's arguments as a value (they travel as JSON text); text that
    is not JSON stays the string it is."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def call_text(name: str, arguments: str, hide: Callable[[Any], Any] = _unchanged) -> str:
    """A call as the fallback format writes it: compact, exactly as a forced
    call is generated, so a session's kept KV still matches it. ``hide``
    applies to the arguments once decoded (escapes can spell anything)."""
    call = {"name": name, "arguments": hide(_arguments_value(arguments))}
    return CALL_OPEN + json.dumps(call, ensure_ascii=False, separators=(",", ":")) + CALL_CLOSE


def _fallback(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[dict] | None,
    choice: ToolChoice | None,
    hide: Callable[[Any], Any],
) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            written = "".join(call_text(c["function"]["name"], c["function"]["arguments"], hide) for c in calls)
            m["content"] = (m.get("content") or "") + written
        if m["role"] == "tool":
            m["content"] = f"<tool_response>{m.get('content') or ''}</tool_response>"
        m.pop("tool_call_id", None)
        out.append(m)
    if tools:
        lines = [FALLBACK_INTRO, *(json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools), FALLBACK_HOW]
        if choice is not None and choice.mode == "required":
            lines.append(FORCED)
        elif choice is not None and choice.mode == "function":
            lines.append(FORCED_NAMED.format(name=hide(choice.name)))
        paragraph = "\n".join(lines)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{paragraph}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": paragraph})
    return out


# Keys under which a schema holds schemas whose objects `closed` closes too.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed(schema: Any) -> Any:
    """A copy of a parameters schema whose objects take no keys beyond those
    they name: "additionalProperties": false wherever an object schema does
    not say, as llama.cpp's server does for calls. Clients leave it out
    (langchain's bind_tools, tools without parameters), and an open object
    lets a forced call add keys until max_tokens. allOf branches are left
    open (each names only part of the keys)."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _call_schema(tool: Tool) -> dict:
    """The JSON schema of one call to ``tool``: {"name": its name,
    "arguments": its parameters, `closed`}. A tool without parameters takes
    {}. The parameters' own definitions ($defs, definitions) move to this
    schema's root, where their "#/$defs/..." references point."""
    params = closed(dict(tool_json(tool)["parameters"]))
    hoisted = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    params.setdefault("type", "object")
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **hoisted,
        "x-guidance": {"whitespace_flexible": False},  # compact JSON: no room to wander in whitespace
    }


def forced_call_grammar(tools: Sequence[Tool], choice: ToolChoice) -> str:
    """A grammar (llguidance's Lark dialect) for exactly one call written in
    the fallback format: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    whose arguments match the function's parameter schema; any of ``tools``
    for "required", the named one otherwise. Each function's call is its
    own JSON schema, so each keeps its own definitions."""
    chosen = [t for t in tools if choice.mode == "required" or t.function.name == choice.name]
    rules = [f"call_{i}: %json {json.dumps(_call_schema(t))}" for i, t in enumerate(chosen)]
    calls = " | ".join(f"call_{i}" for i in range(len(chosen)))
    return "\n".join([f"start: {json.dumps(CALL_OPEN)} ({calls}) {json.dumps(CALL_CLOSE)}", *rules])


def call_or_reply_grammar(tools: Sequence[Tool], reply_schema: dict | bool) -> str:
    """A grammar for a reply under tool_choice auto with a response format:
    either one call to any of ``tools`` (as `forced_call_grammar` writes it)
    or a reply in words that matches ``reply_schema``. Without it the format
    would constrain the whole reply and no tool could ever be called."""
    rules = [f"call_{i}: %json {json.dumps(_call_schema(t))}" for i, t in enumerate(tools)]
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    return "\n".join(
        [
            "start: tool_call | reply",
            f"tool_call: {json.dumps(CALL_OPEN)} ({calls}) {json.dumps(CALL_CLOSE)}",
            f"reply: %json {json.dumps(reply_schema)}",
            *rules,
        ]
    )


def _forced_guides(compiler, tools: Sequence[Tool], choice: ToolChoice, n: int) -> list:
    """Guides for a forced call; a tool whose parameters cannot be compiled
    is named in the error (tools[i].function.parameters)."""
    try:
        return compiler.guides(GuideSpec("grammar", forced_call_grammar(tools, choice), "tool_choice"), n)
    except RequestError:
        for i, tool in enumerate(tools):
            field = f"tools[{i}].function.parameters"
            try:
                compiler.guides(GuideSpec("json_schema", _call_schema(tool), field), 1)
            except RequestError as exc:
                raise RequestError(str(exc).replace("invalid JSON schema", "invalid parameters schema", 1), field=field) from None
        raise


async def compile_guides(engine, request, n: int) -> list | None:
    """One output constraint (models.guided.Guide) per choice for
    ``request``: its response_format or guided_* field, or the call a
    forcing tool_choice demands; None when it asks for none. Compiled in a
    thread; a bad schema, pattern or grammar is a RequestError naming it."""
    choice = getattr(request, "tool_choice", None)
    if choice is not None and choice.mode in ("required", "function"):
        return await off_loop(_forced_guides, engine.guides, request.tools, choice, n)
    spec = guide_spec(request)
    if spec is None:
        return None
    tools = getattr(request, "tools", None)
    if spec.field.startswith("response_format") and tools_offered(tools, choice):
        schema = {"type": "object"} if spec.kind == "json_object" else spec.spec
        spec = GuideSpec("grammar", call_or_reply_grammar(tools, schema), spec.field)
    return await off_loop(engine.guides.guides, spec, n)


def _with_argument_values(message: Mapping[str, Any], hide: Callable[[Any], Any]) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    shown = []
    for c in calls:
        value = _arguments_value(c["function"]["arguments"])
        arguments = hide(value) if isinstance(value, dict) else c["function"]["arguments"]
        shown.append({**c, "function": {**c["function"], "arguments": arguments}})
    return {**message, "tool_calls": shown}


def render_prompt(
    template: ChatTemplate,
    messages: Iterable[Mapping[str, Any]],
    tools: Sequence[Tool] | None = None,
    choice: ToolChoice | None = None,
    *,
    hide: Callable[[Any], Any] = _unchanged,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for a chat: ``messages`` as `message_dict` makes them.
    ``hide`` (a `SpecialTextShield`'s) is applied to every value the request
    brought, and to nothing the server adds. ``variables``: the request's
    chat_template_kwargs (Qwen3's enable_thinking), template variables."""
    messages = [hide(dict(m)) for m in messages]
    extra = {name: hide(value) for name, value in (variables or {}).items()}
    offered = [hide(tool_json(t)) for t in tools] if tools_offered(tools, choice) else None
    if template_knows_tools(template):
        # Tool-aware templates (Qwen, Llama 3.1, Hermes) serialize arguments
        # themselves: they get the object, not its JSON text.
        shown = [_with_argument_values(m, hide) for m in messages]
        tools_shown = [{"type": "function", "function": t} for t in offered] if offered else None
        return template.render(shown, add_generation_prompt=True, tools=tools_shown, **extra)
    return template.render(_fallback(messages, offered, choice, hide), add_generation_prompt=True, **extra)


def render_prompt_ids(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Iterable[Mapping[str, Any]],
    tools: Sequence[Tool] | None = None,
    choice: ToolChoice | None = None,
    variables: Mapping[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids for a chat (see `render_prompt`): special
    tokens come only from the template and the server's own text; what the
    request brought is tokenized as text, even where it spells one. When
    no request string does, the ids are those of encoding the rendered
    text. Blocking and thread-safe: the routes run it through `off_loop`
    (``messages`` may be a lazy iterable, consumed there)."""
    shield = SpecialTextShield(tokenizer.special_tokens)
    text = render_prompt(template, messages, tools, choice, hide=shield.hide, variables=variables)
    return tokenizer.encode_rendered(text, shield.literals)
