"""A five-turn session with the real default model (SmolLM2, through the real
HTTP server): every turn prefills only its new tokens and the previous
reply (batch invariance shares no KV that generated tokens wrote), even with
a prefix cache that keeps nothing of its own, and says exactly what stateless chat
completions say when sent the whole history. Slow: loads the model."""

from __future__ import annotations

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import metrics, start_server
from tests.http.test_sessions import create, turn
from trioserve.config import EngineConfig, ServerSettings

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
GREEDY = {"temperature": 0, "max_tokens": 24}
QUESTIONS = (
    "What is the capital of France?",
    "And of Italy?",
    "Which of the two is further north?",
    "Name a river in the first one.",
    "Thank you. Summarize our talk in one sentence.",
)


async def test_five_real_turns_prefill_only_new_tokens_and_match_stateless(nursery):
    engine = EngineConfig(model="smollm2", block_size=BLOCK_SIZE, max_num_seqs=2, prefix_cache_max_blocks=1)
    settings = attrs.evolve(ServerSettings(engine=engine), host="127.0.0.1", port=0, log_level="warning")
    url = await start_server(nursery, settings)
    with trio.fail_after(240):
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
            sid = await create(client, system="You are a helpful geography tutor.", **GREEDY)
            history = [{"role": "system", "content": "You are a helpful geography tutor."}]
            previous = None
            previous_reply = 0
            for k, question in enumerate(QUESTIONS, start=1):
                before = (await metrics(client))["prefix_cache"]
                reply = await turn(client, sid, question)
                after = (await metrics(client))["prefix_cache"]
                prompt = reply["usage"]["prompt_tokens"]
                prefilled = prompt - (after["hit_tokens"] - before["hit_tokens"])
                if previous is not None:
                    kept = previous - previous_reply
                    assert prefilled <= prompt - kept + BLOCK_SIZE, f"turn {k}: prefilled {prefilled} of {prompt} (history {previous})"
                previous_reply = reply["usage"]["completion_tokens"]
                previous = prompt + previous_reply

                content = reply["choices"][0]["message"]["content"]
                assert content.strip(), f"turn {k} said nothing"
                history.append({"role": "user", "content": question})
                stateless = await client.post("/v1/chat/completions", json={"messages": history, **GREEDY})
                assert stateless.json()["choices"][0]["message"]["content"] == content, f"turn {k}"
                history.append({"role": "assistant", "content": content})
    assert len(history) == 1 + 2 * len(QUESTIONS)
