"""`POST /v1/rerank` and `POST /v1/score`: how well texts match a query,
in the shapes vLLM and llama.cpp's server take (Cohere's and Jina's for
rerank, vLLM's for score; docs/api.md, "Rerank and score").

    /v1/rerank {"query": "...", "documents": ["...", {"text": "..."}, ...],
                "model"?, "top_n"?, "return_documents"?: true}
    -> {"id", "model", "results": [{"index", "relevance_score", "document"?: {"text"}}, ...],
        "usage": {"total_tokens"}}, best first (equal scores: lower index first)

    /v1/score {"text_1": "..." | ["...", ...], "text_2": "..." | ["...", ...], "model"?}
    -> {"id", "object": "list", "created", "model",
        "data": [{"index", "object": "score", "score"}, ...], "usage"}

Both come down to a list of (query, document) pairs (`Pairs`), scored by
the server's --rerank-method:

- ``embedding``: every distinct text of the request is one embedding
  request (`embed_all`, the same scheduler and window as /v1/embeddings);
  a pair's score is the cosine of its two vectors. The engine's vectors
  have length 1, so that is their dot product, taken here exactly: each
  float32 product is exact in float64 and `math.fsum` rounds the sum once,
  so a score depends on the two vectors alone, never on the order of a sum.
- ``yes-no``: each pair is one generation of a single greedy token over a
  prompt that asks, in the model's chat template, whether the document
  meets the query; the score is P(yes) / (P(yes) + P(no)) from that
  token's top logprobs (`yes_probability`).

The engine is batch invariant by default (--batch-invariant), so either
way a pair's score is the same alone, beside other documents or beside
other requests. Bodies are parsed as strictly as every other route's
(http/structuring.py): a problem is a 400 naming its JSON path."""

from __future__ import annotations

import functools
import json
import math
import secrets
from collections.abc import Sequence

import attrs
import cattrs
import numpy as np
from quart import Response

from trioserve.errors import ChatTemplateError, RequestError, RequestTooLarge
from trioserve.http import openai
from trioserve.http.edge import ServerState, check_request_tokens, read_body
from trioserve.http.embeddings import BIG_RESPONSE, Inputs, embed_all, ended_badly, engine_window, input_limit, prompt_ids, run_windowed
from trioserve.http.errors import error_response
from trioserve.http.registry import Model
from trioserve.http.structuring import Invalid, field, got, strict_converter, structure_body
from trioserve.http.tools import off_loop, render_prompt_ids
from trioserve.models.chat_template import TemplateOverrun
from trioserve.types import MAX_TOP_LOGPROBS, FinalEvent, GenerateRequest, SamplingParams, TokenEvent

MAX_DOCUMENTS = 1024  # documents in one /v1/rerank request; texts on either side of one /v1/score request

# The yes-no method's question. The query comes before the document, so the
# prompts of one request share their prefix (the prefix cache keeps it).
JUDGE_INSTRUCTION = 'Decide whether the Document meets the needs of the Query. Reply with one word only: "yes" or "no".'
YES_WORDS = ("yes", "Yes")  # the spellings counted as each answer (those that are one token)
NO_WORDS = ("no", "No")
# One greedy token whatever it is (an end-of-text token too: ignore_eos),
# with as many alternatives as the engine lists.
JUDGE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, seed=0, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS, ignore_eos=True)

# --- parsing


def _text(value: object, at: str = "") -> str:
    if not isinstance(value, str):
        raise Invalid(f"expected a string, got {got(value)}", at=at)
    if not value:
        raise Invalid("must not be empty", at=at)
    return value


def _one_text(name: str):
    def parse(value: object, _: cattrs.Converter) -> Inputs:
        return Inputs((_text(value),), single=True, name=name)

    return parse


def _bounded_list(value: object, expected: str, what: str) -> list:
    """``value`` as a non-empty list of at most MAX_DOCUMENTS ``what``;
    else Invalid saying what was ``expected``."""
    if not isinstance(value, list):
        raise Invalid(f"expected {expected}, got {got(value)}")
    if not value:
        raise Invalid("must not be empty")
    if len(value) > MAX_DOCUMENTS:
        raise Invalid(f"at most {MAX_DOCUMENTS} {what} are allowed in one request, got {len(value)}")
    return value


def _text_or_texts(name: str):
    """A string (one text) or a non-empty list of at most MAX_DOCUMENTS strings."""

    def parse(value: object, _: cattrs.Converter) -> Inputs:
        if isinstance(value, str):
            return Inputs((_text(value),), single=True, name=name)
        value = _bounded_list(value, "a string or a list of strings", "texts")
        return Inputs(tuple(_text(item, f"[{i}]") for i, item in enumerate(value)), single=False, name=name)

    return parse


