"""Batch invariance with the real default model (SmolLM2, served as by
default: bf16 plus the checkpoint's 4-bit projections, through the real
HTTP server; issue #11, docs/determinism.md): twenty seeded temperature-1
chat requests each give the same text, finish reason, usage and token
logprobs (with their alternatives) when sent alone on an idle server as
when sent among a continuous crowd of 31 random requests -- random prompts
and lengths, greedy and sampled, chat and completions, streamed and
buffered -- with up to 51 rows in a step.

Half the targets go alone first (buffered) and then into the crowd
(streamed): their crowded prompts can come from the prefix cache. The other
half go into the crowd first (buffered), their prompts prefilled in chunks
among the crowd's, and alone afterwards (streamed), reading the KV the
crowded run left in the prefix cache. Slow: loads the model and decodes
about 2,000 tokens."""

from __future__ import annotations

import os
import random

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import eventually, metrics, start_server
from tests.http.test_invariance_restart import CHAT, Outcome, assert_mode, crowd_request, idle, running_at_least, send
from trioserve.config import EngineConfig, ServerSettings

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
CROWD = 31
PROMPTS = (
    "What is the capital of France?",
    "Name a primary color.",
    "What animal says moo?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Write one word about the sea.",
    "What is 2 + 2?",
    "Say hello to a friend.",
    "Tell me a fact about the moon.",
    "What do bees make?",
    "Describe rain in a sentence.",
    "Give me a name for a cat.",
    "What is the boiling point of water?",
    "Which is bigger, a mouse or a horse?",
    "Write a short greeting for a letter.",
    "What season comes after winter?",
    "Name a musical instrument.",
    "What color is the sky at night?",
    "Suggest a fruit for breakfast.",
    "How do you say thank you in Spanish?",
)
SENTENCES = (
    "The old lighthouse stands on a rocky point at the edge of the bay.",
    "Every evening the keeper climbs one hundred and twelve steps to light the lamp.",
    "Fishing boats follow its beam home through fog and winter storms.",
    "In spring the village holds a market with bread, cheese and fresh fish.",
    "Children run along the harbour wall while gulls circle overhead.",
    "A small museum keeps maps, ropes and a bell from a ship that sank long ago.",
    "The road to the next town winds through fields of barley and wild flowers.",
    "Most visitors arrive by train and stay for a night or two at the inn.",
    "The inn serves soup in the afternoon and tells stories by the fire at night.",
)
# Every third target asks about a note of some 130 tokens: prompts long
# enough to be cut into several chunks among the crowd's.
LONG = frozenset(range(0, len(PROMPTS), 3))
# Alone first, then in the crowd; the others the other way round.
ALONE_FIRST = frozenset(range(0, len(PROMPTS), 2))


def question(k: int) -> str:
    if k not in LONG:
        return PROMPTS[k]
    note = " ".join(SENTENCES[(k + i) % len(SENTENCES)] for i in range(len(SENTENCES)))
    return f"Read note {k}, then answer briefly. Note {k}: {note} Question: {PROMPTS[k]}"


def target(k: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": question(k)}],
        "temperature": 1,
        "seed": 1009 * k + 17,
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        "top_logprobs": 2,
    }
    if k % 4 == 1:
        body["ignore_eos"] = True  # past the EOS the model would draw
    return body


