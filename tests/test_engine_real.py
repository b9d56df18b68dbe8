"""The engine on the real default model: concurrent chats answer coherently
and each greedy answer equals the answer the same request gets alone."""

from __future__ import annotations

import pytest
import torch
import trio

from trioserve.kernels.cpu import resolve_dtype
from trioserve.types import FinalEvent, GenerateRequest, TokenEvent
from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import load_checkpoint
from trioserve.types import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Italy?",
    "What color is the sky on a clear day?",
    "Name a primary color.",
    "How many days are in a week?",
    "What is 2 + 2?",
    "What is the opposite of hot?",
    "What animal says moo?",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_checkpoint("smollm2", dtype=resolve_dtype("auto"))


async def ask(engine, template, tok, question: str) -> tuple[list[int], str, FinalEvent]:
    prompt = tok.encode(template.render([{"role": "user", "content": question}]))
    ids, text, final = [], [], None
    async for event in engine.generate(GenerateRequest(prompt, SamplingParams(max_tokens=40, temperature=0.0))):
        if isinstance(event, TokenEvent):
            ids.append(event.token_id)
        else:
            final = event
        text.append(event.text)
    return ids, "".join(text), final


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "batch-dependent"])
async def test_eight_concurrent_chats_equal_their_solo_answers(smollm2, invariant):
    """In both modes: bit-exact by construction with --batch-invariant (the
    default), by the margins of these greedy answers without it."""
    tok = smollm2.tokenizer
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    config = EngineConfig(max_num_seqs=8, kv_cache_bytes=64 << 20, batch_invariant=invariant)
    with trio.fail_after(300):
        async with open_engine(config, checkpoint=smollm2) as engine:
            solo = [await ask(engine, template, tok, q) for q in QUESTIONS]
            together: dict[int, tuple] = {}

            async def run(i: int) -> None:
                together[i] = await ask(engine, template, tok, QUESTIONS[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(QUESTIONS)):
                    nursery.start_soon(run, i)
            stats = engine.statistics()
    for i, (ids, text, final) in enumerate(solo):
        print(QUESTIONS[i], "->", repr(text), final.finish_reason)
        assert together[i][0] == ids, QUESTIONS[i]
        assert final.finish_reason in ("stop", "length") and len(text.split()) >= 2
    # Coherent: the answers a reader would check.
    for i, word in [(0, "Paris"), (2, "blue"), (4, "7"), (5, "4"), (6, "cold")]:
        assert word in solo[i][1], (QUESTIONS[i], solo[i][1])
    assert sum(final.finish_reason == "stop" for _, _, final in solo) >= 4
    assert stats.kv_blocks_used == 0 and stats.running == 0
    assert stats.finished_count("stop") + stats.finished_count("length") == 16