def _documents(value: object, _: cattrs.Converter) -> Inputs:
    """A non-empty list of at most MAX_DOCUMENTS documents, each a string or
    an object whose `text` is one (its other keys are ignored)."""
    value = _bounded_list(value, "a list of strings or of objects with text", "documents")
    texts = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            texts.append(_text(item, f"[{i}]"))
        elif isinstance(item, dict) and "text" in item:
            texts.append(_text(item["text"], f"[{i}].text"))
        else:
            raise Invalid(f"expected a string or an object with text, got {got(item)}", at=f"[{i}]")
    return Inputs(tuple(texts), single=False, name="documents")


def _at_least_one(value: int) -> None:
    if value < 1:
        raise Invalid("must be at least 1")


@attrs.frozen
class RerankRequest:
    query: Inputs = field(parse=_one_text("query"))
    documents: Inputs = field(parse=_documents)
    model: str | None = None
    top_n: int | None = field(None, check=_at_least_one)  # None: every document
    return_documents: bool = True


@attrs.frozen
class ScoreRequest:
    text_1: Inputs = field(parse=_text_or_texts("text_1"))
    text_2: Inputs = field(parse=_text_or_texts("text_2"))
    model: str | None = None


@functools.cache
def _converter() -> cattrs.Converter:
    return strict_converter(RerankRequest, ScoreRequest)


def _parse(body: object, cls: type):
    return structure_body(_converter(), body, cls)


def parse_rerank_request(body: object) -> RerankRequest:
    """The rerank request in ``body`` (parsed JSON), or RequestError naming
    the first problem's JSON path."""
    return _parse(body, RerankRequest)


def parse_score_request(body: object) -> ScoreRequest:
    """The score request in ``body``: text_1 one text (or a list of one)
    against every text_2, or as many text_1 as text_2, paired in order."""
    req = _parse(body, ScoreRequest)
    left, right = len(req.text_1.items), len(req.text_2.items)
    if left != 1 and left != right:
        raise RequestError(
            f"text_2: {right} texts for {left} in text_1; send one text_1 to score against every text_2, or as many of each (paired in order)",
            field="text_2",
        )
    return req


# --- scoring


@attrs.frozen
class Pairs:
    """The (query, document) pairs of a request: document i with query i,
    or with the one query when ``left`` holds one."""

    left: Inputs
    right: Inputs

    def __len__(self) -> int:
        return len(self.right.items)

    def left_index(self, i: int) -> int:
        return 0 if len(self.left.items) == 1 else i


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The dot product of two unit vectors (float32 values held as float64),
    exactly rounded: each product is exact in float64 and `math.fsum` sums
    them without rounding on the way. Kept within [-1, 1]."""
    return max(-1.0, min(1.0, math.fsum((a * b).tolist())))


async def _embedding_scores(state: ServerState, engine, pairs: Pairs, adapter: str | None) -> tuple[list[float], int]:
    limit = input_limit(engine)
    left, right = await off_loop(lambda: (prompt_ids(engine, pairs.left, limit), prompt_ids(engine, pairs.right, limit)))
    check_request_tokens(state, pairs.right.name, left + right)  # every text once, as it is embedded
    finals = await embed_all(engine, left + right, engine_window(engine), adapter)

    def scores() -> list[float]:
        vectors = [np.asarray(final.embedding, dtype=np.float64) for final in finals]
        return [cosine(vectors[pairs.left_index(i)], vectors[len(left) + i]) for i in range(len(pairs))]

    big = (len(left) + len(right)) * engine.hidden_size > BIG_RESPONSE
    return (await off_loop(scores) if big else scores()), sum(final.usage.prompt_tokens for final in finals)


@attrs.frozen
class AnswerIds:
    """The token ids of the yes-no method's two answers, every spelling of
    each that is one token."""

    yes: tuple[int, ...]
    no: tuple[int, ...]


def answer_ids(tokenizer, model_name: str) -> AnswerIds:
    """The answers' ids in ``tokenizer``, or a RequestError (a 400 naming
    `model`) when either answer has no spelling that is one token: its
    probability could not be read from one step's logprobs."""

    def single(words: Sequence[str]) -> tuple[int, ...]:
        found = [tokenizer.encode(word, add_bos=False, special=False) for word in words]
        return tuple(dict.fromkeys(ids[0] for ids in found if len(ids) == 1))

    yes, no = single(YES_WORDS), single(NO_WORDS)
    split = [f'"{word}"' for word, ids in (("yes", yes), ("no", no)) if not ids]
    if split:
        raise RequestError(
            f"model: {model_name!r} cannot be scored with --rerank-method yes-no: its tokenizer has no single token for "
            f"{' nor for '.join(split)}, so the answer's probability cannot be read from one token's logprobs; "
            "serve it with --rerank-method embedding",
            field="model",
        )
    return AnswerIds(yes, no)


