"""The sampling math: one step's logits in, one token per row out. Pure torch
and Python, no trio; the sampler actor calls `sample_rows` from a worker
thread.

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
6. top-k: keep the k most probable tokens;
7. top-p: keep the smallest set of most probable tokens whose mass (renormalized
   over what top-k kept) reaches top_p; never fewer than one;
8. min-p: drop tokens whose probability is below min_p times the largest;
9. the draw: u = uniform(seed, draw_index), and the token is where u times the
   kept mass falls in the cumulative sum of the kept probabilities taken in
   token-id order (`choose`). It consumes exactly one draw.

Wherever a cut falls among equal probabilities, the lowest ids are kept. A
row's token depends only on its own logits and Row, never on the other rows.
Logprobs describe the model's distribution: log_softmax of the raw logits,
before any of the steps above.

Random numbers are counter based: `uniform(seed, index)` is Philox4x64-10 with
key (seed, 0) at counter (index, 0, 0, 0), computed in plain Python integers,
so it is the same in every process and on every platform.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from trioserve.errors import TrioserveError

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
SEED_LIMIT = 2**63  # seeds are in [0, SEED_LIMIT)


class SamplingError(TrioserveError, ValueError):
    """Sampling parameters the engine refuses. ``field`` names the offending
    parameter; ``str()`` is the message for the client."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_number(field: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> None:
    # Written as "not (in range)" so that NaN is refused too.
    ok = _is_number(value) and (lo < value if lo_open else lo <= value) and value <= hi  # type: ignore[operator]
    if not ok:
        low = f"greater than {lo:g}" if lo_open else f"at least {lo:g}"
        raise SamplingError(field, f"{field} must be {low} and at most {hi:g}, got {value!r}")


def _check_token(field: str, token: object, vocab_size: int) -> None:
    if not _is_int(token) or not 0 <= token < vocab_size:  # type: ignore[operator]
        raise SamplingError(field, f"{field}: {token!r} is not a token id (the vocabulary has {vocab_size})")


@attrs.frozen
class SamplingParams:
    """How one request turns logits into tokens. `validate` checks the values;
    the constructor does not, so that the HTTP layer can build one first and
    report the first bad field."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    seed: int | None = None  # None = the engine picks one and reports it
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty differs from its default (no effect)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise SamplingError for the first field out of range; token ids
        must be below ``vocab_size``."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError("max_tokens", f"max_tokens must be a whole number of at least 1, got {self.max_tokens!r}")
        _check_number("temperature", self.temperature, 0, 2)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be a whole number of at least 0 (0 turns it off), got {self.top_k!r}")
        _check_number("top_p", self.top_p, 0, 1, lo_open=True)
        _check_number("min_p", self.min_p, 0, 1)
        _check_number("presence_penalty", self.presence_penalty, -2, 2)
        _check_number("frequency_penalty", self.frequency_penalty, -2, 2)
        _check_number("repetition_penalty", self.repetition_penalty, 0, 2, lo_open=True)
        seen: set[int] = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise SamplingError("logit_bias", f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
            token, bias = pair
            _check_token("logit_bias", token, vocab_size)
            if token in seen:
                raise SamplingError("logit_bias", f"logit_bias: token {token} appears more than once")
            seen.add(token)
            _check_number("logit_bias", bias, -100, 100)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise SamplingError("seed", f"seed must be a whole number from 0 to 2**63 - 1, got {self.seed!r}")
        if not isinstance(self.logprobs, bool):
            raise SamplingError("logprobs", f"logprobs must be true or false, got {self.logprobs!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError("top_logprobs", f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise SamplingError("top_logprobs", "top_logprobs needs logprobs to be true")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise SamplingError("stop", f"stop strings must be non-empty strings, got {text!r}")
        for token in self.stop_token_ids:
            _check_token("stop_token_ids", token, vocab_size)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")


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


@attrs.frozen
class Row:
    """One row of a step's logits and what the sampler needs to know about it."""

    params: SamplingParams
    seed: int  # resolved: never None here
    draw_index: int  # the next unused draw of this request
    history: Sequence[int]  # prompt ids + output ids so far


@attrs.frozen
class Sampled:
    token: int
    draws: int  # draws consumed: 0 for greedy, 1 otherwise
    logprob: float | None  # of the chosen token, when params.logprobs
    top_logprobs: tuple[tuple[int, float], ...]  # (id, logprob), best first


def sample_rows(logits: torch.Tensor, rows: Sequence[Row]) -> list[Sampled]:
    """Choose one token for each row of ``logits`` ([R, V], any float dtype)
    following ``rows[r]``. Never modifies ``logits``. Blocking: call it from a
    worker thread."""
    raw = logits.detach().to(device="cpu", dtype=torch.float32)
    if raw.dim() != 2 or raw.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(raw.shape)} do not match {len(rows)} rows")
    x = _processed(raw, rows)
    tokens = [0] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if greedy:
        picked = torch.argmax(x if len(greedy) == len(rows) else x[greedy], dim=1).tolist()
        for i, token in zip(greedy, picked, strict=True):
            tokens[i] = token
    if drawn:
        probs = _kept_probs(x if len(drawn) == len(rows) else x[drawn], [rows[i].params for i in drawn])
        us = [uniform(rows[i].seed, rows[i].draw_index) for i in drawn]
        for i, token in zip(drawn, _choose_rows(probs, us), strict=True):
            tokens[i] = token
    logprobs: list[float | None] = [None] * len(rows)
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs]
    if wanted:
        lp = torch.log_softmax(raw[wanted], dim=1)
        chosen = lp[torch.arange(len(wanted)), torch.tensor([tokens[i] for i in wanted])].tolist()
        for j, i in enumerate(wanted):
            logprobs[i] = chosen[j]
            tops[i] = _best(lp[j], rows[i].params.top_logprobs)
    return [
        Sampled(token=tokens[i], draws=0 if row.params.greedy else 1, logprob=logprobs[i], top_logprobs=tops[i])
        for i, row in enumerate(rows)
    ]


