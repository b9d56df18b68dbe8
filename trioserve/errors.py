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


class RequestError(TrioserveError):
    """A request the engine refuses because of what it asks for (HTTP 400).
    ``field`` names the offending input when there is one."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


class RequestTooLarge(RequestError):
    """Prompt + max_tokens can never fit the model's context or the KV pool."""


class QueueFull(TrioserveError):
    """The waiting queue is at its limit (HTTP 429); try again after ``retry_after`` seconds."""

    def __init__(self, waiting: int, retry_after: float) -> None:
        self.waiting = waiting
        self.retry_after = retry_after
        super().__init__(f"the server is at capacity ({waiting} requests waiting); retry after {retry_after:g} s")


class EngineDead(TrioserveError):
    """The engine stopped after a fault that may have left the device state
    half-updated (HTTP 503). ``cause`` says what happened."""

    def __init__(self, cause: str) -> None:
        self.cause = cause
        super().__init__(f"the engine is dead: {cause}")


class EngineClosed(TrioserveError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


def sole_error(group: BaseExceptionGroup) -> BaseException:
    """The one exception inside ``group`` (nested groups included), or the
    group itself when there are several: what a nursery's wrapping hides
    when one thing failed."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else group