def judge_prompt_ids(tokenizer, template, query: str, document: str) -> list[int]:
    """The yes-no method's prompt for one pair, through the model's chat
    template: the instruction as the system message and the pair as the
    user's; for a template that refuses a system message, the instruction
    opens the user's message instead. Blocking."""
    user = f"<Query>: {query}\n<Document>: {document}"
    try:
        return render_prompt_ids(tokenizer, template, [{"role": "system", "content": JUDGE_INSTRUCTION}, {"role": "user", "content": user}])
    except TemplateOverrun:
        raise  # past its budget: another shape would only cost the budget again
    except ChatTemplateError:
        return render_prompt_ids(tokenizer, template, [{"role": "user", "content": f"{JUDGE_INSTRUCTION}\n\n{user}"}])


def file_prompt_ids(tokenizer, template: str, query: str, document: str) -> list[int]:
    """The prompt for one pair through the reranking prompt the model file
    carries (a GGUF's `tokenizer.chat_template.rerank`, as llama.cpp's
    converter writes Qwen3-Reranker's): the template's special-token text
    read as its ids, the query and the document as plain text, tokenized
    together with the text around them (`Tokenizer.encode_rendered`)."""
    return tokenizer.encode_rendered(template, {"{query}": query, "{document}": document}, add_bos=False)


def _judge_setup(engine, model: Model, pairs: Pairs) -> tuple[AnswerIds, list[list[int]]]:
    """The answers' ids and every pair's prompt, each short enough to
    leave room for the one answer token. Blocking: run in a thread."""
    answers = answer_ids(engine.tokenizer, model.name)
    limit = input_limit(engine) - 1
    own = engine.model_config.rerank_template if engine.model_config is not None else None
    prompts = []
    for i in range(len(pairs)):
        query = pairs.left.items[pairs.left_index(i)]
        if own is not None:
            ids = file_prompt_ids(engine.tokenizer, own, query, pairs.right.items[i])
        else:
            ids = judge_prompt_ids(engine.tokenizer, model.template, query, pairs.right.items[i])
        if len(ids) > limit:
            name = pairs.right.field(i)
            raise RequestTooLarge(
                f"{name}: the relevance prompt for this document and its query has {len(ids)} tokens, more than the {limit} this server judges at once",
                field=name,
            )
        prompts.append(ids)
    return answers, prompts


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(math.fsum(math.exp(v - top) for v in values))


def yes_probability(top_logprobs: Sequence[tuple[int, float]], answers: AnswerIds) -> float:
    """P(yes) / (P(yes) + P(no)) from one step's top logprobs ((id, logprob),
    best first), each answer's probability summed over its spellings.

    An answer none of whose spellings is listed is less likely than every
    listed token, so it is taken at the last listed logprob: the most it can
    be. The score is then a bound (at least the true one when "no" is
    missing, at most it when "yes" is), and documents keep their order by
    how likely the listed answer is. When neither is listed both get that
    value, and the score is 0.5: no evidence either way."""
    listed = dict(top_logprobs)
    floor = min(listed.values())

    def answer(ids: tuple[int, ...]) -> float:
        found = [listed[i] for i in ids if i in listed]
        return _logsumexp(found) if found else floor

    gap = answer(answers.no) - answer(answers.yes)  # the score is 1 / (1 + e^gap)
    if math.isnan(gap):  # both impossible
        return 0.5
    if gap >= 0:
        e = math.exp(-gap)
        return e / (1.0 + e)
    return 1.0 / (1.0 + math.exp(gap))


async def _judge(engine, prompt: list[int], request_id: str, answers: AnswerIds, adapter: str | None) -> tuple[float, int]:
    """One pair's yes-no score and its prompt's token count."""
    top: tuple[tuple[int, float], ...] = ()
    final = None
    async with engine.open_generation(GenerateRequest(prompt, JUDGE_PARAMS, request_id=request_id, adapter=adapter)) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                top = event.top_logprobs
            else:
                final = event
    assert isinstance(final, FinalEvent), final
    if final.finish_reason not in ("length", "stop") or not top:
        raise ended_badly(engine, final, "relevance judgement")
    return yes_probability(top, answers), final.usage.prompt_tokens


