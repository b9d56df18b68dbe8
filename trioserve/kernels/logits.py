"""What both samplers do to a step's logits before and after the draw (the
torch one, models/sampling.py, and the GPU kernel's wrapper,
kernels/gpu/sampler.py): logit bias and repetition, presence and frequency
penalties, and the best (id, logprob) pairs of a row for top_logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trioserve.types import SampleRow


def processed_logits(raw: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Steps 1-3 of models/sampling.py: the logits after bias and penalties; ``raw`` itself when no
    row asks for either, otherwise a new tensor."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    penalized = [i for i, row in enumerate(rows) if row.params.penalized]
    if not biased and not penalized:
        return raw
    x = raw.clone()
    vocab = x.shape[1]
    flat = x.view(-1)
    if biased:
        where = [i * vocab + token for i in biased for token, _ in rows[i].params.logit_bias]
        bias = [b for i in biased for _, b in rows[i].params.logit_bias]
        flat.index_add_(0, torch.tensor(where), torch.tensor(bias, dtype=torch.float32))
    if penalized:
        # Only the tokens a history holds change, so work on those alone: the
        # distinct (row * V + id) of every penalized row, with their counts.
        parts = []
        for i in penalized:
            ids = np.asarray(rows[i].history, dtype=np.int64).ravel()
            parts.append(ids[(ids >= 0) & (ids < vocab)] + i * vocab)
        where_t, counts = torch.unique(torch.from_numpy(np.concatenate(parts)), return_counts=True)
        row_of = where_t // vocab
        rep = torch.tensor([row.params.repetition_penalty for row in rows], dtype=torch.float32)[row_of]
        presence = torch.tensor([row.params.presence_penalty for row in rows], dtype=torch.float32)[row_of]
        frequency = torch.tensor([row.params.frequency_penalty for row in rows], dtype=torch.float32)[row_of]
        seen = flat[where_t]
        seen = torch.where(seen > 0, seen / rep, seen * rep) - presence - frequency * counts
        flat[where_t] = seen
    return x


def best_logprobs(lp: torch.Tensor, n: int, values: list[float], ids: list[int]) -> tuple[tuple[int, float], ...]:
    """The ``n`` best (id, logprob) of one row ``lp``, best first, ties by id;
    ``values`` and ``ids`` are its largest entries, largest first, more than n
    of them unless the row is shorter."""
    n = min(n, lp.numel())
    if n < len(values) and values[n] < values[n - 1]:
        pairs = list(zip(ids[:n], values[:n], strict=True))
    else:  # equal logprobs at the cut: take the lowest ids among them
        ids_t = torch.nonzero(lp >= values[n - 1]).flatten()
        pairs = list(zip(ids_t.tolist(), lp[ids_t].tolist(), strict=True))
    pairs.sort(key=lambda pair: (-pair[1], pair[0]))
    return tuple(pairs[:n])
