"""The sampling math: one step's logits in, one token per row out. Pure torch
and Python, no trio; the step runner (models/step_runner.py) calls
`sample_rows` in the device thread.

Each row is processed in this order:

1. logit bias: ``logits[id] += bias`` for each (id, bias) pair;
2. repetition penalty (as in Hugging Face): for every token seen in the
   history, a positive logit is divided by the penalty, a negative one is
   multiplied by it;
3. presence and frequency penalties: a seen token loses ``presence_penalty``
   once and ``frequency_penalty`` for each time it was seen.
   The history is the full prompt plus the output so far, so a token that only
   the prompt holds is penalized too;
4. greedy rows (temperature 0) take the argmax here (ties: lowest id) and
   consume no draw. Other rows go on:
5. temperature: logits / temperature, then softmax;
6. top-k: keep the k most probable tokens (0, or k of at least V, keeps all);
7. top-p: keep the smallest set of most probable tokens whose mass (renormalized
   over what top-k kept) reaches top_p; never fewer than one;
8. min-p: drop tokens whose probability is below min_p times the largest;
9. the draw: u = uniform(seed, draw_index), and the token is where u times the
   kept mass falls in the cumulative sum of the kept probabilities taken in
   token-id order (`choose`). It consumes exactly one draw.

Wherever a cut falls among equal probabilities, the lowest ids are kept. A
row's token depends only on its own logits and SampleRow, never on the other rows.
Logprobs describe the model's distribution: log_softmax of the raw logits,
before any of the steps above.

Random numbers are counter based: `uniform(seed, index)` is Philox4x64-10 with
key (seed, 0) at counter (index, 0, 0, 0), computed in plain Python integers,
so it is the same in every process and on every platform.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from trioserve.kernels.logits import best_logprobs, processed_logits
from trioserve.kernels.sampler_math import BLOCK, FIXED, Numerics
from trioserve.models.guided import apply_masks
from trioserve.types import Sampled, SampleRow, SamplingParams

# Philox4x64-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
_MASK64 = (1 << 64) - 1
_PHILOX_M0, _PHILOX_M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B


def uniform(seed: int, index: int) -> float:
    """Draw ``index`` of the stream ``seed``: a float in [0, 1) that depends on
    (seed, index) alone. Both must be in [0, 2**64)."""
    if not 0 <= seed <= _MASK64 or not 0 <= index <= _MASK64:
        raise ValueError(f"seed {seed} and index {index} must be in [0, 2**64)")
    c0, c1, c2, c3 = index, 0, 0, 0
    k0, k1 = seed, 0
    for round_ in range(10):
        if round_:
            k0 = (k0 + _PHILOX_W0) & _MASK64
            k1 = (k1 + _PHILOX_W1) & _MASK64
        p0 = _PHILOX_M0 * c0
        p1 = _PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & _MASK64, (p0 >> 64) ^ c3 ^ k1, p0 & _MASK64
    return (c0 >> 11) * 2.0**-53  # the top 53 bits: exact in a double, below 1


def new_seed() -> int:
    """A fresh random seed in [0, 2**63) for a request that brought none."""
    return secrets.randbits(63)


def sample_rows(
    logits: torch.Tensor, rows: Sequence[SampleRow], masks: torch.Tensor | None = None, numerics: Numerics = FIXED
) -> list[Sampled]:
    """Choose one token for each row of ``logits`` ([R, V], any float dtype)
    following ``rows[r]``; with ``masks`` (an int32 bitmask per row, see
    models.guided), only among the tokens a row's mask allows. Never
    modifies ``logits``. Blocking: call it from a worker thread. Logprobs
    are the model's own, before any bias, penalty or mask. Every exp, sum
    and log is ``numerics``' (kernels/sampler_math.py): the fixed order,
    the same bits on every CPU, unless a replay asks for torch's."""
    raw = logits.detach().to(device="cpu", dtype=torch.float32)
    if raw.dim() != 2 or raw.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(raw.shape)} do not match {len(rows)} rows")
    x = processed_logits(raw, rows)
    if masks is not None:
        x = apply_masks(x, masks)
    tokens = [0] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if greedy:
        # numpy's argmax takes the first (lowest) id among equal largest
        # values, and is 10-15x faster than torch's on a 49,152-wide row.
        picked = np.argmax((x if len(greedy) == len(rows) else x[greedy]).numpy(), axis=1).tolist()
        for i, token in zip(greedy, picked, strict=True):
            tokens[i] = token
    if drawn:
        params = [rows[i].params for i in drawn]
        if len(drawn) == len(rows):
            weights = _weights(x, params, numerics, owned=x is not raw)
        else:
            weights = _weights(x[drawn], params, numerics, owned=True)
        us = [uniform(rows[i].seed, rows[i].draw_index) for i in drawn]
        for i, token in zip(drawn, _choose_rows(weights, us, numerics), strict=True):
            tokens[i] = token
    logprobs: list[float | None] = [None] * len(rows)
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs]
    if wanted:
        lp = numerics.log_softmax(raw if len(wanted) == len(rows) else raw[wanted])
        chosen = lp[torch.arange(len(wanted)), torch.tensor([tokens[i] for i in wanted])].tolist()
        longest = max(rows[i].params.top_logprobs for i in wanted)
        if longest:
            # One past the longest list, to see a tie at its end.
            values, ids = torch.topk(lp, min(longest + 1, lp.shape[1]), dim=1)
            best_values, best_ids = values.tolist(), ids.tolist()
        for j, i in enumerate(wanted):
            logprobs[i] = chosen[j]
            if rows[i].params.top_logprobs:
                tops[i] = best_logprobs(lp[j], rows[i].params.top_logprobs, best_values[j], best_ids[j])
    return [
        Sampled(token=tokens[i], draws=0 if row.params.greedy else 1, logprob=logprobs[i], top_logprobs=tops[i])
        for i, row in enumerate(rows)
    ]



