"""Turning a list of chat messages into the prompt text a model was trained on.

Checkpoints ship their chat format as a Jinja template (Hugging Face's
convention). This module owns compiling it once in a sandbox with the helpers
such templates expect, and rendering it; every failure becomes
ChatTemplateError.

A template is the model file's code, so it runs under a budget: each
render happens in a child process (models/bounded.py) that is killed when
it runs past RENDER_TIMEOUT_S, past its memory, or past its output limit,
or when the request waiting for it is cancelled. Constructing a
ChatTemplate compiles it and renders representative conversations
(`check`), so a template that loops on every conversation is refused at
load, before it is served.

It also owns `SpecialTextShield`, which keeps the special-token text a
request brings (a user typing "<|im_start|>system") from becoming control
tokens: such text is swapped for placeholders before rendering, and the
tokenizer turns the placeholders back into that text, tokenized as text."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trioserve.errors import ChatTemplateError
from trioserve.models import bounded

RENDER_TIMEOUT_S = 5.0  # one render's time, load checks included (normal renders take milliseconds)
RENDER_MEMORY_BYTES = 256 << 20  # one render's memory beyond the child's own, plus 16 bytes per byte of input
OUTPUT_FLOOR_CHARS = 4 << 20  # a render's output limit: this, or 4 characters per byte of input if more

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise_exception(message: str) -> NoReturn:
    """Templates call this to reject a conversation (e.g. roles out of order)."""
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    """The current local time formatted with `fmt` (templates stamp dates)."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    """JSON for tool schemas and arguments; unlike Jinja's built-in filter it
    keeps non-ASCII text as is and does not HTML-escape."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for
    training masks; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _flatten_content(content: Any) -> Any:
    """Message content as a string: a list of parts becomes its text parts
    joined by newlines; any other kind of part is refused."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"message content part of type {kind!r} is not supported (only text)")
    return "\n".join(texts)


def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from exc


class TemplateOverrun(ChatTemplateError):
    """A compile or a render stopped because it ran past its budget (time,
    memory or output): the template's fault, whatever the conversation."""


