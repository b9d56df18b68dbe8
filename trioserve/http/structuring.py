"""Strict structuring of parsed JSON request bodies into frozen attrs
records: the cattrs toolkit that the request parsers (http/schemas.py,
http/embeddings.py) build their converters from.

`strict_converter` makes a converter that takes JSON as it is, converting
nothing: a boolean field takes only true or false, an integer field refuses
2.5 and booleans, a float field takes any number, a string field takes only
strings, a Literal field only one of its values, and a ``tuple[X, ...]``
field only a JSON list. Keys a record does not declare are ignored. A
record's own fields may declare a check or a parser of their own (`field`),
which the hook that `record_hook` builds applies.

A failure anywhere below the body becomes one `RequestError` (see
`raise_request_error`) whose ``field`` is the JSON path of the first
problem, fields taken in the order the record declares them and list items
in order, and whose message starts with that path: ``messages[1].content:
expected a string or a list of content parts, got 5``. Hooks and checks
report a problem by raising `Invalid` (optionally with a path below the
value they were given); `Nested` carries one up through a list.

JSON null for a field that has a default means that default (OpenAI marks
its optional fields nullable), so ``"n": null`` is ``n = 1``.

Before any of this, `check_json_body` looks at every decoded body (`read_body`
in http/edge.py runs it): a string holding a lone UTF-16 surrogate, or
objects and lists nested deeper than MAX_JSON_DEPTH, are refused with
their JSON path.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, BaseValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn, override

from trioserve.errors import RequestError

MAX_JSON_DEPTH = 100  # objects and lists nested in a body (schemas, templates and tojson recurse)

# --- the errors that structuring raises inside, and the walk that reads them


class Invalid(ValueError):
    """One problem with one value. ``at`` is a path below the value the hook
    was given ("" for the value itself, "[2]" for its third item)."""

    def __init__(self, message: str, at: str = "") -> None:
        self.message = message
        self.at = at
        super().__init__(message)


class Nested(ValueError):
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
        if isinstance(exc, Nested):
            path, exc = _join(path, exc.at), exc.cause
        elif isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
            for note in getattr(exc, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    path = _join(path, note.name)
                elif isinstance(note, IterableValidationNote):
                    path = _join(path, f"[{note.index}]")
        elif isinstance(exc, Invalid):
            return _join(path, exc.at), exc.message
        elif isinstance(exc, KeyError):  # cattrs reading a required key that is absent
            return path, "this field is required"
        else:
            return path, "invalid value"


def raise_request_error(exc: BaseException) -> None:
    """Raise the RequestError that names the first problem under ``exc``
    (a cattrs validation error, `Invalid` or `Nested`) by its JSON path."""
    path, message = _first_problem(exc)
    raise RequestError(f"{path}: {message}" if path else message, field=path or None) from None


# --- describing values in messages


def short(text: str, limit: int = 40) -> str:
    """``text`` quoted, cut after ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def num(value: float) -> str:
    """A number as a message shows it: 3.0 as 3, a huge integer in words."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, int) and abs(value) >= 10**30:
        return "a number that large"
    return repr(value)


def got(value: object) -> str:
    """What a JSON value is, for the "got ..." end of a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return num(value)
    if isinstance(value, str):
        return f"the string {short(value)}"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def is_int(value: object) -> bool:
    """Whether ``value`` is a JSON integer (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


# --- strict hooks for JSON scalars, literals and lists


def _structure_str(value: object, _: object) -> str:
    if not isinstance(value, str):
        raise Invalid(f"expected a string, got {got(value)}")
    return value


def _structure_bool(value: object, _: object) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"expected true or false, got {got(value)}")
    return value


def _structure_int(value: object, _: object) -> int:
    if not is_int(value):
        raise Invalid(f"expected an integer, got {got(value)}")
    return value  # type: ignore[return-value]


def _structure_float(value: object, _: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise Invalid(f"expected a number, got {got(value)}")
    try:
        return float(value)
    except OverflowError:
        raise Invalid(f"the number {num(value)} is out of range") from None


def _structure_literal(value: object, type_: Any) -> object:
    choices = get_args(type_)
    if not isinstance(value, str | int | float | bool) or value not in choices:
        names = ", ".join(repr(choice) for choice in choices)
        raise Invalid(f"must be one of {names}, got {got(value)}")
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
            raise Invalid(f"expected a list, got {got(value)}")
        items = []
        for i, item in enumerate(value):
            try:
                items.append(item_hook(item, item_type))
            except Exception as exc:
                raise Nested(f"[{i}]", exc) from None
        return tuple(items)

    return structure


# --- per-field checks and parsers, declared in field metadata

_CHECK = "trioserve.check"  # (structured value) -> None, raises Invalid; not called for None
_PARSE = "trioserve.parse"  # (JSON value, converter) -> value, raises; replaces the type's hook

Check = Callable[[Any], None]


def field(default: object = attrs.NOTHING, *, check: Check | None = None, parse: Callable | None = None) -> Any:
    """An attrs field whose structured value ``check`` vets (never None),
    or whose JSON value ``parse`` reads in place of the type's own hook."""
    metadata: dict[str, object] = {}
    if check is not None:
        metadata[_CHECK] = check
    if parse is not None:
        metadata[_PARSE] = parse
    return attrs.field(default=default, metadata=metadata)


