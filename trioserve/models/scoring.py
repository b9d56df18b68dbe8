"""Scoring a prompt (SamplingParams.prompt_logprobs): each prompt position's
logits turned into the log-probability of the prompt token that follows
it, that token's rank, and the likeliest tokens there. Pure torch, no trio;
the step runner calls it in the device thread on the logits of a prefill
(models/step_runner.py), a slice of rows at a time.

The numbers are the sampler's (models/sampling.py): the log_softmax of the
raw float32 logits (kernels/sampler_math.py, the same bits on every CPU) over the tokenizer's vocabulary, row by row, and the
same top list with ties taken by lowest id. So the score of prompt token
k + 1 is, bit for bit, the logprob a request with the first k + 1 prompt
tokens as its prompt reports for that token when it generates it: the
forward pass gives the same logits for a prompt row alone or batched
(batch invariance), and each row here is computed from itself alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trioserve.kernels.logits import best_logprobs
from trioserve.kernels.sampler_math import FIXED, Numerics
from trioserve.types import PromptLogprob


def score_rows(
    logits: torch.Tensor, targets: Sequence[int], top: Sequence[int], vocab_size: int, numerics: Numerics = FIXED
) -> list[PromptLogprob]:
    """One PromptLogprob per row of ``logits`` ([R, V] on any device, any
    float dtype): row r scores token ``targets[r]`` and lists the
    ``top[r]`` likeliest tokens."""
    rows = len(targets)
    if logits.dim() != 2 or logits.shape[0] != rows or len(top) != rows:
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {rows} scored rows")
    raw = logits.detach().to(device="cpu", dtype=torch.float32)[:, :vocab_size]
    lp = numerics.log_softmax(raw.contiguous())
    target = torch.tensor(list(targets), dtype=torch.long)
    chosen = lp.gather(1, target[:, None])
    # Rank 1 is the likeliest; a token tied with others ranks after them all.
    ranks = (lp >= chosen).sum(1).tolist()
    chosen_values = chosen.flatten().tolist()
    longest = max(top, default=0)
    best_values: list[list[float]] = []
    best_ids: list[list[int]] = []
    if longest:
        # One past the longest list, to see a tie at its end (as the sampler does).
        values, ids = torch.topk(lp, min(longest + 1, lp.shape[1]), dim=1)
        best_values, best_ids = values.tolist(), ids.tolist()
    out = []
    for r in range(rows):
        best = best_logprobs(lp[r], top[r], best_values[r], best_ids[r]) if top[r] else ()
        out.append(PromptLogprob(int(targets[r]), chosen_values[r], int(ranks[r]), best))
    return out
