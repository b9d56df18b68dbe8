"""A generated token that ends the text has its logprobs entry (issue #48,
part 1). lm-evaluation-harness scores a choice with `echo`, `logprobs` 1 and
`max_tokens` 1, and reads `token_logprobs[ctxlen:-1]`: it takes the last
entry to be the generated token. When that token is the end-of-turn token
it must be there all the same, as in vLLM: an entry in `tokens`,
`token_logprobs`, `top_logprobs` and `text_offset`, buffered and streamed,
with and without echo, for every choice, and on chat in `logprobs.content`.

The prompts come from the tiny random model itself: a batch of one-token
prompts is generated from with `ignore_eos` (greedy, one token), and those
whose greedy token is the end-of-turn token are the ones the test uses. The
logprob each entry must carry is the one that generation gave that token."""

from __future__ import annotations

import httpx
import pytest

from tests.http.conftest import read_sse
from tests.tiny_tokenizer import EOS_ID
from trioserve.models.checkpoint import load_tokenizer

TIMEOUT = 120
TOP = 3


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    return load_tokenizer(tiny_checkpoints["gguf_f32"])


def text_of(tokenizer, token: int) -> str:
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


async def post(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def ending_prompts(client: httpx.AsyncClient, tokenizer) -> list[tuple[list[int], float, dict]]:
    """One- and two-token prompts whose greedy next token is the end-of-turn
    token, with the logprob and alternatives generation gives it there."""
    end = text_of(tokenizer, EOS_ID)
    found = []
    candidates = [[t] for t in range(3, tokenizer.vocab_size)]
    candidates += [[a, b] for a in range(3, 40) for b in range(3, tokenizer.vocab_size, 7)]
    for at in range(0, len(candidates), 120):
        batch = candidates[at : at + 120]
        body = {"prompt": batch, "max_tokens": 1, "temperature": 0, "logprobs": TOP, "ignore_eos": True}
        for choice in (await post(client, "/v1/completions", body))["choices"]:
            lp = choice["logprobs"]
            if lp["tokens"] == [end]:
                found.append((batch[choice["index"]], lp["token_logprobs"][0], lp["top_logprobs"][0]))
        if len(found) >= 2:
            return found
    assert found, "no one- or two-token prompt of the tiny model has the end-of-turn token as its greedy continuation"
    return found


@pytest.fixture
async def ending(server, tokenizer):
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        return server, await ending_prompts(client, tokenizer)


def assert_parallel(lp: dict, count: int) -> None:
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == count, lp


@pytest.mark.parametrize("max_tokens", [1, 3])
async def test_echo_lists_the_prompt_and_the_end_token_that_was_generated(ending, tokenizer, max_tokens):
    url, prompts = ending
    ids, logprob, top = prompts[0]
    end = text_of(tokenizer, EOS_ID)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": TOP, "echo": True, "seed": 1234}
        answer = await post(client, "/v1/completions", body)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 1
    prompt_text = "".join(text_of(tokenizer, t) for t in ids)
    assert choice["text"] == prompt_text  # the end token's text is not output
    lp = choice["logprobs"]
    assert_parallel(lp, len(ids) + 1)
    assert lp["tokens"] == [text_of(tokenizer, t) for t in ids] + [end]
    assert lp["token_logprobs"][-1] == logprob  # the logprob generation gave it, bit for bit
    assert lp["top_logprobs"][-1] == top
    assert lp["text_offset"][-1] == len(prompt_text)
    # What lm-eval reads: the continuation's scores are token_logprobs[ctxlen:-1], the generated token last.
    assert lp["token_logprobs"][len(ids) - 1 : -1] == lp["token_logprobs"][-2:-1]


async def test_streamed_echo_and_plain_completions_list_the_end_token_too(ending, tokenizer):
    url, prompts = ending
    (ids, logprob, top), (ids2, logprob2, top2) = prompts[0], prompts[-1]
    end = text_of(tokenizer, EOS_ID)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        base = {"max_tokens": 3, "temperature": 0, "logprobs": TOP}
        buffered = await post(client, "/v1/completions", {**base, "prompt": [ids, ids2], "echo": True})
        async with client.stream("POST", "/v1/completions", json={**base, "prompt": [ids, ids2], "echo": True, "stream": True}) as response:
            sse = await read_sse(response)
        plain = await post(client, "/v1/completions", {**base, "prompt": ids2})
        async with client.stream("POST", "/v1/completions", json={**base, "prompt": ids2, "stream": True}) as response:
            plain_sse = await read_sse(response)
    for index, (prompt, want, want_top) in enumerate(((ids, logprob, top), (ids2, logprob2, top2))):
        streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        chunks = sse.choice_chunks(index)
        for chunk in chunks:
            for key in streamed:
                streamed[key] += (chunk["logprobs"] or {}).get(key, [])
        assert chunks[-1]["finish_reason"] == "stop"
        whole = buffered["choices"][index]["logprobs"]
        assert streamed == whole  # streamed entries are the buffered ones, the end token's last
        assert_parallel(whole, len(prompt) + 1)
        assert (whole["tokens"][-1], whole["token_logprobs"][-1], whole["top_logprobs"][-1]) == (end, want, want_top)
    lp = plain["choices"][0]["logprobs"]
    assert plain["choices"][0]["text"] == "" and plain["usage"]["completion_tokens"] == 1
    assert lp == {"tokens": [end], "token_logprobs": [logprob2], "top_logprobs": [top2], "text_offset": [0]}
    (last,) = [c for c in plain_sse.choice_chunks(0) if c["logprobs"]]
    assert last["finish_reason"] == "stop" and last["logprobs"] == lp


async def test_every_choice_of_n_lists_its_end_token(ending, tokenizer):
    url, prompts = ending
    ids, logprob, _ = prompts[0]
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "n": 3}
        answer = await post(client, "/v1/completions", body)
    assert len(answer["choices"]) == 3
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "stop"
        assert_parallel(choice["logprobs"], len(ids) + 1)
        assert choice["logprobs"]["token_logprobs"][-1] == logprob


