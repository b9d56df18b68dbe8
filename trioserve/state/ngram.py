"""Prompt-lookup drafts for speculative decoding: guess a sequence's next
tokens by finding its last few tokens earlier in its own history (prompt and
output) and proposing what followed them there. Plain Python, no model: the
guess costs nothing to make, and the model checks all of it in one step
(state/scheduling.py plans it, models/step_runner.py accepts its right prefix).

Deterministic: the same history gives the same draft, so a core replays the
same plans (core/replay.py)."""

from __future__ import annotations

from collections.abc import Sequence

# Longest and shortest suffix matched; longer matches are tried first and
# the most recent occurrence wins. A single matching token guesses badly:
# on copying prompts 26% of such drafts were kept against 55% with
# matches of 2 or more (bench/README.md, "Speculative decoding").
MAX_NGRAM = 3
MIN_NGRAM = 2
# How far back a match is looked for: bounds the scan of a long history.
WINDOW = 2048


def propose(history: Sequence[int], limit: int, *, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> list[int]:
    """Up to ``limit`` tokens that followed an earlier occurrence of the
    history's last n tokens: the longest n up to ``max_n`` found (at least
    ``min_n``), and of those the most recent. [] when there is none or
    ``limit`` < 1."""
    size = min(len(history), WINDOW)
    if limit < 1 or size < 2:
        return []
    window = list(history[len(history) - size :])
    last = window[-1]
    best, best_len = -1, 0
    # Candidate ends of a match: earlier places of the last token, latest first.
    for j in [k for k, t in enumerate(window[:-1]) if t == last][::-1]:
        m = 1
        while m < max_n and j - m >= 0 and window[j - m] == window[size - 1 - m]:
            m += 1
        if m > best_len:
            best, best_len = j, m
            if m == max_n:
                break
    if best_len < min_n:
        return []
    return window[best + 1 : best + 1 + limit]
