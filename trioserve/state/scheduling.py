"""The scheduler's policy, with no trio and no torch: which sequences wait,
which run, what the next step computes. The scheduler actor drives it.

Rules:
- Admission is oldest first, while a row and KV room remain. A sequence
  reserves blocks for prompt + max_tokens when admitted, so nothing running
  is ever starved of blocks or preempted. If the oldest waiting sequence does
  not fit, younger ones wait behind it (no overtaking, no starvation).
- With a prefix cache, admission first shares the cached blocks of the
  prompt's longest known prefix (no copy, no prefill for them), and a
  finished sequence leaves its full blocks in the cache: those of its
  prompt only when ``share_generated_kv`` is off (batch-invariant mode with
  bf16 activations, where generated tokens' K/V comes from other arithmetic
  than a prompt's and must not stand in for it; with int8 activations both
  take one path; docs/determinism.md). A sequence that
  retains for an owner (a session turn) also pins them, provisionally, until
  the owner commits (the pins become the owner's) or cancels (let go).
- A step takes every running sequence's decode token first, then prefill
  chunks until the per-step token budget is spent, so a long prompt delays
  decoding rows by at most one chunk per step. The budget is shared evenly
  between the tenants with prompts to prefill, then between each tenant's
  requests (`prefill_shares`): one tenant's huge prompts cannot take every
  step's budget while another's wait, and neither can a request's while a
  short one of the same tenant waits.
- With ``max_step_s``, a step that carries decode rows also carries no
  more prompt tokens than fit that time, by what the last steps took (a
  decode-only step's time, and the time a prompt token added): on a slow
  CPU or a big model a 512-token chunk takes seconds, and every decoding
  stream would wait that long between two tokens. The prompt part never
  gets less time than the decode part, nor fewer than
  ``MIN_PROMPT_CHUNK`` tokens, so prefill always goes on. The times are
  the callers' (`timed`), so a replay plans the same steps.
- With speculative decoding (``draft_tokens``), a decode row also carries a
  guess at the tokens after its next one (state/ngram.py); the step checks
  them, and only what the model would have generated anyway is kept.
- An embedding request (``Sequence.pooling``) is a prompt and nothing more:
  it reserves blocks for its prompt only, is prefilled in chunks like any
  prompt, and ends when its prefill does. It neither looks its prompt up in
  the prefix cache (a hit would skip the very hidden states it pools) nor
  leaves its blocks there (embedding inputs are rarely chat prefixes, and
  they would push those out).
- A request that scores its prompt (SamplingParams.prompt_logprobs) does
  not look its prompt up in the prefix cache either: a cached block has no
  logits, and every prompt position must pass through the head. Its blocks
  are registered when it ends, like any prompt's. With max_tokens 0 it
  ends ("length") as soon as its prefill is done."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import attrs

from trioserve.errors import QueueFull, RequestTooLarge
from trioserve.state.kv_pool import BlockPool, blocks_needed
from trioserve.state.ngram import propose
from trioserve.state.prefix_cache import PrefixCache, chain_root, held_key
from trioserve.state.sequence import Sequence


# Speculative drafts are planned only while at most this many sequences
# decode (bench/README.md, "Speculative decoding").
DRAFT_MAX_ROWS = 4
# Under max_step_s: the fewest prompt tokens a step with decode rows takes,
# and the fewest a step must carry to teach the cost of one.
MIN_PROMPT_CHUNK = 16
# Weight of the newest step in the running estimates of step costs.
COST_WEIGHT = 0.5


@attrs.frozen
class PlannedRow:
    """``tokens`` go in at positions start, start + 1, ...; the last
    ``len(draft)`` of them are a speculative guess at what the sequence
    generates next (a decode row only), which the step checks."""

    seq: Sequence
    tokens: list[int]
    start: int  # position of tokens[0]
    draft: tuple[int, ...] = ()

    @property
    def decode(self) -> bool:
        """A generated token (the prompt is all in the cache)."""
        return self.start >= len(self.seq.prompt_ids)

    @property
    def samples(self) -> bool:
        """Whether this row's logits pick a token: its chunk reaches the end
        (never for an embedding request, nor for one of max_tokens 0)."""
        seq = self.seq
        return seq.pooling is None and seq.params.max_tokens > 0 and self.start + len(self.tokens) - len(self.draft) == seq.num_tokens

    @property
    def ends_prefill(self) -> bool:
        """This row is its prompt's last chunk."""
        return not self.decode and self.start + len(self.tokens) == len(self.seq.prompt_ids)

    @property
    def pool(self) -> int:
        """How many of this row's last tokens an embedding request pools:
        all of them for "mean", the prompt's last one for "last"."""
        if self.seq.pooling == "mean":
            return len(self.tokens)
        if self.seq.pooling in ("last", "first", "score") and self.start + len(self.tokens) == len(self.seq.prompt_ids):
            return 1  # "first": the prompt's first token (PlanRow.pool_first), its chunk the whole prompt
        return 0


