"""SchedulingPolicy on its own, no trio and no model: admission order and
reservations, step planning under the token budget, chunked prefill beside
decode rows, cancellation, and the refusals."""

from __future__ import annotations

import pytest

from trioserve.errors import QueueFull, RequestTooLarge
from trioserve.models.detokenizer import IncrementalDetokenizer
from trioserve.types import SamplingParams
from trioserve.models.tokenizer import Tokenizer
from trioserve.state.kv_pool import BlockPool
from trioserve.state.scheduling import MIN_PROMPT_CHUNK, PlannedRow, SchedulingPolicy
from trioserve.state.sequence import Sequence
from trioserve.state.stops import StopMatcher

BS = 4


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_checkpoints["hf"])


@pytest.fixture
def make(tok):
    """make(id, prompt_len, max_tokens) -> a new Sequence with distinct prompt ids."""

    def build(sid: str, prompt_len: int, max_tokens: int) -> Sequence:
        base = 3 + 7 * len(sid)
        return Sequence(
            id=sid,
            prompt_ids=[3 + (base + i) % 350 for i in range(prompt_len)],
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            seed=0,
            stop_ids=frozenset({tok.eos_id}),
            detokenizer=IncrementalDetokenizer(tok),
            stops=StopMatcher(()),
            arrival=0.0,
        )

    return build


def policy(
    blocks: int = 64, *, max_num_seqs: int = 8, max_model_len: int = 256, budget: int = 16, max_queue: int = 64, retry_after: float = 1.0,
    sharing: str = "requests",
):  # fmt: skip
    return SchedulingPolicy(
        BlockPool(blocks, BS),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        prefill_budget=budget,
        max_queue=max_queue,
        retry_after=retry_after,
        prefill_sharing=sharing,
    )


def step(p: SchedulingPolicy, rows: list[PlannedRow], token: int = 100) -> list[Sequence]:
    """What the scheduler does after a successful step: mark the tokens
    cached, commit one token for each sampling row, finish ended ones."""
    p.stepped(rows)
    ended = []
    for row in rows:
        if row.samples:
            outcome = row.seq.commit(token, 0, 0.0)
            if outcome.finish_reason is not None:
                p.finish(row.seq, outcome.finish_reason)
                ended.append(row.seq)
    return ended


def free(p: SchedulingPolicy) -> int:
    return p.pool.stats().free_blocks


# -- admission and reservation -------------------------------------------------


@pytest.mark.parametrize(("prompt_len", "max_tokens", "blocks"), [(1, 1, 1), (3, 1, 1), (4, 1, 2), (5, 3, 2), (8, 8, 4), (13, 7, 5)])
def test_admission_reserves_blocks_for_prompt_plus_max_tokens(make, prompt_len, max_tokens, blocks):
    p = policy(blocks=10)
    seq = make("a", prompt_len, max_tokens)
    p.enqueue(seq)
    assert seq in p.waiting and free(p) == 10
    assert p.admit(now=2.5) == [seq]
    assert len(p.block_table(seq)) == blocks
    assert free(p) == 10 - blocks
    assert seq in p.running and seq.admitted_at == 2.5
    assert list(p.waiting) == [] and p.running == [seq]
    # Nothing more is taken while it runs to its end: the reservation holds.
    while seq in p.running:
        rows = p.plan()
        assert len(rows) == 1 and len(p.block_table(seq)) == blocks
        step(p, rows)
    assert seq.finish_reason == "length" and free(p) == 10


def test_admission_is_oldest_first_and_never_overtakes(make):
    p = policy(blocks=10)
    a, b, c = make("a", 20, 4), make("b", 20, 4), make("c", 4, 4)  # 6, 6 and 2 blocks
    for seq in (a, b, c):
        p.enqueue(seq)
    assert p.admit(0.0) == [a]
    # b does not fit the 4 free blocks; c would, but may not pass b.
    assert free(p) == 4
    assert p.admit(0.0) == []
    assert list(p.waiting) == [b, c] and c in p.waiting
    p.finish(a, "stop")
    assert p.admit(1.0) == [b, c]
    assert free(p) == 2 and p.running == [b, c]


def test_admission_stops_at_max_num_seqs(make):
    p = policy(blocks=64, max_num_seqs=2)
    seqs = [make(s, 3, 2) for s in "abc"]
    for seq in seqs:
        p.enqueue(seq)
    assert p.admit(0.0) == seqs[:2]
    assert list(p.waiting) == [seqs[2]]
    p.finish(seqs[0], "length")
    assert p.admit(0.0) == [seqs[2]]
    assert p.running == [seqs[1], seqs[2]]