def _field_hook(attribute: attrs.Attribute, converter: cattrs.Converter) -> Callable[[object, object], object]:
    parse = attribute.metadata.get(_PARSE)
    check = attribute.metadata.get(_CHECK)
    base = converter.get_structure_hook(attribute.type) if parse is None else None

    def structure(value: object, type_: object) -> object:
        result = parse(value, converter) if parse is not None else base(value, type_)
        if check is not None and result is not None:
            check(result)
        return result

    return structure


def record_hook(cls: type, converter: cattrs.Converter) -> Callable[[object, object], object]:
    """The structure hook of the attrs record ``cls``: from a JSON object
    only, its fields' checks and parsers applied, null meaning a default."""
    overrides = {
        attribute.name: override(struct_hook=_field_hook(attribute, converter))
        for attribute in attrs.fields(cls)
        if _PARSE in attribute.metadata or _CHECK in attribute.metadata
    }
    generated = make_dict_structure_fn(cls, converter, _cattrs_detailed_validation=True, **overrides)
    # JSON null for a field with a default means that default, as OpenAI's
    # nullable fields do ("n": null, "stream": null, "logprobs": null, ...);
    # fields whose default is None take null as it is.
    defaulted = frozenset(f.name for f in attrs.fields(cls) if f.default is not attrs.NOTHING and f.default is not None)

    def structure(value: object, type_: object) -> object:
        if not isinstance(value, dict):
            raise Invalid(f"expected an object, got {got(value)}")
        if any(value.get(name, 0) is None for name in defaulted):
            value = {key: item for key, item in value.items() if not (item is None and key in defaulted)}
        return generated(value, type_)

    return structure


def strict_converter(*records: type) -> cattrs.Converter:
    """A converter with the strict hooks for JSON scalars, Literals and
    ``tuple[X, ...]``, and a `record_hook` for each of ``records`` (a record
    before the records that hold it)."""
    converter = cattrs.Converter(detailed_validation=True)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook_func(lambda t: get_origin(t) is Literal, _structure_literal)
    converter.register_structure_hook_factory(_is_homogeneous_tuple, _tuple_hook)
    for cls in records:
        attrs.resolve_types(cls)
        converter.register_structure_hook(cls, record_hook(cls, converter))
    return converter


# --- the whole body, before it is parsed

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


# A lone surrogate reaches a parsed body through a JSON escape, or as the
# three bytes UTF-8 would give it (not valid UTF-8, but json.loads decodes
# bytes with surrogatepass); a string's text, for finding the brackets
# outside them.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NESTING_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _plainly_fine(raw: bytes) -> bool:
    """The JSON text ``raw`` holds no surrogate escape and nests at most
    MAX_JSON_DEPTH deep: what `check_json_body` looks for cannot be in it.
    Scans in C (regular expressions, bytes methods), so a body of a million
    tiny values costs milliseconds; False sends it to the full walk."""
    if json.detect_encoding(raw) != "utf-8" or _SURROGATE_ESCAPE.search(raw):
        return False  # UTF-16 or -32 text (JSON allows them), or an escape to look at
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return True
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_NESTING_STEP.__getitem__, brackets)), default=0) <= MAX_JSON_DEPTH


