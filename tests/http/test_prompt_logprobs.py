"""Prompt log-probabilities through the real server, with the tiny random
model in float32 (issue #29, part 2): `echo` with `logprobs` (and
`max_tokens` 0) on /v1/completions, as lm-evaluation-harness asks, and
vLLM's `prompt_logprobs` on completions and chat.

The reference is generation itself. The prompt is walked one token at a
time: after each prefix the server generates one token (greedy, logprobs 5)
and the next prompt token is picked among the five likeliest it lists, so
the log-probability generation gives each prompt token is known. Scoring
the whole prompt in one prefill must give exactly those numbers (and the
same alternatives), alone, among long generations, and with the prompt
prefilled in chunks of 8 tokens on a second server. A prompt whose prefix
the cache holds is scored from scratch (no cached tokens). The 400s name
`max_tokens` (0 without echo) and `prompt_logprobs` (out of range, wrong
type, with stream)."""

from __future__ import annotations

import math

import httpx
import pytest
import trio

from tests.http.conftest import assert_error, eventually, make_settings, metrics, read_sse, start_server
from trioserve.models.checkpoint import load_tokenizer

TOP = 5  # the most alternatives a completion's logprobs lists
LENGTH = 40  # prompt tokens: five chunks of 8 on the chunking server
TIMEOUT = 120


def single_token_texts(tokenizer, first_id: int = 3) -> dict[str, int]:
    """Token text -> id for the tokens whose text no other token has (a
    completion's alternatives are keyed by text), special ids left out."""
    seen: dict[str, list[int]] = {}
    for token in range(first_id, tokenizer.vocab_size):
        seen.setdefault(tokenizer.token_bytes(token).decode("utf-8", errors="replace"), []).append(token)
    return {text: ids[0] for text, ids in seen.items() if len(ids) == 1}


async def walk_prompt(client: httpx.AsyncClient, ids_of: dict[str, int], first: int, length: int) -> tuple[list[int], list[float], list[dict]]:
    """A prompt of ``length`` tokens starting with ``first``, each later
    token one of the five likeliest that generating after the prompt so far
    lists (greedy, max_tokens 1, logprobs 5; picked by a rank that cycles,
    so not always the likeliest). Returns the ids, the logprob generation
    gave each token after the first, and the alternatives listed there."""
    ids, refs, tops = [first], [], []
    for k in range(1, length):
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": TOP, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        top = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        ranked = [text for text, _ in sorted(top.items(), key=lambda item: -item[1]) if text in ids_of]
        assert ranked, f"none of {sorted(top)} is a token of its own text"
        pick = ranked[(3 * k) % len(ranked)]
        ids.append(ids_of[pick])
        refs.append(top[pick])
        tops.append(top)
    return ids, refs, tops


def scoring(ids: list[int], **more) -> dict:
    """What lm-evaluation-harness sends to score a prompt: echo, logprobs, no generation."""
    return {"prompt": ids, "echo": True, "logprobs": TOP, "max_tokens": 0, "temperature": 0, **more}


async def score(client: httpx.AsyncClient, body: dict) -> dict:
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def ids_of(tiny_checkpoints) -> dict[str, int]:
    return single_token_texts(load_tokenizer(tiny_checkpoints["gguf_f32"]))


