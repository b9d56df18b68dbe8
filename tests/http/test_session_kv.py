"""Sessions keep their KV: over a real server with the tiny model, each turn
prefills only its new tokens (read from the prefix-cache hit counters) even
when the cache's own limits let every unpinned block go -- in the default
batch-invariant mode with bf16 activations, its new tokens and the previous
reply, whose KV came from generated-token arithmetic and is never shared
(with int8 activations, one path for both, only its new tokens;
docs/determinism.md); under KV pressure
an idle session's kept blocks are let go, and its next turn prefills the
history again and says exactly the same; idle sessions leave in LRU order
and a session with a turn running is never the one that leaves."""

from __future__ import annotations

import attrs
import httpx
import pytest
import torch
import trio

from tests.http.conftest import BLOCK_SIZE, MAX_MODEL_LEN, kv_bytes, make_settings, metrics, start_server
from tests.http.test_sessions import TIMEOUT, create, turn
from trioserve.kernels import native
from trioserve.models.checkpoint import load_checkpoint

GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
QUESTIONS = ("first question", "a second one", "now the third", "fourth of five", "and the last")


async def prefix_counters(client) -> tuple[int, int]:
    p = (await metrics(client))["prefix_cache"]
    return p["query_tokens"], p["hit_tokens"]


@pytest.fixture
def word_bias(tiny_gguf) -> dict[str, float]:
    """A logit bias that makes the random tiny model say " dog dog ...".
    Its free output is random tokens, whose text may encode back to other
    ids; a session keeps the ids it generated while stateless chat encodes
    the text again, so only text that round-trips can match both ways (the
    real model's answers do: see test_real_sessions)."""
    tok = load_checkpoint(tiny_gguf, dtype=torch.float32).tokenizer
    (dog,) = tok.encode(" dog", add_bos=False)
    assert tok.encode(" dog" * 6, add_bos=False) == [dog] * 6
    return {str(dog): 100.0}


@pytest.mark.parametrize(
    ("invariant", "activations", "kind"),
    [
        (True, "bf16", "gguf_f32"),
        pytest.param(True, "int8", "gguf_q4_1", marks=pytest.mark.skipif(not native.int4_q8_supported(16, 32), reason="int8 activations need the C kernel (AVX2, AVX-512 VNNI or NEON dotprod, and a C compiler)")),
        (False, "auto", "gguf_f32"),
    ],
    ids=["batch-invariant-bf16", "batch-invariant-int8", "batch-dependent"],
)
async def test_five_turns_prefill_only_their_new_tokens_and_match_stateless_chat(nursery, tiny_checkpoints, word_bias, invariant, activations, kind):
    # The cache may keep one idle block: whatever a session does not pin is
    # gone as soon as its request ends, so every hit below is the session's.
    # Only batch invariance with bf16 activations keeps a reply's KV out of sharing
    # (its arithmetic differs from a prompt's); with int8 both take one path.
    unshared = invariant and activations == "bf16"
    # int8 takes a checkpoint with 4-bit codes (the f32 one has none, and runs bf16 whatever is asked)
    settings = make_settings(tiny_checkpoints[kind], prefix_cache_max_blocks=1, batch_invariant=invariant, activations=activations)
    url = await start_server(nursery, settings)
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            sid = await create(client, system="Answer briefly.", logit_bias=word_bias, **GREEDY)
            history = [{"role": "system", "content": "Answer briefly."}]
            previous_tokens = None  # prompt + completion of the last turn
            previous_reply = 0  # its completion tokens
            for k, question in enumerate(QUESTIONS):
                queried, hit = await prefix_counters(client)
                reply = await turn(client, sid, question)
                queried_after, hit_after = await prefix_counters(client)
                prompt = reply["usage"]["prompt_tokens"]
                assert queried_after - queried == prompt
                prefilled = prompt - (hit_after - hit)
                if previous_tokens is not None:
                    new = prompt - previous_tokens  # the new user message and the template around it
                    # The kept blocks cover the history but its last, partly filled block; with
                    # batch invariance they stop where the last reply's tokens begin.
                    kept = previous_tokens - previous_reply if unshared else previous_tokens
                    assert prefilled <= prompt - kept + BLOCK_SIZE, f"turn {k + 1}: prefilled {prefilled} of {prompt}, new {new}"
                    assert hit_after - hit >= kept - BLOCK_SIZE, f"turn {k + 1}"
                    if unshared:
                        assert prefilled >= new + previous_reply, f"turn {k + 1}: the last reply's KV was shared"
                previous_reply = reply["usage"]["completion_tokens"]
                previous_tokens = prompt + previous_reply

                content = reply["choices"][0]["message"]["content"]
                history.append({"role": "user", "content": question})
                stateless = await client.post("/v1/chat/completions", json={"messages": history, "logit_bias": word_bias, **GREEDY})
                assert stateless.status_code == 200, stateless.text
                assert stateless.json()["choices"][0]["message"]["content"] == content, f"turn {k + 1}"
                history.append({"role": "assistant", "content": content})
            m = await metrics(client)
    assert m["activations"] == ("int8" if activations == "int8" else "bf16")  # auto on a model without 4-bit codes: bf16
    kept = previous_tokens - previous_reply if unshared else previous_tokens
    assert m["prefix_cache"]["pinned_owners"] == 1 and m["prefix_cache"]["pinned_blocks"] >= kept // BLOCK_SIZE - 1
    assert m["sessions"]["turns_committed"] == len(QUESTIONS)


