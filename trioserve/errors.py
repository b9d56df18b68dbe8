"""The one error hierarchy. Each class says who caused the error; the CLI and
(later) the HTTP layer map these to exit codes and status codes in one place."""

from __future__ import annotations

from pathlib import Path


class TrioserveError(Exception):
    """Base of every error trioserve raises on purpose."""


class CheckpointError(TrioserveError):
    """A checkpoint that cannot be served: missing, truncated, corrupt, or of an
    architecture, tokenizer or quantization type trioserve does not support.

    ``str()`` is one line naming the file and the problem."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class TokenizerError(TrioserveError):
    """Tokenizer metadata that cannot be turned into a working tokenizer.
    The loader re-raises it as a CheckpointError naming the file."""


class ChatTemplateError(TrioserveError):
    """A chat template that does not compile or fails while rendering
    (including a template's own ``raise_exception``)."""
