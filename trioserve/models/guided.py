"""Guided decoding: constraining a request's output to a JSON schema, a
regular expression, a grammar or a list of choices, with llguidance.

Why llguidance (measured on this machine, see docs/guided.md): it needs no
other package (xgrammar imports transformers), builds its tokenizer from the
`tokenizers` JSON we already have, produced no invalid output in 1,200 random
walks where xgrammar 0.2.9 let control bytes into JSON strings, and refuses
the JSON-schema keywords it cannot enforce instead of ignoring them. Its
masks cost 10-30 microseconds a token on one core, far below a forward pass,
and it releases the GIL, so masks are computed while the forward pass runs.

A `Guide` is one request's matcher: the scheduler asks it for the allowed
tokens before each sampled token (`fill_masks`, a bitmask of 32 tokens per
int32), the sampler sets every other token's logit to -inf (`apply_masks`),
and the scheduler feeds the chosen token back (`Guide.advance`). When the
constraint is complete and nothing but a stop token may follow, the request
ends with finish_reason "stop"."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import attrs
import llguidance
import llguidance.numpy
import numpy as np
import torch

from trioserve.errors import RequestError
from trioserve.models.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a small model cannot loop on whitespace


@attrs.frozen
class GuideSpec:
    """What a request constrains its output to. ``field`` names the request
    field it came from, for error messages."""

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    spec: object = None  # the schema (dict), the pattern or grammar (str), the choices (tuple)
    field: str = "response_format"


class GuideFailed(ValueError):
    """A constraint that broke down while its request ran (llguidance gave
    up: a pattern too big for its lexer, say): the request's fault, a 400
    naming ``field``. The message is llguidance's first line: never its
    internal state dump."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: the output constraint failed while generating: {message}")
        self.field = field


class Guide:
    """One request's constraint state. Not thread-safe: the scheduler and
    the mask thread take turns (the scheduler waits for the masks)."""

    def __init__(self, matcher: llguidance.LLMatcher, spec: GuideSpec) -> None:
        self.matcher = matcher
        self.spec = spec  # what it was compiled from: a trace records it, a replay compiles it again

    def advance(self, token: int) -> None:
        """Take the sampled token. Raises ValueError if it breaks the
        constraint (only possible if its mask was not applied)."""
        if not self.matcher.consume_token(token):
            error = self.matcher.get_error().split("\n", 1)[0].strip() or f"token {token} is not allowed"
            raise GuideFailed(self.spec.field, _one_line(error))

    @property
    def done(self) -> bool:
        """Nothing but a stop token can follow."""
        return self.matcher.is_stopped()


class GuideCompiler:
    """Per tokenizer: builds matchers. Building the llguidance tokenizer takes
    a moment, so it happens on first use; compiling may be called from any
    thread."""

    def __init__(self, tokenizer: Tokenizer, *, threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self._threads = threads
        self._lock = threading.Lock()
        self._lltok: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    def _llg(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor]:
        with self._lock:
            if self._lltok is None:
                tok = self.tokenizer
                self._lltok = llguidance.LLTokenizer(tok.backend_json(), n_vocab=self.vocab_size, eos_token=sorted(tok.stop_ids))
                self._executor = llguidance.LLExecutor(num_threads=self._threads)
            return self._lltok, self._executor

    def grammar(self, spec: GuideSpec) -> str:
        """The llguidance grammar for ``spec``; RequestError naming the field."""
        try:
            if spec.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=JSON_OPTIONS)
            if spec.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if spec.kind == "regex":
                # "dw": \d is [0-9] and \w [0-9a-zA-Z_], as in JSON schema, not all of Unicode.
                return llguidance.LLMatcher.grammar_from_lark("start: /" + llguidance.regex_to_lark(spec.spec, "dw") + "/")
            if spec.kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.spec))
            return llguidance.grammar_from("lark", spec.spec)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise RequestError(f"{spec.field}: {_describe(spec)}: {_one_line(exc)}", field=spec.field) from None

    def guides(self, spec: GuideSpec, count: int) -> list[Guide]:
        """``count`` fresh matchers for ``spec`` (one per choice). Blocking
        (milliseconds for a large schema): call it from a thread."""
        grammar = self.grammar(spec)
        lltok, _ = self._llg()
        out = []
        for _ in range(count):
            matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
            if matcher.is_error():
                raise RequestError(f"{spec.field}: {_describe(spec)}: {_one_line(matcher.get_error())}", field=spec.field)
            out.append(Guide(matcher, spec))
        return out

    def fill_masks(self, guides: Sequence[Guide | None]) -> torch.Tensor | None:
        """Allowed tokens for each row as an int32 bitmask [rows, words]
        (all bits set for rows without a guide); None when no row has one.
        Blocking, releases the GIL: call it from a thread."""
        wanted = [(g.matcher, i) for i, g in enumerate(guides) if g is not None]
        if not wanted:
            return None
        _, executor = self._llg()
        bitmask = np.full((len(guides), self.words), -1, dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(executor, wanted, bitmask)
        return torch.from_numpy(bitmask)


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [R, V] with every token a row's bitmask leaves out set to
    -inf (a new tensor; ``logits`` is left alone)."""
    rows, vocab = logits.shape
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.from_numpy(bits).bool()
    return logits.masked_fill(~allowed, float("-inf"))


def _describe(spec: GuideSpec) -> str:
    return {
        "json_schema": "invalid JSON schema",
        "json_object": "invalid JSON object constraint",
        "regex": "invalid regular expression",
        "grammar": "invalid grammar",
        "choice": "invalid choice list",
    }[spec.kind]


def _one_line(exc: object) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