# -- planning ------------------------------------------------------------------------


def test_plan_puts_decode_rows_first_then_prefill_within_the_budget(make):
    p = policy(budget=10)
    long, d1, d2 = make("long", 30, 4), make("d1", 3, 4), make("d2", 5, 4)
    for seq in (long, d1, d2):
        p.enqueue(seq)
    p.admit(0.0)
    # A state with the prefilling sequence ahead of two decoding ones.
    long.num_cached = 10
    d1.num_cached, d1.output_ids = 3, [50]
    d2.num_cached, d2.output_ids = 5, [60]
    rows = p.plan()
    assert [(r.seq, r.tokens, r.start) for r in rows] == [
        (d1, [50], 3),
        (d2, [60], 5),
        (long, long.prompt_ids[10:18], 10),
    ]
    assert [r.samples for r in rows] == [True, True, False]
    assert sum(len(r.tokens) for r in rows) == 10


def test_plan_shares_each_steps_prefill_between_the_requests(make):
    """The default: the budget split evenly between the prompts waiting (a
    remainder to the earliest), so the short one is done in the first step
    and decodes in the second, beside the others' last chunks."""
    p = policy(budget=10)
    a, b, c = make("a", 7, 2), make("b", 6, 2), make("c", 2, 2)
    for seq in (a, b, c):
        p.enqueue(seq)
    p.admit(0.0)
    rows = p.plan()
    assert [(r.seq, len(r.tokens), r.start, r.samples) for r in rows] == [(a, 5, 0, False), (b, 3, 0, False), (c, 2, 0, True)]
    step(p, rows)
    rows = p.plan()
    assert [(r.seq, len(r.tokens), r.start, r.samples) for r in rows] == [(c, 1, 2, True), (a, 2, 5, True), (b, 3, 3, True)]


def test_whole_prompts_are_never_cut(make):
    """An encoder's engine (whole_prompts): each prompt runs whole in one
    step, in admission order while the budget holds it; one that does not
    fit waits for the next step, and none is ever split."""
    p = SchedulingPolicy(BlockPool(64, BS), max_num_seqs=8, max_model_len=10, prefill_budget=10, max_queue=64, whole_prompts=True)
    a, b, c = make("a", 7, 0), make("b", 6, 0), make("c", 2, 0)
    for seq in (a, b, c):
        seq.pooling = "mean"
        p.enqueue(seq)
    p.admit(0.0)
    rows = p.plan()
    assert [(r.seq, len(r.tokens), r.start) for r in rows] == [(a, 7, 0)]  # b's 6 do not fit beside a's 7: c waits behind it
    p.stepped(rows)
    p.finish(a, "stop")
    rows = p.plan()
    assert [(r.seq, len(r.tokens), r.start) for r in rows] == [(b, 6, 0), (c, 2, 0)]


def test_plan_takes_prefill_chunks_in_admission_order_as_older_traces_did(make):
    p = policy(budget=10, sharing="tenants")
    a, b, c = make("a", 7, 2), make("b", 6, 2), make("c", 2, 2)
    for seq in (a, b, c):
        p.enqueue(seq)
    p.admit(0.0)
    rows = p.plan()
    assert [(r.seq, len(r.tokens), r.start, r.samples) for r in rows] == [(a, 7, 0, True), (b, 3, 0, False)]
    step(p, rows)
    rows = p.plan()
    # a decodes; b finishes its prompt; c's whole prompt fits behind it.
    assert [(r.seq, len(r.tokens), r.start, r.samples) for r in rows] == [(a, 1, 7, True), (b, 3, 3, True), (c, 2, 0, True)]


def test_an_unknown_prefill_sharing_is_refused():
    with pytest.raises(ValueError, match="prefill_sharing must be one of"):
        policy(sharing="fifo")


