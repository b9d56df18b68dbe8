"""--max-request-tokens over a real server on the tiny model (issue 30,
item 9): every route that gives the engine work counts all the prompt
tokens of the request together, once they are tokenized, and refuses a
request over the budget with a 400 that names its field and gives the
count and the limit, before the engine runs any of it.

What is counted: every prompt of /v1/completions times n; a chat, messages,
responses or session turn's rendered prompt (times n on chat); all inputs
of /v1/embeddings, however small each; the query and documents of
/v1/rerank and /v1/score as the method scores them. A request exactly at
the budget runs. Rendered prompts are measured with /v1/messages/count_tokens,
which renders one user message as chat does and is itself never refused
(it gives the engine nothing to do)."""

from __future__ import annotations

import re

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import assert_error, make_settings, metrics, start_server
from tests.http.test_messages import assert_anthropic_error
from tests.http.test_rerank import yes_no_model  # noqa: F401 - the fixture, for the yes-no server
from trioserve import cli
from trioserve.config import ServerSettings, settings_from_env
from trioserve.options import option

BUDGET = 120
TIMEOUT = 30.0
LONG = "hello " * 40  # one user message of 176 tokens in the tiny tokenizer's chat template: over BUDGET, within the context


def over(field: str, total: int, detail: str = "") -> str:
    """The refusal's message for ``total`` tokens in all."""
    return f"{field}: this request has {total} prompt tokens in all{detail}, more than --max-request-tokens {BUDGET}"


def refused(response: httpx.Response, field: str, total: int, detail: str = "") -> None:
    assert_error(response, 400, fragment=over(field, total, detail), param=field, code="too_many_tokens")


@pytest.fixture
async def client(nursery, tiny_gguf):
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), max_request_tokens=BUDGET))
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        yield client


async def rendered(client: httpx.AsyncClient, content: str) -> int:
    """The prompt tokens of one user message as chat renders it."""
    response = await client.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": content}]})
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


async def engine_work(client: httpx.AsyncClient) -> tuple[int, int]:
    """(steps run, prompt tokens prefilled): what a refused request must not change."""
    stats = await metrics(client)
    return stats["steps"], stats["prompt_tokens"]


async def test_completions_count_every_prompt_times_n(client):
    ids = list(range(10, 70))  # 60 token ids
    with trio.fail_after(60):
        before = await engine_work(client)
        refused(await client.post("/v1/completions", json={"prompt": [ids, ids + [70]], "max_tokens": 1}), "prompt", 121)
        refused(await client.post("/v1/completions", json={"prompt": ids[:40], "n": 4, "max_tokens": 1}), "prompt", 160, " (40 x n 4)")
        # three prompts of 21 tokens, two choices each: 126
        refused(await client.post("/v1/completions", json={"prompt": [ids[:21]] * 3, "n": 2, "max_tokens": 1}), "prompt", 126, " (63 x n 2)")
        assert await engine_work(client) == before  # refused before the engine saw any of them

        at_budget = await client.post("/v1/completions", json={"prompt": [ids, ids], "max_tokens": 1})
        assert at_budget.status_code == 200, at_budget.text
        assert at_budget.json()["usage"]["prompt_tokens"] == 120
        times_n = await client.post("/v1/completions", json={"prompt": ids[:40], "n": 3, "max_tokens": 1})
        assert times_n.status_code == 200, times_n.text
        assert len(times_n.json()["choices"]) == 3


async def test_chat_counts_the_rendered_prompt_times_n(client):
    with trio.fail_after(60):
        each = await rendered(client, "hello")
        fits = BUDGET // each
        assert 1 < fits < 16, each  # n may be at most 16
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
        refused(await client.post("/v1/chat/completions", json={**body, "n": fits + 1}), "messages", each * (fits + 1), f" ({each} x n {fits + 1})")
        long = await rendered(client, LONG)
        refused(await client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": LONG}]}), "messages", long)

        under = await client.post("/v1/chat/completions", json={**body, "n": fits})
        assert under.status_code == 200, under.text
        assert len(under.json()["choices"]) == fits and under.json()["usage"]["prompt_tokens"] == each


async def test_messages_count_the_rendered_prompt(client):
    headers = {"anthropic-version": "2023-06-01"}
    with trio.fail_after(60):
        long = await rendered(client, LONG)
        response = await client.post("/v1/messages", headers=headers, json={"messages": [{"role": "user", "content": LONG}], "max_tokens": 1})
        assert_anthropic_error(response, 400, "invalid_request_error", over("messages", long))

        fine = await client.post("/v1/messages", headers=headers, json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1})
        assert fine.status_code == 200, fine.text
        assert fine.json()["usage"]["input_tokens"] + fine.json()["usage"]["cache_read_input_tokens"] == await rendered(client, "hello")


async def test_responses_count_the_rendered_input(client):
    with trio.fail_after(60):
        long = await rendered(client, LONG)
        refused(await client.post("/v1/responses", json={"input": LONG, "max_output_tokens": 1}), "input", long)

        first = await client.post("/v1/responses", json={"input": "hello", "max_output_tokens": 1})
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["input_tokens"] == await rendered(client, "hello")
        # A chain brings its earlier turns: they count as the prompt they render into.
        chained = await client.post("/v1/responses", json={"input": LONG[:60], "previous_response_id": first.json()["id"], "max_output_tokens": 1})
        assert chained.status_code == 200, chained.text
        total = chained.json()["usage"]["input_tokens"]
        assert total <= BUDGET
        # (A new input short enough that the whole chain stays within the
        # model's context: past it, the context's own error answers.)
        again = await client.post("/v1/responses", json={"input": LONG[:120], "previous_response_id": chained.json()["id"], "max_output_tokens": 1})
        message = assert_error(again, 400, fragment="input: this request has ", param="input", code="too_many_tokens")["message"]
        counted = int(re.search(r"has (\d+) prompt tokens", message).group(1))
        assert counted > await rendered(client, LONG[:120]), message  # the chain's earlier turns come on top of the new input