async def test_twenty_seeded_requests_same_alone_and_in_a_crowd(nursery):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    context = f"(crowd seed {seed})"
    # Room for all targets beside the whole crowd; a step of at most 128
    # tokens cuts prompts into more chunks and keeps steps short.
    engine = EngineConfig(model="smollm2", max_num_seqs=64, prefill_budget=128)
    settings = attrs.evolve(ServerSettings(engine=engine), host="127.0.0.1", port=0, log_level="warning")
    assert settings.engine.batch_invariant is True  # the default under test
    url = await start_server(nursery, settings)
    alone: dict[int, Outcome] = {}
    crowded: dict[int, Outcome] = {}
    spans: dict[int, tuple[float, float]] = {}
    samples: list[tuple[float, int]] = []  # (time, requests running)
    crowd_sent = 0
    begun = trio.current_time()

    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=httpx.Limits(max_connections=None)) as client:
        with trio.fail_after(360):
            await assert_mode(client, True)

            async def by_itself(k: int, stream: bool) -> None:
                await eventually(lambda: idle(client), timeout=30, what="an idle engine")
                alone[k] = await send(client, CHAT, target(k), stream)
                assert (await metrics(client))["waiting"] == 0

            for k in sorted(ALONE_FIRST):
                await by_itself(k, stream=False)
            phase_alone_1 = trio.current_time()

            # -- the crowd: 31 clients, each sending random requests back to back.
            streaming = trio.Event()

            async def crowd_client() -> None:
                nonlocal crowd_sent
                while True:
                    path, body, stream = crowd_request(rng, max_words=60, max_tokens=(4, 48), long_share=0.2)
                    crowd_sent += 1
                    # `streaming` is set once a streamed crowd request has its first chunk.
                    await send(client, path, body, stream, streaming if stream else None)

            async def watch() -> None:
                while True:
                    samples.append((trio.current_time(), (await metrics(client))["running"]))
                    await trio.sleep(0.05)

            async def in_crowd(k: int, delay: float) -> None:
                await trio.sleep(delay)
                begin = trio.current_time()
                crowded[k] = await send(client, CHAT, target(k), k in ALONE_FIRST)
                spans[k] = (begin, trio.current_time())

            async with trio.open_nursery() as crowd:
                for _ in range(CROWD):
                    crowd.start_soon(crowd_client)
                await streaming.wait()  # a streamed crowd request has its first tokens...
                await eventually(lambda: running_at_least(client, 24), timeout=60, what="most of the crowd running")  # ...and most run
                crowd.start_soon(watch)
                async with trio.open_nursery() as targets:
                    for k in range(len(PROMPTS)):
                        targets.start_soon(in_crowd, k, rng.uniform(0, 1.0))
                crowd.cancel_scope.cancel()
            phase_crowd = trio.current_time()

            for k in sorted(set(range(len(PROMPTS))) - ALONE_FIRST):
                await by_itself(k, stream=True)
            await assert_mode(client, True)

    timing = (
        f"alone {phase_alone_1 - begun:.1f} s, crowd {phase_crowd - phase_alone_1:.1f} s ({crowd_sent} crowd requests), "
        f"alone {trio.current_time() - phase_crowd:.1f} s"
    )
    print(timing)

    # The crowd really was there: every target ran while most of it did.
    for k, (begin, end) in spans.items():
        during = [running for t, running in samples if begin <= t <= end]
        assert during, f"target {k}: no /metrics sample while it ran {context}"
        assert min(during) >= 2 and max(during) >= CROWD, f"target {k}: {during} running while it ran {context}"
    assert max(running for _, running in samples) > 32, f"never more than 32 rows in a step {context}"

    assert set(alone) == set(crowded) == set(range(len(PROMPTS)))
    differ = {k: alone[k].differences(crowded[k]) for k in range(len(PROMPTS)) if alone[k] != crowded[k]}
    assert not differ, f"outputs changed in the crowd {context}:\n" + "\n".join(
        f"target {k} {PROMPTS[k]!r} seed {target(k)['seed']} ({'alone buffered, crowd streamed' if k in ALONE_FIRST else 'crowd buffered, alone streamed'}): {why}"
        for k, why in differ.items()
    )
    for k, outcome in alone.items():  # each compared something
        # Every completion token has its logprob entry, an EOS that stopped the text too (issue #48).
        assert outcome.completion_tokens > 0 and len(outcome.logprobs) == outcome.completion_tokens, (k, outcome)
        if target(k).get("ignore_eos"):
            assert outcome.completion_tokens == MAX_TOKENS and outcome.finish_reason == "length", (k, outcome)
    assert len({o.text for o in alone.values()}) == len(PROMPTS)

