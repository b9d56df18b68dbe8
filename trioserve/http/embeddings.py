"""`POST /v1/embeddings`: OpenAI's embeddings route over the same engine.

    {"input": "text" | ["text", ...] | [token ids] | [[token ids], ...],
     "model"?, "encoding_format"?: "float" | "base64", "dimensions"?, "user"?}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
        "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N}}

Each input is one embedding request in the engine (`Engine.embed`): a
prompt prefilled through the scheduler like any other, sharing steps with
generation, whose result is its pooled, L2-normalised final hidden state
(--embedding-pooling; docs/embeddings.md). The body is parsed as strictly
as the other routes' (a converter from http/structuring.py, every
problem a 400 naming its JSON path). Token ids and lengths are checked
against the model before anything is queued.

A request keeps at most WINDOW = min(--max-num-seqs, --max-queue) of its
inputs in the engine at once, submitting the next as one finishes, so a
2048-input request never fills the queue by itself. A refusal or failure of
any input ends the whole request with that error (the others are
cancelled). A client that leaves cancels the handler; every input still
in the engine is cancelled with it and its KV blocks are freed within one
step. /v1/rerank and /v1/score (http/rerank.py) use the same parsing
pieces, tokenization, window and `embed_all`."""

from __future__ import annotations

import base64
import functools
import json
import secrets
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar

import attrs
import cattrs
import trio
from quart import Response

from trioserve.errors import RequestError, RequestTooLarge, TrioserveError
from trioserve.http.edge import ServerState, check_request_tokens, read_body
from trioserve.http.errors import HTTPError, error_response
from trioserve.http.schemas import token_ids
from trioserve.http.structuring import Invalid, field, got, is_int, strict_converter, structure_body
from trioserve.http.tools import off_loop
from trioserve.types import FinalEvent

T = TypeVar("T")

MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows
BIG_RESPONSE = 1 << 16  # floats beyond which the JSON body is written in a thread


@attrs.frozen
class Inputs:
    """The parsed `input`: its items (text, or token ids) in order, and
    whether it was one item rather than a list of them (which decides
    whether a problem is named `input` or `input[i]`; another route's texts
    go by their own field's name)."""

    items: tuple[str | tuple[int, ...], ...]
    single: bool
    name: str = "input"  # the field they came in (/v1/rerank's `query`, `documents`)

    def field(self, i: int) -> str:
        return self.name if self.single else f"{self.name}[{i}]"


def _parse_input(value: object, _: cattrs.Converter) -> Inputs:
    if isinstance(value, str):
        if not value:
            raise Invalid("must not be empty")
        return Inputs((value,), single=True)
    if not isinstance(value, list):
        raise Invalid(f"expected a string, a list of strings, a list of token ids or a list of lists of token ids, got {got(value)}")
    if not value:
        raise Invalid("must not be empty")
    if len(value) > MAX_INPUTS and not is_int(value[0]):
        raise Invalid(f"at most {MAX_INPUTS} inputs are allowed in one request, got {len(value)}")
    first = value[0]
    if is_int(first):  # one input as token ids
        return Inputs((token_ids(value, ""),), single=True)
    if isinstance(first, str):
        for i, text in enumerate(value):
            if not isinstance(text, str):
                raise Invalid(f"expected a string like input[0], got {got(text)}", at=f"[{i}]")
            if not text:
                raise Invalid("must not be empty", at=f"[{i}]")
        return Inputs(tuple(value), single=False)
    if isinstance(first, list):
        items = []
        for i, ids in enumerate(value):
            if not isinstance(ids, list):
                raise Invalid(f"expected a list of token ids like input[0], got {got(ids)}", at=f"[{i}]")
            items.append(token_ids(ids, f"[{i}]"))
        return Inputs(tuple(items), single=False)
    raise Invalid(f"expected a string, a token id or a list of token ids, got {got(first)}", at="[0]")


@attrs.frozen
class EmbeddingRequest:
    input: Inputs = field(parse=_parse_input)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # accepted only as the model's own size (checked with the engine)
    user: str | None = None  # accepted and ignored


@functools.cache
def _converter() -> cattrs.Converter:
    return strict_converter(EmbeddingRequest)


def parse_embedding_request(body: object) -> EmbeddingRequest:
    """The embeddings request in ``body`` (parsed JSON), or RequestError
    naming the first problem's JSON path."""
    return structure_body(_converter(), body, EmbeddingRequest)


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    """`dimensions` is accepted only as the model's own vector length:
    vectors are never shortened (the model was not trained for that)."""
    if dimensions is not None and dimensions != hidden_size:
        raise RequestError(
            f"dimensions: this model's embeddings have {hidden_size} dimensions and cannot be shortened; "
            f"send {hidden_size} or leave it out (got {dimensions})",
            field="dimensions",
        )