class SchedulingPolicy:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_model_len: int,
        prefill_budget: int,
        max_queue: int,
        retry_after: float = 1.0,
        prefix_cache: PrefixCache | None = None,
        share_generated_kv: bool = True,
        draft_tokens: int = 0,
        max_step_s: float = 0.0,
        prefill_sharing: str = "requests",
        clock: Callable[[], float] = time.monotonic,
        whole_prompts: bool = False,
    ) -> None:
        if prefill_sharing not in PREFILL_SHARING:
            raise ValueError(f"prefill_sharing must be one of {PREFILL_SHARING}, got {prefill_sharing!r}")
        self.pool = pool
        self.max_step_s = max_step_s
        self.prefill_sharing = prefill_sharing
        self.whole_prompts = whole_prompts  # a prompt runs whole in one step (an encoder's)
        # What steps cost, from `timed`: a decode-only step, and each prompt
        # token a step carries (over the decode rows' part).
        self.decode_step_s: float | None = None
        self.prompt_token_s: float | None = None
        self.draft_tokens = draft_tokens
        self.share_generated_kv = share_generated_kv
        self.cache = prefix_cache
        self.clock = clock
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.prefill_budget = prefill_budget
        self.max_queue = max_queue
        self.retry_after = retry_after
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, str] = {}  # owner -> id of the request whose KV is held for it

    # -- retained KV -------------------------------------------------------
    def settle(self, owner: str, order: str, request_id: str | None = None) -> None:
        """Apply an owner's order about request ``request_id``'s KV:
        "commit" makes the KV held for it the owner's (replacing what the
        owner kept), "cancel" lets it go, and "forget" lets go of everything
        the owner has. A cancelled or forgotten request that has not ended
        yet will hold nothing when it does."""
        if order not in ("commit", "cancel", "forget"):
            raise ValueError(f"unknown retention order {order!r}")
        if order != "commit":
            for seq in (*self.waiting, *self.running):
                if seq.retain == owner and (order == "forget" or seq.id == request_id):
                    seq.retain = None
        if self.cache is None:
            return
        if order == "forget" or self.held.get(owner) == request_id:
            self.held.pop(owner, None)
            if order == "commit":
                self.cache.move_pin(held_key(owner), owner)
            else:
                self.cache.unpin(held_key(owner))
        if order == "forget":
            self.cache.unpin(owner)

    # -- intake ----------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse at once a request that no amount of waiting would admit
        (``max_tokens`` 0: an embedding request, a prompt alone)."""
        total = prompt_len + max_tokens
        what, field = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens", "max_tokens"
        if max_tokens == 0:
            what, field = f"the prompt ({prompt_len} tokens)", "prompt"
        if total > self.max_model_len:
            raise RequestTooLarge(f"{what} exceeds the maximum model length of {self.max_model_len}", field=field)
        need = blocks_needed(total, self.pool.block_size)
        if need > self.pool.num_blocks:
            cap = self.pool.num_blocks * self.pool.block_size
            raise RequestTooLarge(f"{what} needs {need} KV blocks but the pool has {self.pool.num_blocks} ({cap} tokens)", field=field)

    def enqueue(self, seq: Sequence) -> None:
        self.check_fits(len(seq.prompt_ids), seq.max_total - len(seq.prompt_ids))
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(len(self.waiting), self.retry_after)
        self.waiting.append(seq)

    # -- each iteration --------------------------------------------------
    def drop_cancelled(self) -> list[Sequence]:
        """Remove cancelled sequences, freeing their blocks."""
        dropped = [s for s in self.waiting if s.cancelled] + [s for s in self.running if s.cancelled]
        if dropped:
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
            for seq in [s for s in self.running if s.cancelled]:
                self.finish(seq, "cancelled")
            for seq in dropped:
                seq.finish_reason = "cancelled"
        return dropped

    def admit(self, now: float) -> list[Sequence]:
        if self.cache is not None:
            self.cache.trim(now)  # idle and count limits apply even when nothing finishes
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._reserve(seq, now):
                break
            self.waiting.popleft()
            seq.admitted_at = now
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _reserve(self, seq: Sequence, now: float) -> bool:
        """Give ``seq`` its blocks for prompt + max_tokens: shared cached
        prefix blocks first, then fresh ones, evicting idle cached blocks if
        that makes room. False (and nothing held) when it does not fit yet."""
        lookup = self.cache is not None and seq.pooling is None and seq.params.prompt_logprobs is None
        shared = self.cache.match(seq.prompt_ids, now, chain_root(seq.adapter, seq.cache_salt)) if lookup else []
        if shared:
            self.pool.adopt(seq.id, shared)  # held now, so eviction cannot take them
        missing = blocks_needed(seq.max_total, self.pool.block_size) - len(shared)
        short = missing - self.pool.num_free
        if short > 0 and self.cache is not None:
            self.cache.make_room(short)  # only when that is enough: never empty the cache for nothing
        if self.pool.num_free < missing:
            self.pool.free_sequence(seq.id)
            return False
        self.pool.grow(seq.id, seq.max_total)
        seq.num_cached = seq.cached_prompt = len(shared) * self.pool.block_size
        if lookup:
            self.cache.record(len(seq.prompt_ids), seq.num_cached)
        return True

    def plan(self) -> list[PlannedRow]:
        """The next step's rows: decode tokens, then prefill chunks."""
        budget = self.prefill_budget
        rows = []
        decoding = [s for s in self.running if s.num_cached >= len(s.prompt_ids)]
        prefilling = [s for s in self.running if s.num_cached < len(s.prompt_ids)]
        per_row = self._draft_room(len(decoding))
        for seq in decoding:
            draft = self._draft(seq, per_row)
            rows.append(PlannedRow(seq, seq.pending(1) + list(draft), seq.num_cached, draft))
            budget -= 1 + len(draft)
        if decoding and prefilling:
            budget = min(budget, self._prompt_room())
        if self.whole_prompts:
            shares = whole_shares(prefilling, budget)
        else:
            shares = prefill_shares(prefilling, budget, even=self.prefill_sharing == "requests")
        for seq, count in shares:
            rows.append(PlannedRow(seq, seq.pending(count), seq.num_cached))
        return rows

    def _prompt_room(self) -> int:
        """Prompt tokens a step with decode rows may carry under
        ``max_step_s`` (no limit while it is off or nothing is known)."""
        if self.max_step_s <= 0 or self.prompt_token_s is None:
            return self.prefill_budget
        decode_s = self.decode_step_s or 0.0
        spare = max(self.max_step_s - decode_s, decode_s)
        return max(MIN_PROMPT_CHUNK, int(spare / self.prompt_token_s))

    def timed(self, rows: list[PlannedRow], seconds: float) -> None:
        """A step of ``rows`` took ``seconds`` from its plan to its result:
        update what steps cost (what `plan` uses under ``max_step_s``)."""
        if seconds <= 0:
            return
        prompt = sum(len(r.tokens) for r in rows if not r.decode)
        if prompt == 0:
            self.decode_step_s = _blend(self.decode_step_s, seconds)
        elif prompt >= MIN_PROMPT_CHUNK:
            decode_s = (self.decode_step_s or 0.0) if any(r.decode for r in rows) else 0.0
            self.prompt_token_s = _blend(self.prompt_token_s, max(seconds - decode_s, seconds / 2) / prompt)

    def _draft_room(self, decoding: int) -> int:
        """Draft tokens each decode row may carry this step: none beyond
        DRAFT_MAX_ROWS decoding sequences (where a step is no longer bound
        by reading the weights, verifying costs real work), and at most a
        half of the budget the decode rows leave, so prefill goes on."""
        if not self.draft_tokens or not decoding or decoding > DRAFT_MAX_ROWS:
            return 0
        return min(self.draft_tokens, (self.prefill_budget - decoding) // decoding // 2)

    def _draft(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """A prompt-lookup guess at ``seq``'s next tokens (state/ngram.py):
        none for a guided sequence (its constraint moves token by token)
        and never past what it may still generate after the next token."""
        limit = min(room, seq.params.max_tokens - seq.generated - 1)
        if limit < 1 or seq.guide is not None:
            return ()
        return tuple(propose(seq.history(), limit))

    def block_table(self, seq: Sequence) -> list[int]:
        return self.pool.table(seq.id)

    def stepped(self, rows: list[PlannedRow]) -> None:
        """The rows' tokens are now in the cache; a draft's count only once
        `accepted` says how much of it was right (the K/V the rest wrote
        lies past the sequence's end, and the next step writes over it
        before anything reads it)."""
        for row in rows:
            row.seq.num_cached = row.start + len(row.tokens) - len(row.draft)

    def accepted(self, row: PlannedRow, n: int) -> None:
        """The first ``n`` draft tokens of ``row`` were what the model generates."""
        assert 0 <= n <= len(row.draft)
        row.seq.num_cached += n

    def finish(self, seq: Sequence, reason: str, *, remember: bool = True) -> None:
        """Take a running sequence out and return its blocks; its full blocks
        of computed tokens stay in the prefix cache when ``remember``."""
        self.running.remove(seq)
        if remember and self.cache is not None and seq.pooling is None:
            now = self.clock()
            computed = seq.history()[: seq.num_cached]
            if not self.share_generated_kv:
                computed = computed[: len(seq.prompt_ids)]
            root = chain_root(seq.adapter, seq.cache_salt)
            self.cache.register(computed, self.pool.table(seq.id), now, root)
            if seq.retain is not None and reason in ("stop", "length"):
                # Held for the owner until it settles the turn (see `settle`).
                self.cache.pin(held_key(seq.retain), computed, now, root)
                self.held[seq.retain] = seq.id
        self.pool.free_sequence(seq.id)
        if self.cache is not None:
            self.cache.trim(self.clock())  # its blocks are idle now, so the limits can take them
        seq.finish_reason = reason

    def fail_all(self) -> list[Sequence]:
        """Every sequence, waiting or running, taken out (engine death)."""
        everyone = list(self.waiting) + list(self.running)
        for seq in list(self.running):
            self.finish(seq, "error", remember=False)  # the cache contents are suspect now
        self.waiting.clear()
        for seq in everyone:
            seq.finish_reason = "error"
        if self.cache is not None:
            self.cache.trim(self.clock())  # the limits apply even when nothing was running
        return everyone


PREFILL_SHARING = ("requests", "tenants")  # SchedulingPolicy's prefill_sharing: even between requests too, or between tenants only (older traces)


def _blend(old: float | None, new: float) -> float:
    """A running estimate: the newest value weighs COST_WEIGHT."""
    return new if old is None else (1 - COST_WEIGHT) * old + COST_WEIGHT * new


def whole_shares(prefilling: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
    """Whole prompts, in admission order, while they fit in ``budget``
    tokens: a prompt that does not fit waits for a later step (none is
    longer than a step's budget: the engine's max_model_len says so)."""
    shares = []
    for seq in prefilling:
        need = len(seq.prompt_ids) - seq.num_cached
        if need > budget:
            break
        shares.append((seq, need))
        budget -= need
    return shares


def fair_split(needs: list[int], budget: int) -> list[int]:
    """``budget`` split evenly between ``needs`` (what one does not need
    goes to the others; a remainder to the earliest), none past its need."""
    given = [0] * len(needs)
    left = max(budget, 0)
    wanting = [i for i, need in enumerate(needs) if need > 0]
    while left > 0 and wanting:
        share, extra = divmod(left, len(wanting))
        for place, i in enumerate(wanting):
            take = min(share + (1 if place < extra else 0), needs[i] - given[i])
            given[i] += take
            left -= take
        wanting = [i for i in wanting if given[i] < needs[i]]
    return given


def prefill_shares(prefilling: list[Sequence], budget: int, *, even: bool = True) -> list[tuple[Sequence, int]]:
    """How many prompt tokens each prefilling sequence gets in a step of
    ``budget`` prompt tokens, in admission order. The budget is shared
    evenly between the tenants with prompt tokens left, then (``even``)
    each tenant's share evenly between its sequences: a short prompt beside
    long ones of the same tenant gets its first token within a few steps,
    not after theirs (what one does not need goes to the others). Without
    ``even`` (traces recorded before it existed, core/replay.py), one
    tenant's sequences took its share in admission order, and one tenant
    alone the whole budget that way."""
    if even:
        tenants: dict[str | None, list[Sequence]] = {}
        for seq in prefilling:
            tenants.setdefault(seq.tenant, []).append(seq)
        groups = list(tenants.values())
        needs = [[len(seq.prompt_ids) - seq.num_cached for seq in group] for group in groups]
        given: dict[str, int] = {}
        for group, need, allowance in zip(groups, needs, fair_split([sum(n) for n in needs], budget), strict=True):
            for seq, count in zip(group, fair_split(need, allowance), strict=True):
                given[seq.id] = count
        return [(seq, given[seq.id]) for seq in prefilling if given[seq.id] > 0]
    need = {seq.id: len(seq.prompt_ids) - seq.num_cached for seq in prefilling}
    tenants = {}
    for seq in prefilling:
        tenants.setdefault(seq.tenant, []).append(seq)
    given = dict.fromkeys(need, 0)
    if len(tenants) <= 1:
        for seq in prefilling:
            given[seq.id] = min(need[seq.id], max(budget, 0))
            budget -= given[seq.id]
    else:
        left = max(budget, 0)
        wanting = [t for t in tenants if any(need[s.id] for s in tenants[t])]
        while left > 0 and wanting:
            share, extra = divmod(left, len(wanting))
            for place, tenant in enumerate(wanting):
                allowance = share + (1 if place < extra else 0)
                for seq in tenants[tenant]:
                    take = min(allowance, need[seq.id] - given[seq.id])
                    given[seq.id] += take
                    allowance -= take
                    left -= take
            wanting = [t for t in wanting if any(need[s.id] > given[s.id] for s in tenants[t])]
    return [(seq, given[seq.id]) for seq in prefilling if given[seq.id] > 0]