async def test_kept_kv_goes_under_pressure_and_the_next_turn_is_unchanged(nursery, tiny_gguf, word_bias):
    """A pool of exactly one full context: a long stateless request needs
    every block, so the idle session's kept blocks are taken. Its next turn
    prefills the whole history again and gives what stateless chat gives."""
    url = await start_server(nursery, make_settings(tiny_gguf, kv_cache_bytes=kv_bytes(MAX_MODEL_LEN), max_num_seqs=1))
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            sid = await create(client, logit_bias=word_bias, **GREEDY)
            history = []
            for question in QUESTIONS[:2]:
                content = (await turn(client, sid, question))["choices"][0]["message"]["content"]
                history += [{"role": "user", "content": question}, {"role": "assistant", "content": content}]
            kept = (await metrics(client))["prefix_cache"]
            assert kept["pinned_owners"] == 1 and kept["pinned_blocks"] > 0 and kept["pin_evictions"] == 0

            hog = await client.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "temperature": 0}
            )
            assert hog.status_code == 200, hog.text
            after = (await metrics(client))["prefix_cache"]
            assert after["pin_evictions"] == 1 and after["pinned_owners"] == 0, after

            queried, hit = await prefix_counters(client)
            third = await turn(client, sid, QUESTIONS[2])
            _, hit_after = await prefix_counters(client)
            assert hit_after - hit < BLOCK_SIZE * 2, "the history should have been prefilled again"
            history.append({"role": "user", "content": QUESTIONS[2]})
            stateless = await client.post("/v1/chat/completions", json={"messages": history, "logit_bias": word_bias, **GREEDY})
            assert third["choices"][0]["message"]["content"] == stateless.json()["choices"][0]["message"]["content"]
            assert (await client.get(f"/v1/sessions/{sid}")).json()["turns"] == 3


async def test_idle_sessions_leave_in_lru_order_and_a_running_one_stays(nursery, tiny_gguf, slow_steps):
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), max_sessions=2))
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            a = await create(client, **GREEDY)
            b = await create(client, **GREEDY)
            await turn(client, a, "keep me")  # a is now the most recently used
            c = await create(client)  # over the limit: b, the least recently used, goes
            assert (await client.get(f"/v1/sessions/{b}")).status_code == 404
            gone = await client.post(f"/v1/sessions/{b}/turns", json={"messages": [{"role": "user", "content": "hi"}]})
            assert gone.status_code == 404 and "evicted" in gone.json()["error"]["message"]
            assert (await metrics(client))["prefix_cache"]["pinned_owners"] == 1  # a's; b kept nothing

            slow_steps(0.02)
            body = {"messages": [{"role": "user", "content": "a long one"}], "max_tokens": 40, "stream": True}
            async with client.stream("POST", f"/v1/sessions/{a}/turns", json=body) as running:
                assert running.status_code == 200
                await create(client)  # a is busy, so c goes though a is older
                assert (await client.get(f"/v1/sessions/{c}")).status_code == 404
                assert (await client.get(f"/v1/sessions/{a}")).json()["busy"] is True
                async for _ in running.aiter_lines():
                    pass
            state = (await client.get(f"/v1/sessions/{a}")).json()
            sessions = (await metrics(client))["sessions"]
    assert state["turns"] == 2 and state["busy"] is False
    assert sessions["evicted"] == 2 and sessions["active"] == 2


async def test_deleting_a_session_lets_its_kv_go(server):
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            sid = await create(client, **GREEDY)
            await turn(client, sid, "remember this for me please")
            assert (await metrics(client))["prefix_cache"]["pinned_owners"] == 1
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200
            # Orders take effect at the scheduler's next iteration: a request makes one.
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert (await metrics(client))["prefix_cache"]["pinned_owners"] == 0