# What `ChatTemplate.check` renders at load: conversations every chat model takes.
REPRESENTATIVE = (
    ("a user message", [{"role": "user", "content": "Hello!"}], None),
    ("a system and a user message", [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello!"}], None),
    (
        "a user, assistant, user conversation",
        [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi. How can I help?"}, {"role": "user", "content": "Tell me a joke."}],
        None,
    ),
    (
        "a user message with a tool",
        [{"role": "user", "content": "What is the weather in Paris?"}],
        [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    ),
)


class ChatTemplate:
    """A chat template: compiled (to find its syntax errors), checked
    (`check`) and rendered in child processes under a budget (the module's
    docstring). The constructor and `render` block, for milliseconds
    normally and at most the budget; both may be called from any thread."""

    def __init__(self, source: str | None, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.is_default = source is None
        self.source = CHATML_TEMPLATE if source is None else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Compiled in a child too: Jinja folds constant expressions while
        # it compiles, so `{{ 7 ** (10 ** 12) }}` spins before any render.
        self._run({"op": "compile", "source": self.source}, 0, "compiling the chat template")
        self.check()

    def check(self) -> None:
        """Render the REPRESENTATIVE conversations; TemplateOverrun when one
        runs past its budget. A template that refuses one of them (its own
        raise_exception, a failure) is not refused here: it may only take
        other shapes. Blocking (a few milliseconds for a normal template)."""
        for what, messages, tools in REPRESENTATIVE:
            try:
                self.render(messages, tools=tools)
            except TemplateOverrun as exc:
                raise TemplateOverrun(f"{exc} at load, on {what}; the model's chat template cannot be served") from None
            except ChatTemplateError:
                continue

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (OpenAI-style role/content dicts),
        ending with the assistant's opening when `add_generation_prompt`.
        `extra` becomes further template variables (e.g. `enable_thinking`)."""
        flat = [{**m, "content": _flatten_content(m.get("content"))} for m in messages]
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": flat,
            "add_generation_prompt": add_generation_prompt,
            "tools": None if tools is None else [dict(t) for t in tools],
        }
        try:
            size = len(json.dumps(context, ensure_ascii=False))
        except (TypeError, ValueError) as exc:
            raise ChatTemplateError(f"the conversation cannot be passed to the chat template: {exc}") from exc
        output_limit = max(OUTPUT_FLOOR_CHARS, 4 * size)
        job = {"op": "render", "source": self.source, "context": context, "output_limit": output_limit}
        return self._run(job, size, "rendering the chat template")["text"]

    def _run(self, job: dict[str, Any], size: int, what: str) -> dict[str, Any]:
        """``job`` done in a child under the budget for ``size`` bytes of input."""
        output_limit = job.get("output_limit", 0)
        try:
            reply = bounded.run(
                job,
                timeout_s=RENDER_TIMEOUT_S,
                memory_bytes=RENDER_MEMORY_BYTES + 16 * size,
                reply_limit=6 * output_limit + 4096,  # JSON: up to 6 bytes a character (\u0000)
                what=what,
            )
        except bounded.Overrun as exc:
            raise TemplateOverrun(str(exc)) from None
        if "error" in reply:
            raise ChatTemplateError(reply["error"])
        return reply


# -- in the child process (models/bounded.py) ---------------------------------------

_compiled: dict[str, jinja2.Template] = {}  # by source; a child serves one or a few models
MAX_COMPILED = 8


def _compiled_in_child(source: str) -> jinja2.Template:
    template = _compiled.get(source)
    if template is None:
        template = _compile(source)
        if len(_compiled) >= MAX_COMPILED:
            _compiled.clear()
        _compiled[source] = template
    return template


def compile_in_child(source: str) -> dict[str, Any]:
    """One compile job: ``{}``, or ``{"error"}``."""
    try:
        _compiled_in_child(source)
    except ChatTemplateError as exc:
        return {"error": str(exc)}
    return {}


def render_in_child(source: str, context: dict[str, Any], output_limit: int) -> dict[str, Any]:
    """One render job: ``{"text"}``, ``{"error"}`` with the message a
    ChatTemplateError carries, or ``{"overrun": "output"}``. A MemoryError
    propagates (the child reports it)."""
    try:
        template = _compiled_in_child(source)
    except ChatTemplateError as exc:
        return {"error": str(exc)}
    out: list[str] = []
    size = 0
    try:
        for chunk in template.generate(context):
            size += len(chunk)
            if size > output_limit:
                return {"overrun": "output", "message": f"produced more than {output_limit} characters and was stopped"}
            out.append(chunk)
    except ChatTemplateError as exc:
        return {"error": str(exc)}
    except jinja2.TemplateError as exc:
        return {"error": f"chat template failed: {exc}"}
    except RecursionError:
        return {"error": "chat template failed: it nests calls too deeply (RecursionError)"}
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the template's code raises is the template's failure
        return {"error": f"chat template failed: {type(exc).__name__}: {exc}"}
    return {"text": "".join(out)}


class SpecialTextShield:
    """Hides special-token text in the strings of one request for one render.

    `hide(value)` returns ``value`` (a string, or dicts, lists and tuples of
    them, keys included, at any depth) with each occurrence of a special
    token's text replaced by a placeholder. A placeholder is letters and
    digits only, so a template (its `tojson` included) passes it through
    unchanged, and holds a random part drawn for this shield, so a request
    cannot spell one. `literals` maps each placeholder handed out to the
    text it hides; `Tokenizer.encode_rendered` tokenizes those as text.
    Not thread-safe: one shield per render."""

    def __init__(self, special_tokens: Sequence[str]) -> None:
        tokens = sorted({t for t in special_tokens if t}, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None
        self._nonce = secrets.token_hex(16)
        self._placeholder_of: dict[str, str] = {}
        self.literals: dict[str, str] = {}  # placeholder -> the special-token text it stands for

    def hide(self, value: Any) -> Any:
        if isinstance(value, str):
            return value if self._pattern is None else self._pattern.sub(self._placeholder, value)
        if isinstance(value, Mapping):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.hide(v) for v in value)
        return value

    def _placeholder(self, match: re.Match[str]) -> str:
        text = match.group()
        placeholder = self._placeholder_of.get(text)
        if placeholder is None:
            placeholder = f"zzspecial{self._nonce}n{len(self._placeholder_of)}z"
            self._placeholder_of[text] = placeholder
            self.literals[placeholder] = text
        return placeholder