def test_long_prompt_is_chunked_across_steps_while_decode_rows_keep_going(make):
    p = policy(budget=8)
    d1, d2 = make("d1", 2, 20), make("d2", 2, 20)
    for seq in (d1, d2):
        p.enqueue(seq)
    p.admit(0.0)
    step(p, p.plan())  # both prompts in one step; each has its first token
    long = make("long", 40, 2)
    p.enqueue(long)
    assert p.admit(0.0) == [long]
    chunks = []
    while long.num_cached < 40:
        before = (d1.num_tokens, d2.num_tokens)
        rows = p.plan()
        assert sum(len(r.tokens) for r in rows) <= 8
        # Every step: one decode row for each decoding sequence, first.
        assert [(r.seq, len(r.tokens)) for r in rows[:2]] == [(d1, 1), (d2, 1)]
        assert [r.seq for r in rows[2:]] == [long]
        chunk = rows[2]
        chunks.append((chunk.start, len(chunk.tokens), chunk.samples))
        assert chunk.tokens == long.prompt_ids[chunk.start : chunk.start + len(chunk.tokens)]
        step(p, rows)
        assert (d1.num_tokens, d2.num_tokens) == (before[0] + 1, before[1] + 1)
    assert chunks == [(0, 6, False), (6, 6, False), (12, 6, False), (18, 6, False), (24, 6, False), (30, 6, False), (36, 4, True)]
    assert long.output_ids == [100]
    rows = p.plan()
    assert [(r.seq, len(r.tokens)) for r in rows] == [(d1, 1), (d2, 1), (long, 1)]


def test_plan_is_empty_without_running_sequences(make):
    p = policy()
    assert p.plan() == []
    p.enqueue(make("a", 3, 3))
    assert p.plan() == []  # waiting, not admitted


def test_stepped_marks_exactly_the_planned_tokens_cached(make):
    p = policy(budget=5)
    seq = make("a", 12, 3)
    p.enqueue(seq)
    p.admit(0.0)
    rows = p.plan()
    assert seq.num_cached == 0  # planning changes nothing
    p.stepped(rows)
    assert seq.num_cached == 5
    assert p.plan()[0].start == 5


# -- cancellation, finishing, death -------------------------------------------------


def test_drop_cancelled_frees_blocks_of_running_and_forgets_waiting(make):
    p = policy(blocks=12, max_num_seqs=2)
    a, b, c, d = make("a", 6, 6), make("b", 10, 2), make("c", 3, 1), make("d", 3, 1)  # 3, 3, 1, 1 blocks
    for seq in (a, b, c, d):
        p.enqueue(seq)
    p.admit(0.0)
    assert p.running == [a, b] and list(p.waiting) == [c, d]
    step(p, p.plan())
    assert p.drop_cancelled() == []
    assert free(p) == 6
    a.cancelled = c.cancelled = True
    dropped = p.drop_cancelled()
    assert set(dropped) == {a, c} and len(dropped) == 2
    for seq in dropped:
        assert seq not in p.waiting and seq not in p.running and seq.finish_reason == "cancelled"
    assert p.running == [b] and list(p.waiting) == [d]
    assert free(p) == 9 and p.block_table(a) == []
    assert len(p.block_table(b)) == 3
    assert p.drop_cancelled() == []  # each one is dropped once
    assert p.admit(0.0) == [d]


def test_finish_returns_the_whole_reservation(make):
    p = policy(blocks=8)
    seq = make("a", 5, 10)  # 4 blocks
    p.enqueue(seq)
    p.admit(0.0)
    assert free(p) == 4
    p.finish(seq, "stop")
    assert free(p) == 8 and p.running == [] and seq.finish_reason == "stop"


def test_fail_all_takes_out_everyone(make):
    p = policy(blocks=12, max_num_seqs=1)
    a, b = make("a", 4, 4), make("b", 4, 4)
    p.enqueue(a)
    p.enqueue(b)
    p.admit(0.0)
    assert set(p.fail_all()) == {a, b}
    assert p.running == [] and list(p.waiting) == [] and free(p) == 12
    assert a.finish_reason == b.finish_reason == "error"


# -- refusals -------------------------------------------------------------------------------


def test_check_fits_names_the_numbers(make):
    p = policy(blocks=10, max_model_len=64)  # the pool holds 40 tokens
    with pytest.raises(RequestTooLarge) as info:
        p.check_fits(60, 10)
    message = str(info.value)
    assert info.value.field == "max_tokens"
    for number in ("60", "10", "70", "64"):
        assert number in message, message
    with pytest.raises(RequestTooLarge) as info:
        p.check_fits(30, 20)
    message = str(info.value)
    for number in ("30", "20", "50", "13", "10", "40"):
        assert number in message, message
    p.check_fits(30, 10)  # exactly the pool
    p.check_fits(1, 39)
    with pytest.raises(RequestTooLarge):
        p.check_fits(1, 40)  # one token past it
    big = policy(blocks=100, max_model_len=64)
    big.check_fits(54, 10)  # exactly max_model_len
    with pytest.raises(RequestTooLarge):
        big.check_fits(55, 10)