def _weights(x: torch.Tensor, params: Sequence[SamplingParams], numerics: Numerics, *, owned: bool) -> torch.Tensor:
    """Steps 5-8 for non-greedy rows: [S, V] unnormalized probabilities after
    temperature (each row's largest is 1), with the tokens that top-k, top-p
    and min-p drop set to 0. Works in ``x`` itself when ``owned``."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)[:, None]
    w = x.div_(temperature) if owned else x / temperature
    w = numerics.exp_shifted(w, w.amax(dim=1))
    for j, p in enumerate(params):
        if p.top_k or p.top_p < 1.0:
            _top_k_top_p(w[j], p.top_k, p.top_p, numerics)
        if p.min_p > 0.0:
            _drop_below(w[j], p.min_p * float(w[j].max()))
    return w


def _drop_below(row: torch.Tensor, limit: float) -> None:
    """Zero the entries of ``row`` (float32) below ``limit``, in place."""
    least = np.float32(limit)  # the smallest float32 at or above limit
    if least < limit:
        least = np.nextafter(least, np.float32(np.inf))
    # threshold keeps what is strictly above its argument: the float32 just below `least`.
    F.threshold_(row, float(np.nextafter(least, np.float32(-np.inf))), 0.0)


def _running_sums(values: torch.Tensor) -> torch.Tensor:
    """Cumulative sums along the last axis in float64, first to last (numpy's
    are sequential: the same bits everywhere)."""
    return torch.from_numpy(np.cumsum(values.double().numpy(), axis=-1))


def _top_k_top_p(row: torch.Tensor, top_k: int, top_p: float, numerics: Numerics) -> None:
    """Steps 6 and 7 on one row of weights, in place."""
    vocab = row.numel()
    kept = vocab
    values = ids = None  # the largest weights and their ids, largest first
    if 0 < top_k < vocab:
        values, ids = torch.topk(row, top_k + 1)  # one past the cut, to see a tie there
        _keep_largest(row, top_k, values, ids)
        kept = top_k
        values, ids = values[:kept], ids[:kept]
    if top_p < 1.0:
        total = numerics.ordered_sum(values) if values is not None else numerics.total(row)  # what top-k kept
        target = top_p * total
        if values is None:
            values, ids = _largest_reaching(row, target, numerics)
        reached = torch.searchsorted(_running_sums(values), torch.tensor([target], dtype=torch.float64))
        n = int(reached) + 1  # the first n tokens reach the target
        if n < kept:
            _keep_largest(row, n, values, ids)


def _largest_reaching(row: torch.Tensor, target: float, numerics: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest weights of ``row`` and their ids, largest first, at least
    as many as it takes for their sum to reach ``target``. A language model's
    mass sits in few tokens, so a full sort is rarely needed."""
    n = min(row.numel(), 64)
    while True:
        values, ids = torch.topk(row, n)
        if n == row.numel() or numerics.ordered_sum(values) >= target:
            return values, ids
        n = min(row.numel(), n * 8)