async def test_a_session_turn_counts_its_whole_conversation(client):
    with trio.fail_after(60):
        made = await client.post("/v1/sessions", json={"max_tokens": 2, "ignore_eos": True, "temperature": 0})
        assert made.status_code == 200, made.text
        sid = made.json()["id"]
        long = await rendered(client, LONG)  # a first turn's prompt is its one message rendered
        refused(await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": LONG}]}), "messages", long)

        fine = await client.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "hello"}]})
        assert fine.status_code == 200, fine.text
        assert fine.json()["usage"]["prompt_tokens"] == await rendered(client, "hello")
        session = (await client.get(f"/v1/sessions/{sid}")).json()
        assert session["turns"] == 1 and [m["content"] for m in session["messages"]][0] == "hello"  # the refused turn left nothing


async def test_embeddings_count_all_inputs_together(client):
    with trio.fail_after(60):
        before = await engine_work(client)
        refused(await client.post("/v1/embeddings", json={"input": [[5]] * 121}), "input", 121)  # each input one token
        refused(await client.post("/v1/embeddings", json={"input": [list(range(10, 40))] * 4 + [[7]]}), "input", 121)
        refused(await client.post("/v1/embeddings", json={"input": list(range(10, 131))}), "input", 121)  # one input of 121 ids
        assert await engine_work(client) == before  # no input of them reached the engine

        fine = await client.post("/v1/embeddings", json={"input": [list(range(10, 40))] * 4})
        assert fine.status_code == 200, fine.text
        assert fine.json()["usage"]["prompt_tokens"] == 120 and len(fine.json()["data"]) == 4


async def embedding_sizes(client: httpx.AsyncClient, path: str, body: dict, documents: str) -> tuple[int, int]:
    """(tokens of the request with one document, tokens each further copy
    of that document adds), read from two requests' usage."""
    one = await client.post(path, json={**body, documents: [DOC]})
    two = await client.post(path, json={**body, documents: [DOC, DOC]})
    assert one.status_code == two.status_code == 200, (one.text, two.text)
    first, second = one.json()["usage"]["total_tokens"], two.json()["usage"]["total_tokens"]
    return first, second - first


DOC = "a cat sat on the mat"


@pytest.mark.parametrize(("path", "query", "documents"), [("/v1/rerank", "query", "documents"), ("/v1/score", "text_1", "text_2")])
async def test_rerank_and_score_count_the_query_and_every_document(client, path, query, documents):
    body = {query: "where is the cat"}
    with trio.fail_after(60):
        base, each = await embedding_sizes(client, path, body, documents)
        fits = 1 + (BUDGET - base) // each  # documents within the budget: the query once, each document once
        refused(await client.post(path, json={**body, documents: [DOC] * (fits + 1)}), documents, base + fits * each)

        under = await client.post(path, json={**body, documents: [DOC] * fits})
        assert under.status_code == 200, under.text
        assert under.json()["usage"]["total_tokens"] == base + (fits - 1) * each <= BUDGET


async def test_yes_no_rerank_counts_every_judged_prompt(nursery, yes_no_model):  # noqa: F811 - the imported fixture
    budget = 600  # room for a few judge prompts (each holds the instruction, the query and one document)
    settings = attrs.evolve(make_settings(yes_no_model), rerank_method="yes-no", max_request_tokens=budget)
    url = await start_server(nursery, settings)
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            one = await client.post("/v1/rerank", json={"query": "where is the cat", "documents": [DOC]})
            assert one.status_code == 200, one.text
            each = one.json()["usage"]["total_tokens"]  # the query comes again in every pair's prompt
            fits = budget // each
            assert fits > 1, each
            response = await client.post("/v1/rerank", json={"query": "where is the cat", "documents": [DOC] * (fits + 1)})
            assert_error(
                response, 400, param="documents", code="too_many_tokens",
                fragment=f"documents: this request has {each * (fits + 1)} prompt tokens in all, more than --max-request-tokens {budget}",
            )  # fmt: skip
            under = await client.post("/v1/rerank", json={"query": "where is the cat", "documents": [DOC] * fits})
            assert under.status_code == 200, under.text


def test_the_budget_is_a_server_setting_with_its_flag_and_variable():
    opt = option("max_request_tokens")
    assert (opt.flag, opt.env, opt.default) == ("--max-request-tokens", "TRIOSERVE_MAX_REQUEST_TOKENS", 131072)
    assert ServerSettings().max_request_tokens == 131072
    assert settings_from_env({"TRIOSERVE_MAX_REQUEST_TOKENS": "4096"}).max_request_tokens == 4096
    assert cli.serve_settings(cli.build_parser().parse_args(["serve", "--max-request-tokens", "8192"]), {}).max_request_tokens == 8192
    with pytest.raises(SystemExit):  # argparse: "must be a positive integer, got 0"
        cli.build_parser().parse_args(["serve", "--max-request-tokens", "0"])
    with pytest.raises(ValueError, match="TRIOSERVE_MAX_REQUEST_TOKENS"):
        settings_from_env({"TRIOSERVE_MAX_REQUEST_TOKENS": "lots"})
    with pytest.raises(ValueError, match="max_request_tokens must be positive, got 0"):
        ServerSettings(max_request_tokens=0)