def test_enqueue_refuses_what_can_never_fit(make):
    p = policy(blocks=4, max_model_len=64)
    seq = make("a", 10, 10)  # 20 tokens = 5 blocks > 4
    with pytest.raises(RequestTooLarge):
        p.enqueue(seq)
    assert list(p.waiting) == [] and free(p) == 4


def test_queue_full_at_max_queue(make):
    p = policy(max_num_seqs=1, max_queue=2, retry_after=1.5)
    running, w1, w2 = make("r", 3, 3), make("w1", 3, 3), make("w2", 3, 3)
    p.enqueue(running)
    p.admit(0.0)
    p.enqueue(w1)
    p.enqueue(w2)
    extra = make("x", 3, 3)
    with pytest.raises(QueueFull) as info:
        p.enqueue(extra)
    assert info.value.waiting == 2 and info.value.retry_after == 1.5
    assert "1.5" in str(info.value)
    assert list(p.waiting) == [w1, w2]
    # Too large is reported as such even when the queue is full: waiting
    # would never help it.
    with pytest.raises(RequestTooLarge):
        p.enqueue(make("huge", 300, 3))
    # Room again once one is admitted.
    p.finish(running, "stop")
    p.admit(0.0)
    p.enqueue(extra)
    assert list(p.waiting) == [w2, extra]


# -- a step's time under max_step_s -------------------------------------------------

# A made-up machine, in binary fractions so that every sum below is exact:
# a step costs DECODE_S whenever it carries decode rows, and TOKEN_S a prompt token.
DECODE_S, TOKEN_S = 0.25, 1 / 256


def machine(rows: list[PlannedRow]) -> float:
    return (DECODE_S if any(r.decode for r in rows) else 0.0) + TOKEN_S * sum(len(r.tokens) for r in rows if not r.decode)


def _decoding_then_long(make, p: SchedulingPolicy, long_len: int) -> tuple[list[Sequence], Sequence]:
    """Two short sequences prefilled and one decode-only step taken (each
    timed on `machine`), then a long prompt admitted."""
    shorts = [make("d1", 2, 400), make("d2", 2, 400)]
    for seq in shorts:
        p.enqueue(seq)
    p.admit(0.0)
    for _ in range(2):  # their prompts, then a step of decode rows alone
        rows = p.plan()
        p.timed(rows, machine(rows))
        step(p, rows)
    long = make("long", long_len, 2)
    p.enqueue(long)
    assert p.admit(0.0) == [long]
    return shorts, long


def _chunks(p: SchedulingPolicy, long: Sequence, steps: int) -> list[int]:
    sizes = []
    for _ in range(steps):
        rows = p.plan()
        sizes.append(sum(len(r.tokens) for r in rows if r.seq is long))
        p.timed(rows, machine(rows))
        step(p, rows)
    return sizes


def test_max_step_s_shrinks_prompt_chunks_to_fit_the_time_while_others_decode(make):
    p = SchedulingPolicy(BlockPool(1024, BS), max_num_seqs=4, max_model_len=2048, prefill_budget=512, max_queue=8, max_step_s=0.5)
    _, long = _decoding_then_long(make, p, 1500)
    assert p.decode_step_s == DECODE_S
    # Before any step has shown what a prompt token costs, the whole budget
    # (minus the two decode rows); then (0.5 - 0.25) / (1/256) = 64 a step,
    # and every step that carries decode rows is planned to take 0.5 s.
    assert _chunks(p, long, 4) == [510, 64, 64, 64]
    assert p.prompt_token_s == TOKEN_S


def test_the_prompt_part_gets_at_least_the_decode_parts_time(make):
    """A target under a decode-only step's own time still lets the prompt
    part take as long as the decode part (1/4 s: 64 tokens), never less."""
    p = SchedulingPolicy(BlockPool(1024, BS), max_num_seqs=4, max_model_len=2048, prefill_budget=512, max_queue=8, max_step_s=0.1)
    _, long = _decoding_then_long(make, p, 1500)
    assert _chunks(p, long, 3) == [510, 64, 64]


def test_a_slow_machine_still_gets_the_smallest_chunk(make):
    p = SchedulingPolicy(BlockPool(1024, BS), max_num_seqs=4, max_model_len=2048, prefill_budget=512, max_queue=8, max_step_s=0.5)
    _, long = _decoding_then_long(make, p, 1500)
    rows = p.plan()
    p.timed(rows, 1000.0)  # a prompt token looked enormously dear
    step(p, rows)
    assert _chunks(p, long, 1) == [MIN_PROMPT_CHUNK]