_KEY = object()  # marks a walk entry that is an object's key, not a value


def check_json_body(body: object, raw: bytes | None = None) -> None:
    """Raise RequestError naming the first problem in the parsed JSON
    ``body``, in document order: a string (a key or a value, at any depth)
    holding a lone UTF-16 surrogate, or an object or list nested more than
    MAX_JSON_DEPTH deep. JSON lets a lone surrogate through ("\\ud800"),
    but it is not Unicode: nothing can encode it, tokenize it or send it
    back. With the ``raw`` text it was parsed from, a scan of that text
    first rules both out for nearly every body (`_plainly_fine`). The walk
    keeps its own stack, so any depth json.loads accepted is walked, with
    a small constant amount of work per value: each entry points at its
    parent, and a path is spelled out only for the error (a body of a
    million empty lists took seconds when every element's path was
    formatted)."""
    if raw is not None and _plainly_fine(raw):
        return
    stack: list[tuple] = [(body, 0, None, None)]  # (value, depth, parent entry, its key or index there)
    pop, push = stack.pop, stack.append
    while stack:
        entry = pop()
        value = entry[0]
        if isinstance(value, str):
            if value.isascii():
                continue
            char = _lone_surrogate(value)
            if char is not None:
                path = _entry_path(entry)
                what = "a key" if entry[3] is _KEY else "the text"
                raise RequestError(
                    f"{path or 'the request body'}: {what} contains a lone UTF-16 surrogate (\\u{ord(char):04x}), which is not valid Unicode",
                    field=path or None,
                )
        elif isinstance(value, dict | list):
            depth = entry[1]
            if depth >= MAX_JSON_DEPTH:
                path = _entry_path(entry)
                raise RequestError(f"{path}: objects and lists may nest at most {MAX_JSON_DEPTH} deep", field=path)
            if isinstance(value, list):
                for i in range(len(value) - 1, -1, -1):
                    push((value[i], depth + 1, entry, i))
                continue
            for key, item in reversed(value.items()):
                push((item, depth + 1, entry, key))
                if not key.isascii():
                    push((key, depth, entry, _KEY))


def _entry_path(entry: tuple) -> str:
    """The JSON path of a walk entry (a key's is its object's)."""
    steps = []
    while entry[2] is not None:
        step = entry[3]
        if step is not _KEY:
            steps.append(f"[{step}]" if isinstance(step, int) else _path_key(str(step)))
        entry = entry[2]
    path = ""
    for step in reversed(steps):
        path = _join(path, step)
    return path


# --- hand-written readers' checks (responses_request.py, messages_request.py)


def refuse(field: str, message: str) -> NoReturn:
    """A RequestError naming ``field``, its message starting with it."""
    raise RequestError(f"{field}: {message}", field=field)


def expect_string(value: object, field: str) -> str:
    if not isinstance(value, str):
        refuse(field, f"expected a string, got {got(value)}")
    return value


def expect_object(value: object, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        refuse(field, f"expected an object, got {got(value)}")
    return value


def expect_list(value: object, field: str) -> list:
    if not isinstance(value, list):
        refuse(field, f"expected a list, got {got(value)}")
    return value


def renamed_field(field: str, origins: Sequence[str], renames: Sequence[tuple[re.Pattern, str]], whole: str) -> str:
    """A chat request's ``field`` as the request the client sent names it
    (Responses, Messages): ``messages[i]`` becomes what message i came from
    (``origins[i]``, else ``whole``), and the first of ``renames`` that
    matches rewrites the rest."""
    found = re.match(r"messages\[(\d+)\]", field)
    if found is not None:
        index = int(found.group(1))
        return (origins[index] if index < len(origins) else whole) + field[found.end():]
    for pattern, name in renames:
        if pattern.match(field):
            return pattern.sub(name, field, count=1)
    return field


def structure_body(converter: cattrs.Converter, body: object, cls: type) -> Any:
    """``body`` (parsed JSON) as the record ``cls``, by ``converter``; a
    RequestError naming the first problem's JSON path, or saying the body
    is not an object."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field=None)
    try:
        return converter.structure(body, cls)
    except (BaseValidationError, Invalid, Nested) as exc:
        raise_request_error(exc)
        raise  # unreachable: raise_request_error always raises
