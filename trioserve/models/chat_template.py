"""Turning a list of chat messages into the prompt text a model was trained on.

Checkpoints ship their chat format as a Jinja template (Hugging Face's
convention). This module owns compiling it once in a sandbox with the helpers
such templates expect, and rendering it; every failure becomes
ChatTemplateError.

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


class ChatTemplate:
    """A compiled chat template; `render` may be called from any thread."""

    def __init__(self, source: str | None, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.is_default = source is None
        self.source = CHATML_TEMPLATE if source is None else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from exc

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
            return self._template.render(context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


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