async def _yes_no_scores(state: ServerState, engine, model: Model, pairs: Pairs) -> tuple[list[float], int]:
    answers, prompts = await off_loop(_judge_setup, engine, model, pairs)
    check_request_tokens(state, pairs.right.name, prompts)  # the query again in every pair's prompt
    base = f"rank-{secrets.token_hex(8)}"
    judged = await run_windowed(len(prompts), engine_window(engine), lambda i: _judge(engine, prompts[i], f"{base}-{i}", answers, model.adapter_key))
    return [score for score, _ in judged], sum(tokens for _, tokens in judged)


def rerank_method(chosen: str, engine) -> str:
    """--rerank-method for ``engine``'s model: a cross-encoder scores with
    its relevance head whatever was chosen (it can do nothing else); `auto`
    is yes-no for a file that says it is a reranker (Engine.is_reranker),
    else embedding."""
    if engine.is_cross_encoder:
        return "classifier"
    if chosen != "auto":
        return chosen
    return "yes-no" if engine.is_reranker else "embedding"


def _pair_ids(engine, pairs: Pairs) -> list[list[int]]:
    """Each pair as its cross-encoder's tokenizer joins two texts, none
    longer than one input may be. Blocking: run in a thread."""
    limit = input_limit(engine)
    out = []
    for i in range(len(pairs)):
        ids = engine.tokenizer.encode_pair(pairs.left.items[pairs.left_index(i)], pairs.right.items[i])
        if len(ids) > limit:
            name = pairs.right.field(i)
            raise RequestTooLarge(f"{name}: this document and its query make {len(ids)} tokens, more than the {limit} this server scores at once", field=name)
        out.append(ids)
    return out


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


async def _classifier_scores(state: ServerState, engine, pairs: Pairs) -> tuple[list[float], int]:
    """A cross-encoder's scores: each pair through the model at once, its
    relevance output on the first token, as a probability (the sigmoid of
    the one logit, as sentence-transformers' CrossEncoder and vLLM give it)."""
    prompts = await off_loop(_pair_ids, engine, pairs)
    check_request_tokens(state, pairs.right.name, prompts)
    finals = await embed_all(engine, prompts, engine_window(engine), None)
    return [_sigmoid(final.embedding[0]) for final in finals], sum(final.usage.prompt_tokens for final in finals)


async def score_pairs(state: ServerState, model: Model, pairs: Pairs) -> tuple[list[float], int]:
    """Each pair's score, in order, and the prompt tokens it took, by the
    server's --rerank-method."""
    method = rerank_method(state.settings.rerank_method, model.engine)
    if method == "classifier":
        return await _classifier_scores(state, model.engine, pairs)
    if method == "yes-no":
        return await _yes_no_scores(state, model.engine, model, pairs)
    return await _embedding_scores(state, model.engine, pairs, model.adapter_key)


# --- answers


def rerank_body(req: RerankRequest, model: str, scores: Sequence[float], tokens: int) -> dict:
    """The rerank answer: the top_n documents (all by default), best first."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    results = []
    for i in order[: req.top_n]:
        item: dict[str, object] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": req.documents.items[i]}
        results.append(item)
    return {"id": openai.new_id("rerank"), "model": model, "results": results, "usage": {"total_tokens": tokens}}


def score_body(model: str, scores: Sequence[float], tokens: int) -> dict:
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
    return {
        "id": openai.new_id("score"), "object": "list", "created": openai.now(), "model": model, "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }  # fmt: skip


async def _json(body: dict, items: int) -> Response:
    text = await off_loop(json.dumps, body) if items > 64 else json.dumps(body)
    return Response(text, status=200, mimetype="application/json")


def add_rerank_routes(app, state: ServerState) -> None:
    """Register POST /v1/rerank and POST /v1/score on ``app``."""

    @app.route("/v1/rerank", methods=["POST"])
    async def rerank() -> Response:
        try:
            req = await off_loop(parse_rerank_request, await read_body(state))
            model = state.route(req.model)
            scores, tokens = await score_pairs(state, model, Pairs(req.query, req.documents))
            return await _json(rerank_body(req, model.name, scores, tokens), len(scores))
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return error_response(exc)

    @app.route("/v1/score", methods=["POST"])
    async def score() -> Response:
        try:
            req = await off_loop(parse_score_request, await read_body(state))
            model = state.route(req.model)
            scores, tokens = await score_pairs(state, model, Pairs(req.text_1, req.text_2))
            return await _json(score_body(model.name, scores, tokens), len(scores))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