def prompt_ids(engine, inputs: Inputs, limit: int) -> list[list[int]]:
    """Each input's token ids: text tokenized as text (a special token's
    spelling is not its id), token ids checked against the vocabulary; no
    input may be longer than ``limit`` tokens. Blocking: run in a thread."""
    vocab = engine.tokenizer.vocab_size
    if engine.is_cross_encoder:
        raise RequestError(f"model: {engine.encoder_routes()}, not embeddings", field="model")
    out = []
    for i, item in enumerate(inputs.items):
        field = inputs.field(i)
        if isinstance(item, str):
            # An encoder's input as its tokenizer wraps one ([CLS] ... [SEP]); a decoder's as text.
            ids = engine.tokenizer.encode_input(item) if engine.is_encoder else engine.tokenizer.encode(item, special=False)
            if not ids:
                raise RequestError(f"{field}: the text has no tokens", field=field)
        else:
            ids = list(item)
            for j, token in enumerate(ids):
                if token >= vocab:
                    raise RequestError(f"{field}[{j}]: token id {token} is outside the vocabulary (0..{vocab - 1})", field=f"{field}[{j}]")
        if len(ids) > limit:
            raise RequestTooLarge(f"{field}: {len(ids)} tokens, more than the {limit} this server embeds in one input", field=field)
        out.append(ids)
    return out


def input_limit(engine) -> int:
    """The most tokens one input may have: the context, and what the KV pool holds."""
    stats = engine.statistics()
    return min(engine.max_model_len, stats.kv_blocks_total * stats.block_size)


def engine_window(engine) -> int:
    """How many of one request's inputs may be in ``engine`` at once:
    min(--max-num-seqs, --max-queue)."""
    return min(engine.config.max_num_seqs, engine.config.max_queue)


async def run_windowed(count: int, window: int, run_one: Callable[[int], Awaitable[T]]) -> list[T]:
    """``[await run_one(i) for i in range(count)]``, with at most ``window``
    calls under way at once. The first TrioserveError cancels the other
    calls and is raised; cancelled, every call under way is cancelled."""
    results: list[T | None] = [None] * count
    failures: list[TrioserveError] = []
    todo = iter(range(count))

    async def worker(nursery: trio.Nursery) -> None:
        for i in todo:
            try:
                results[i] = await run_one(i)
            except TrioserveError as exc:
                failures.append(exc)
                nursery.cancel_scope.cancel()
                return

    async with trio.open_nursery() as nursery:
        for _ in range(min(window, count)):
            nursery.start_soon(worker, nursery)
    if failures:
        raise failures[0]
    return results  # type: ignore[return-value]  # all set: no failure


def ended_badly(engine, final: FinalEvent, what: str) -> HTTPError:
    """The error for an engine request that ended without its result: 503
    when the engine died, else 500, with the engine's cause."""
    status = 503 if engine.statistics().dead else 500
    return HTTPError(status, final.error or f"the {what} ended with {final.finish_reason}", kind="server_error")


async def embed_all(engine, prompts: Sequence[list[int]], window: int, adapter: str | None = None) -> list[FinalEvent]:
    """Every prompt's FinalEvent, in order, with at most ``window`` of them
    in the engine at once (run with LoRA adapter ``adapter``, if any). The first refusal or failure cancels the rest and
    is raised; cancelled, every request still in the engine is cancelled."""
    base = f"embd-{secrets.token_hex(8)}"

    async def embed_one(i: int) -> FinalEvent:
        final = await engine.embed(prompts[i], request_id=f"{base}-{i}", adapter=adapter)
        if final.finish_reason != "stop" or final.embedding is None:
            raise ended_badly(engine, final, "embedding")
        return final

    return await run_windowed(len(prompts), window, embed_one)


def response_body(finals: Sequence[FinalEvent], encoding: str, model: str) -> str:
    """OpenAI's response, as JSON text. Written one vector at a time, so a
    request of many inputs never holds a second copy of all its vectors."""
    items = []
    for i, final in enumerate(finals):
        vector = final.embedding
        if encoding == "base64":
            value: object = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        else:
            value = vector
        items.append(json.dumps({"object": "embedding", "index": i, "embedding": value}))
    tokens = sum(f.usage.prompt_tokens for f in finals)
    tail = json.dumps({"model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    return '{"object": "list", "data": [' + ", ".join(items) + "], " + tail[1:]


def add_embedding_routes(app, state: ServerState) -> None:
    """Register POST /v1/embeddings on ``app``."""

    @app.route("/v1/embeddings", methods=["POST"])
    async def embeddings() -> Response:
        try:
            req = await off_loop(parse_embedding_request, await read_body(state))
            model = state.route(req.model)
            engine = model.engine
            check_dimensions(req.dimensions, engine.hidden_size)
            prompts = await off_loop(prompt_ids, engine, req.input, input_limit(engine))
            check_request_tokens(state, "input", prompts)
            finals = await embed_all(engine, prompts, engine_window(engine), model.adapter_key)
            if len(finals) * engine.hidden_size > BIG_RESPONSE:
                text = await off_loop(response_body, finals, req.encoding_format, model.name)
            else:
                text = response_body(finals, req.encoding_format, model.name)
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return error_response(exc)
        return Response(text, status=200, mimetype="application/json")