def test_without_max_step_s_or_decode_rows_chunks_fill_the_budget(make):
    off = SchedulingPolicy(BlockPool(1024, BS), max_num_seqs=4, max_model_len=2048, prefill_budget=512, max_queue=8)
    _, long = _decoding_then_long(make, off, 1500)
    assert _chunks(off, long, 3) == [510, 510, 480]
    # With the limit, a prompt alone (nothing decoding) still takes the whole budget.
    alone = SchedulingPolicy(BlockPool(1024, BS), max_num_seqs=4, max_model_len=2048, prefill_budget=512, max_queue=8, max_step_s=0.01)
    alone.decode_step_s, alone.prompt_token_s = DECODE_S, TOKEN_S
    seq = make("alone", 1100, 2)
    alone.enqueue(seq)
    alone.admit(0.0)
    assert _chunks(alone, seq, 3) == [512, 512, 76]


def test_timed_learns_only_from_steps_with_enough_prompt_tokens(make):
    p = policy()
    seq = make("a", 8, 3)
    p.enqueue(seq)
    p.admit(0.0)
    rows = p.plan()  # 8 prompt tokens: too few to price one
    p.timed(rows, 0.5)
    assert (p.decode_step_s, p.prompt_token_s) == (None, None)
    p.timed(rows, 0.0)  # no time at all (equal clock readings) teaches nothing either
    assert (p.decode_step_s, p.prompt_token_s) == (None, None)


def test_tenants_share_each_steps_prefill_budget(make):
    """Bob's two long prompts came first; Alice's short one still gets half
    of every step's budget from the first step on, and what she leaves goes
    to Bob. Without tenants (one group), admission order alone."""
    for sharing, first, second in (
        # Bob's share split between his two prompts too.
        ("requests", [("b1", 5), ("b2", 5), ("al", 6)], [("al", 1, True), ("b1", 8, False), ("b2", 7, False)]),
        # Older traces: his share in admission order.
        ("tenants", [("b1", 10), ("al", 6)], [("al", 1, True), ("b1", 15, False)]),
    ):
        p = policy(budget=16, sharing=sharing)
        bob1, bob2, alice = make("b1", 40, 2), make("b2", 40, 2), make("al", 6, 2)
        bob1.tenant = bob2.tenant = "bob"
        alice.tenant = "alice"
        for seq in (bob1, bob2, alice):
            p.enqueue(seq)
        p.admit(0.0)
        rows = p.plan()
        assert [(r.seq.id, len(r.tokens)) for r in rows] == first  # her 6 of 8; her 2 spare went to Bob
        step(p, rows)
        rows = p.plan()
        assert [(r.seq.id, len(r.tokens), r.samples) for r in rows] == second  # she decodes; Bob has the rest


def test_prefill_shares_split_evenly_and_hand_on_what_is_not_needed(make):
    from trioserve.state.scheduling import prefill_shares

    seqs = [make(name, length, 1) for name, length in (("a1", 30), ("b1", 3), ("c1", 30), ("a2", 30))]
    for seq, tenant in zip(seqs, ("a", "b", "c", "a"), strict=True):
        seq.tenant = tenant
    a1, b1, c1, a2 = seqs
    # 4 each; b's spare 1 went to a (first), whose 5 are split between its two.
    assert [(s.id, n) for s, n in prefill_shares(seqs, 12)] == [("a1", 3), ("b1", 3), ("c1", 4), ("a2", 2)]
    assert [(s.id, n) for s, n in prefill_shares(seqs, 12, even=False)] == [("a1", 5), ("b1", 3), ("c1", 4)]  # older traces
    for even in (True, False):
        assert [(s.id, n) for s, n in prefill_shares(seqs, 100, even=even)] == [("a1", 30), ("b1", 3), ("c1", 30), ("a2", 30)]
        assert prefill_shares(seqs, 0, even=even) == []
    for seq in seqs:
        seq.tenant = None
    assert [(s.id, n) for s, n in prefill_shares(seqs, 40)] == [("a1", 13), ("b1", 3), ("c1", 12), ("a2", 12)]  # 10 each, b's spare 7 to the rest
    assert [(s.id, n) for s, n in prefill_shares(seqs, 40, even=False)] == [("a1", 30), ("b1", 3), ("c1", 7)]  # admission order, as before
