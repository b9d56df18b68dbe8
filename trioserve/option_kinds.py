"""The kinds of value a `trioserve serve` option takes (trioserve/options.py
gives each option one): how its flag parses the text (an argparse type, whose
error argparse prints with the usage) and how its TRIOSERVE_* variable does
(a ValueError), with the parsers both use: byte sizes, switches, choices, a
state URL, and the NAME=PATH values of `--model` and `--lora`.

Like options.py, it sits in the bottom layer; it imports nothing of
trioserve's."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import attrs

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def parse_byte_size(text: str) -> int:
    """'512MiB', '2GiB', '1000000' -> bytes; ValueError otherwise."""
    number = text.strip().rstrip("BbKkMmGgIi")
    unit = text.strip()[len(number) :].lower()
    try:
        value = int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"must be a size like 512MiB or 2GiB, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"must be positive, got {text!r}")
    return value


def parse_size_or_auto(text: str) -> int | None:
    """'auto' -> None (the kernel's choice); otherwise parse_byte_size."""
    return None if text.strip().lower() == "auto" else parse_byte_size(text)


def parse_flag(text: str) -> bool:
    """'1', 'true', 'yes', 'on' -> True; '0', 'false', 'no', 'off' -> False."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {text!r}")


def choice_problem(choices: Sequence[str], value: object) -> str | None:
    """What is wrong with ``value`` as one of ``choices``, or None: the one
    check every path (variables, settings, kernels) makes of a choice."""
    return None if value in choices else f"must be one of {', '.join(choices)}, got {value!r}"


def one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A parser of text that must be one of ``choices``."""

    def parse(text: str) -> str:
        problem = choice_problem(choices, text)
        if problem:
            raise ValueError(problem)
        return text

    return parse


def positive_int(text: str) -> int:
    """An argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def number_in(kind: type, low: float, high: float, what: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` within [low, high]."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, got {value}")
        return value

    return parse


def _usage(parse: Callable[[str], Any], hint: str = "") -> Callable[[str], Any]:
    """An argparse type from a parser that raises ValueError."""

    def usage(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}{hint}") from None

    return usage


@attrs.frozen
class Kind:
    """A kind of value: how a flag parses it (an argparse type; None for a
    switch, which takes no value) and how a TRIOSERVE_* variable does."""

    flag: Callable[[str], Any] | None
    variable: Callable[[str], Any]


TEXT = Kind(str, str)
POSITIVE_INT = Kind(positive_int, int)
PORT = Kind(number_in(int, 0, 65535, "a port number"), int)
SECONDS = Kind(number_in(float, 1e-3, 1e9, "a number of seconds"), float)
MILLISECONDS = Kind(number_in(float, 0, 3_600_000, "a number of milliseconds"), float)
BYTES = Kind(_usage(parse_byte_size), parse_byte_size)
BYTES_OR_AUTO = Kind(_usage(parse_size_or_auto, " (or auto)"), parse_size_or_auto)
SWITCH = Kind(None, parse_flag)


def state_url(text: str) -> str:
    """A PostgreSQL URL (the only shared state store there is)."""
    if not text.startswith(("postgresql://", "postgres://")):
        got = f"{text.split('://')[0]}://" if "://" in text else "no scheme"  # never the rest: it may hold a password
        raise ValueError(f"a state URL starts with postgresql:// (got {got})")
    return text


STATE_URL = Kind(_usage(state_url), state_url)


def split_model(text: str) -> tuple[str | None, str]:
    """A `--model` value: (NAME, PATH) from NAME=PATH, or (None, text)
    when there is no name (a NAME has no "/" and neither side is empty)."""
    name, sep, path = text.partition("=")
    if sep and name and path and "/" not in name:
        return name, path
    return None, text


def lora_spec(text: str) -> tuple[str, str]:
    """A `--lora` value: (NAME, PATH); ValueError without a name."""
    name, path = split_model(text)
    if name is None:
        raise ValueError(f"--lora takes NAME=PATH (the adapter's model name, then its directory), got {text!r}")
    return name, path