def _keep_largest(row: torch.Tensor, n: int, values: torch.Tensor, ids: torch.Tensor) -> None:
    """Zero all but the ``n`` largest entries of ``row`` in place, where
    ``values`` and ``ids`` are its largest entries, largest first, at least n
    of them; among equal values at the cut, the lowest ids stay."""
    if n < values.numel() and values[n] < values[n - 1]:
        row.zero_()  # no tie at the cut: the kept set is ids[:n], whatever topk's order among equals
        row[ids[:n]] = values[:n]
        return
    nth = values[n - 1]
    keep = row > nth
    tied = torch.nonzero(row == nth).flatten()[: n - int(keep.sum())]  # ascending ids
    keep[tied] = True
    row.masked_fill_(~keep, 0.0)


_BLOCK = BLOCK  # the draw finds its block of tokens first, then the token in it


def choose(weights: torch.Tensor, u: float) -> int:
    """Step 9 for one row: the token whose slice of the running sum of
    ``weights`` (non-negative, in id order, a positive total) holds ``u``
    times the total. Token t is chosen for u in [sum(w[:t]), sum(w[:t + 1]))
    / sum(w), up to rounding (float32 sums of blocks of tokens, float64
    running sums); a token of weight 0 is never chosen."""
    return _choose_rows(weights[None, :].to(torch.float32), [u], FIXED)[0]


def _choose_rows(weights: torch.Tensor, us: Sequence[float], numerics: Numerics) -> list[int]:
    """`choose` for each row of ``weights`` [S, V] with its own u: find the
    block of _BLOCK tokens that holds the target, then the token within it."""
    rows, vocab = weights.shape
    blocks = -(-vocab // _BLOCK)
    padded = blocks * _BLOCK
    # Block sums and running sums in float64, in the fixed order.
    block_cum = _running_sums(numerics.block_sums(weights, _BLOCK))
    target = torch.tensor(us, dtype=torch.float64)[:, None] * block_cum[:, -1:]
    block = torch.searchsorted(block_cum, target, right=True).clamp_(max=blocks - 1)
    base = torch.where(block > 0, block_cum.gather(1, (block - 1).clamp(min=0)), 0.0)
    where = block * _BLOCK + torch.arange(_BLOCK)
    local = weights.gather(1, where.clamp(max=vocab - 1)).double()
    if padded > vocab:
        local.masked_fill_(where >= vocab, 0.0)
    local = _running_sums(local) + base
    offset = torch.searchsorted(local, target, right=True).flatten().tolist()
    picked = (block.flatten() * _BLOCK).tolist()
    for j in range(rows):
        if offset[j] < _BLOCK:
            picked[j] += offset[j]
        else:  # u * total rounded onto the end of the block (or of the row)
            picked[j] = int(torch.nonzero(weights[j, : picked[j] + _BLOCK]).max())
    return picked