async def test_chat_lists_the_stop_token_that_ended_the_reply(server, tokenizer):
    """Chat: the reply's first greedy token, made a stop id by the request,
    ends the reply at once; its entry is in logprobs.content all the same,
    with the logprob generating it gave, buffered and streamed."""
    messages = [{"role": "user", "content": "Say something."}]
    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        base = {"messages": messages, "temperature": 0, "logprobs": True, "top_logprobs": TOP}
        free = await post(client, "/v1/chat/completions", {**base, "max_tokens": 1, "ignore_eos": True})
        (entry,) = free["choices"][0]["logprobs"]["content"]
        first = [t for t in range(tokenizer.vocab_size) if list(tokenizer.token_bytes(t)) == entry["bytes"]]  # the ids of its bytes
        assert first, entry
        stopped = await post(client, "/v1/chat/completions", {**base, "max_tokens": 4, "stop_token_ids": first})
        async with client.stream("POST", "/v1/chat/completions", json={**base, "max_tokens": 4, "stop_token_ids": first, "stream": True}) as response:
            sse = await read_sse(response)
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert stopped["usage"]["completion_tokens"] == 1
    assert choice["logprobs"]["content"] == [entry]
    streamed = [e for c in sse.choice_chunks(0) if c["logprobs"] for e in c["logprobs"]["content"]]
    assert streamed == [entry]


async def test_bad_stop_token_ids_are_refused_naming_the_field(server, tokenizer):
    from tests.http.conftest import assert_error

    async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            outside = await client.post(path, json={**body, "max_tokens": 2, "stop_token_ids": [tokenizer.vocab_size]})
            assert_error(outside, 400, fragment=f"{tokenizer.vocab_size} is not a token id (the vocabulary has {tokenizer.vocab_size})", param="stop_token_ids")
            many = await client.post(path, json={**body, "max_tokens": 2, "stop_token_ids": [5] * 65})
            assert_error(many, 400, fragment="at most 64 token ids are allowed, got 65", param="stop_token_ids")
            typed = await client.post(path, json={**body, "max_tokens": 2, "stop_token_ids": ["5"]})
            assert typed.status_code == 400 and "stop_token_ids" in typed.text, typed.text