@pytest.fixture
async def walked(server, ids_of):
    """The default server's URL, a walked prompt, its references and alternatives."""
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        ids, refs, tops = await walk_prompt(client, ids_of, first=sorted(ids_of.values())[len(ids_of) // 2], length=LENGTH)
    return server, ids, refs, tops


async def long_generations(client: httpx.AsyncClient, nursery: trio.Nursery, count: int, done: list) -> None:
    """Start ``count`` long sampled generations and wait until they run."""
    for i in range(count):
        body = {"prompt": [5 + i, 9, 17, 23 + i, 31] * 6, "max_tokens": 150, "temperature": 1, "seed": i, "ignore_eos": True}

        async def run(body=body) -> None:
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            done.append(response.json())

        nursery.start_soon(run)

    async def running() -> str | None:
        now = (await metrics(client))["running"]
        return None if now >= count else f"{now} running"

    await eventually(running, timeout=30, what="the long generations running")


async def test_echo_scores_are_exactly_the_logprobs_generation_gives(walked):
    url, ids, refs, tops = walked
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        body = await score(client, scoring(ids))
        plain = await score(client, {"prompt": ids, "echo": True, "max_tokens": 0})
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == plain["choices"][0]["text"] and choice["text"]  # the prompt, echoed, nothing more
    assert body["usage"]["prompt_tokens"] == LENGTH and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == LENGTH
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == refs  # bit for bit: the same forward pass, the same rows
    assert lp["top_logprobs"][1:] == tops
    assert math.fsum(lp["token_logprobs"][1:]) == math.fsum(refs)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # A prompt the prefix cache holds (every prefix was just prefilled) is scored from scratch.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_the_scores_are_the_same_alone_among_long_generations_and_prefilled_in_chunks(walked, nursery, tiny_gguf):
    url, ids, refs, _ = walked
    chunked = await start_server(nursery, make_settings(tiny_gguf, prefill_budget=8))
    results = {}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        results["alone"] = await score(client, scoring(ids))
        async with trio.open_nursery() as crowd:
            done: list = []
            await long_generations(client, crowd, 3, done)
            # Two prompts in one request, scored side by side (as the harness batches them).
            results["batched"] = await score(client, scoring([ids, ids[:25]]))
            assert (await metrics(client))["running"] >= 1 and not done  # the crowd was still there
    async with httpx.AsyncClient(base_url=chunked, timeout=TIMEOUT) as client:
        results["chunked"] = await score(client, scoring(ids))
        async with trio.open_nursery() as crowd:
            await long_generations(client, crowd, 3, [])
            results["chunked, crowded"] = await score(client, scoring(ids))
    alone = results["alone"]["choices"][0]["logprobs"]
    assert alone["token_logprobs"][1:] == refs
    first, second = sorted(results["batched"]["choices"], key=lambda c: c["index"])
    assert first["logprobs"] == alone
    assert second["logprobs"]["token_logprobs"] == alone["token_logprobs"][:25]
    assert second["logprobs"]["top_logprobs"] == alone["top_logprobs"][:25]
    for name in ("chunked", "chunked, crowded"):
        assert results[name]["choices"][0]["logprobs"] == alone, name


async def test_streamed_scores_come_first_then_the_generated_tokens(walked):
    url, ids, _, _ = walked
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        buffered = await score(client, scoring(ids, max_tokens=3, ignore_eos=True))
        async with client.stream("POST", "/v1/completions", json=scoring(ids, max_tokens=3, ignore_eos=True, stream=True)) as response:
            streamed = await read_sse(response)
        async with client.stream("POST", "/v1/completions", json=scoring(ids, stream=True)) as response:
            scored_only = await read_sse(response)
    whole = buffered["choices"][0]
    assert whole["finish_reason"] == "length" and buffered["usage"]["completion_tokens"] == 3
    assert len(whole["logprobs"]["tokens"]) == LENGTH + 3
    chunks = streamed.choice_chunks(0)
    first = chunks[0]
    assert first["text"] and first["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"][:LENGTH]
    assert first["logprobs"]["top_logprobs"] == whole["logprobs"]["top_logprobs"][:LENGTH]
    joined = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == whole["logprobs"]
    assert streamed.content() == whole["text"]
    assert streamed.payloads[-1] == "[DONE]"
    only = scored_only.choice_chunks(0)
    assert [c["finish_reason"] for c in only] == [None, "length"] and only[-1]["text"] == ""
    assert only[0]["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"][:LENGTH]


async def test_echo_with_generation_keeps_the_generated_tokens_logprobs(walked):
    url, ids, _, _ = walked
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        echoed = await score(client, scoring(ids, max_tokens=4, ignore_eos=True, seed=3, temperature=1))
        plain = await score(client, {"prompt": ids, "max_tokens": 4, "ignore_eos": True, "seed": 3, "temperature": 1, "logprobs": TOP})
    e, p = echoed["choices"][0], plain["choices"][0]
    assert e["text"].endswith(p["text"])
    prompt_text = e["text"][: len(e["text"]) - len(p["text"])]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert e["logprobs"][key][LENGTH:] == p["logprobs"][key]
    assert e["logprobs"]["text_offset"][LENGTH:] == [at + len(prompt_text) for at in p["logprobs"]["text_offset"]]


async def test_each_prompt_is_scored_once_whatever_n_and_every_choice_shows_its_scores(walked):
    """n: 4 (and two prompts): every choice lists its prompt's scores, the
    same as n: 1 gives, buffered and streamed; only each prompt's first
    choice asks the engine to score it (issue #49: each choice rescored
    the prompt, n times the output head over every prompt position)."""
    url, ids, refs, _ = walked
    other = ids[:20]
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        one = await score(client, scoring([ids, other], max_tokens=2, ignore_eos=True, prompt_logprobs=2))
        four = await score(client, scoring([ids, other], max_tokens=2, ignore_eos=True, prompt_logprobs=2, n=4, seed=5, temperature=1))
        async with client.stream("POST", "/v1/completions", json=scoring([ids, other], max_tokens=2, ignore_eos=True, n=4, seed=5, temperature=1, stream=True)) as response:
            streamed = await read_sse(response)
    assert len(four["choices"]) == 8 and four["usage"]["prompt_tokens"] == LENGTH + 20
    for choice in four["choices"]:
        prompt, length = divmod(choice["index"], 4)[0], (LENGTH, 20)[choice["index"] // 4]
        want = one["choices"][prompt]
        assert choice["logprobs"]["token_logprobs"][:length] == want["logprobs"]["token_logprobs"][:length]
        assert choice["logprobs"]["top_logprobs"][:length] == want["logprobs"]["top_logprobs"][:length]
        assert choice["prompt_logprobs"] == want["prompt_logprobs"]
        head = streamed.choice_chunks(choice["index"])[0]  # each streamed choice opens with its echoed, scored prompt
        assert head["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"][:length]
    assert four["choices"][0]["logprobs"]["token_logprobs"][1:LENGTH] == refs


def test_only_the_first_choice_of_each_prompt_asks_for_the_scores():
    from trioserve.http.job import GenerationJob, Prompt
    from trioserve.types import SamplingParams

    params = SamplingParams(max_tokens=2, seed=1, prompt_logprobs=5)
    job = GenerationJob(id="cmpl-x", shape="text", model="m", created=0, prompts=[Prompt("a", [5, 6], params), Prompt("b", [7], params)], n=4)
    asked = [job.request(i).params.prompt_logprobs for i in range(job.choices)]
    assert asked == [5, None, None, None, 5, None, None, None]
    assert [job.scorer(i) for i in range(8)] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert len({job.request(i).params.seed for i in range(4)}) == 4  # each choice keeps its own seed


async def test_prompt_logprobs_on_completions_in_vllms_shape(walked):
    url, ids, refs, tops = walked
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        three = await score(client, {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3})
        none = await score(client, {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
    (choice,) = three["choices"]
    assert choice["logprobs"] is None  # logprobs was not asked for
    listed = choice["prompt_logprobs"]
    assert len(listed) == LENGTH and listed[0] is None
    for k in range(1, LENGTH):
        entry, token = listed[k], str(ids[k])
        mine = entry[token]
        assert mine["logprob"] == refs[k - 1]  # the token's own, as generation gave it
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
        best = sorted(entry.items(), key=lambda item: item[1]["rank"])
        if mine["rank"] <= 3:  # the token is one of the three likeliest: listed once, at its rank
            assert [v["rank"] for _, v in best] == [1, 2, 3] and best[mine["rank"] - 1][0] == token
        else:
            assert [v["rank"] for _, v in best] == [1, 2, 3, mine["rank"]] and best[-1][0] == token
            assert all(v["logprob"] >= mine["logprob"] for _, v in best[:3])
        logprobs = [v["logprob"] for _, v in best]
        assert logprobs == sorted(logprobs, reverse=True)
        # The likeliest is the likeliest generation listed there (its text may be shared, so by value).
        assert best[0][1]["logprob"] == max(tops[k - 1].values()) or len(tops[k - 1]) < TOP
    assert [list(e) if e else None for e in none["choices"][0]["prompt_logprobs"]] == [None] + [[str(t)] for t in ids[1:]]


async def test_prompt_logprobs_on_chat_beside_the_choices(server):
    body = {"messages": [{"role": "user", "content": "hello there, how are you"}], "max_tokens": 2, "prompt_logprobs": 2, "n": 2}
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        response = await client.post("/v1/chat/completions", json=body)
        again = await client.post("/v1/chat/completions", json={**body, "n": 1, "seed": 5})
    assert response.status_code == 200, response.text
    out = response.json()
    listed = out["prompt_logprobs"]
    assert len(listed) == out["usage"]["prompt_tokens"] and listed[0] is None
    assert all(1 <= len(entry) <= 3 for entry in listed[1:])
    assert all("prompt_logprobs" not in c for c in out["choices"])
    assert again.json()["prompt_logprobs"] == listed  # the same prompt, scored again


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"prompt_logprobs": -1}, "between 0 and 20"),
        ({"prompt_logprobs": 21}, "between 0 and 20"),
        ({"prompt_logprobs": "3"}, "prompt_logprobs"),
        ({"prompt_logprobs": 2.5}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 2, "stream": True}, "not supported with stream"),
    ],
)
async def test_bad_prompt_logprobs_is_a_400_naming_it(server, route, extra, fragment):
    base = {"prompt": "hello"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hello"}]}
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        response = await client.post(route, json={**base, **extra})
    assert_error(response, 400, fragment=fragment, param="prompt_logprobs")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"prompt": "hello", "max_tokens": 0}, "0 is only for echo"),
        ({"prompt": "hello", "max_tokens": 0, "logprobs": 2}, "0 is only for echo"),
        ({"prompt": "hello", "max_tokens": -1, "echo": True}, "at least 1 (or 0 with echo)"),
    ],
)
async def test_max_tokens_zero_without_echo_is_a_400_naming_it(server, body, fragment):
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        response = await client.post("/v1/completions", json=body)
    assert_error(response, 400, fragment=fragment, param="max_tokens")