def _processed(raw: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """Steps 1-3: the logits after bias and penalties; ``raw`` itself when no
    row asks for either, otherwise a new tensor."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    penalized = [i for i, row in enumerate(rows) if row.params.penalized]
    if not biased and not penalized:
        return raw
    x = raw.clone()
    vocab = x.shape[1]
    if biased:
        bias_at = [(i, token, bias) for i in biased for token, bias in rows[i].params.logit_bias]
        r, t, b = zip(*bias_at, strict=True)
        x.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(b, dtype=torch.float32), accumulate=True)
    if penalized:
        # Only the tokens a history holds change, so work on those alone: the
        # distinct (row * V + id) of every penalized row, with their counts.
        parts = []
        for i in penalized:
            ids = np.asarray(rows[i].history, dtype=np.int64).ravel()
            parts.append(ids[(ids >= 0) & (ids < vocab)] + i * vocab)
        where, counts = torch.unique(torch.from_numpy(np.concatenate(parts)), return_counts=True)
        row_of = where // vocab
        rep = torch.tensor([row.params.repetition_penalty for row in rows], dtype=torch.float32)[row_of]
        presence = torch.tensor([row.params.presence_penalty for row in rows], dtype=torch.float32)[row_of]
        frequency = torch.tensor([row.params.frequency_penalty for row in rows], dtype=torch.float32)[row_of]
        flat = x.view(-1)
        seen = flat[where]
        seen = torch.where(seen > 0, seen / rep, seen * rep) - presence - frequency * counts
        flat[where] = seen
    return x


def _kept_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Steps 5-8 for non-greedy rows: [S, V] probabilities after temperature,
    with the tokens top-k, top-p and min-p drop set to 0 (not renormalized)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)[:, None]
    probs = torch.softmax(x / temperature, dim=1)
    vocab = probs.shape[1]
    for j, p in enumerate(params):
        row = probs[j]
        top: torch.Tensor | None = None  # the kept probabilities, largest first
        if 0 < p.top_k < vocab:
            top = torch.topk(row, p.top_k).values
            _keep_largest(row, p.top_k, top[-1])
        if p.top_p < 1.0:
            target = p.top_p * float(row.sum(dtype=torch.float64))
            if top is None:
                top = _largest_reaching(row, target)
            cum = top.cumsum(0, dtype=torch.float64)
            n = min(int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64))) + 1, top.numel())
            _keep_largest(row, n, top[n - 1])
        if p.min_p > 0.0:
            row.masked_fill_(row < p.min_p * row.max(), 0.0)
    return probs


def _largest_reaching(row: torch.Tensor, target: float) -> torch.Tensor:
    """The largest values of ``row``, sorted down, at least as many as it
    takes for their sum to reach ``target`` (a full sort only when needed)."""
    n = min(row.numel(), 1024)
    while True:
        top = torch.topk(row, n).values
        if n == row.numel() or float(top.sum(dtype=torch.float64)) >= target:
            return top
        n = min(row.numel(), n * 8)


def _keep_largest(row: torch.Tensor, n: int, nth: torch.Tensor) -> None:
    """Zero all but the ``n`` largest entries of ``row`` in place, where
    ``nth`` is the n-th largest value; among equals, lower ids stay."""
    keep = row > nth
    tied = torch.nonzero(row == nth).flatten()[: n - int(keep.sum())]
    keep[tied] = True
    row.masked_fill_(~keep, 0.0)


def choose(weights: torch.Tensor, u: float) -> int:
    """Step 9 for one row: the token whose slice of the cumulative sum of
    ``weights`` (non-negative, in id order, not necessarily summing to 1)
    holds ``u`` times the total. Token t is chosen exactly for u in
    [sum(w[:t]), sum(w[:t + 1])) / sum(w); zero-weight tokens never are."""
    return _choose_rows(weights[None, :], [u])[0]


def _choose_rows(weights: torch.Tensor, us: Sequence[float]) -> list[int]:
    cum = weights.cumsum(1, dtype=torch.float64)
    target = torch.tensor(us, dtype=torch.float64)[:, None] * cum[:, -1:]
    picked = torch.searchsorted(cum, target, right=True).flatten().tolist()
    for j, token in enumerate(picked):
        if token >= weights.shape[1]:  # u * total rounded up to the total
            picked[j] = int(torch.nonzero(weights[j]).max())
    return picked


def _best(lp: torch.Tensor, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` best (id, logprob) of one row, best first, ties by id."""
    n = min(n, lp.numel())
    if n == 0:
        return ()
    nth = torch.topk(lp, n).values[-1]
    ids = torch.nonzero(lp >= nth).flatten()  # ascending ids
    order = torch.sort(lp[ids], descending=True, stable=True).indices[:n]
    return tuple(zip(ids[order].tolist(), lp[ids[order]].tolist(), strict=True))
