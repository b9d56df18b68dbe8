"""The tokenizer routes vLLM serves at the server's root: POST /tokenize,
POST /detokenize and GET /tokenizer_info, each for one model (``model`` in
the body, or the query string of /tokenizer_info; the default model when
absent), behind the API key like /v1.

lm-evaluation-harness finds them on its own (its "remote" tokenizer): with
them it counts a context's tokens the way the server does and needs no
Hugging Face tokenizer, so no hub.

/tokenize reads text exactly as /v1/completions reads a text prompt
(special-token text stays text unless --allow-special-in-prompt), and
messages exactly as /v1/chat/completions renders them, so a count here is
the count a generation request is charged and checked against."""

from __future__ import annotations

import functools

import attrs
import cattrs
from quart import Response, request

from trioserve.errors import RequestError
from trioserve.http.chat_parts import CalledFunction, ChatMessage, ContentPart, FunctionDef, MessageToolCall, Tool
from trioserve.http.edge import ServerState, read_body
from trioserve.http.errors import error_response, json_response
from trioserve.http.structuring import Invalid, field, strict_converter, structure_body
from trioserve.http.constraints import parse_template_kwargs
from trioserve.http.tools import message_dict, off_loop, render_prompt_ids

# The root paths these routes serve, which the API key guards as it guards /v1.
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
MAX_DETOKENIZE_IDS = 1 << 20  # a bound on the ids one body may list (a body is bounded anyway)


def _not_empty(value: tuple) -> None:
    if not value:
        raise Invalid("must not be empty")


@attrs.frozen
class TokenizeRequest:
    model: str | None = None
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = field(None, check=_not_empty)
    add_special_tokens: bool | None = None  # prompt: the BOS the model's tokenizer adds (default: yes); messages: no
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opening, as chat does
    tools: tuple[Tool, ...] | None = None
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = field(None, parse=parse_template_kwargs)  # messages: as chat completions take them


@attrs.frozen
class DetokenizeRequest:
    tokens: tuple[int, ...]
    model: str | None = None


@functools.cache
def _converter() -> cattrs.Converter:
    return strict_converter(ContentPart, CalledFunction, MessageToolCall, FunctionDef, Tool, ChatMessage, TokenizeRequest, DetokenizeRequest)


def parse_tokenize_request(body: object) -> TokenizeRequest:
    req: TokenizeRequest = structure_body(_converter(), body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("send either prompt (text) or messages (a chat), not both and not neither", field="prompt")
    if req.messages is None and req.tools is not None:
        raise RequestError("tools go with messages", field="tools")
    if req.messages is None and req.chat_template_kwargs is not None:
        raise RequestError("chat_template_kwargs go with messages", field="chat_template_kwargs")
    if req.messages is None and not req.add_generation_prompt:
        raise RequestError("add_generation_prompt goes with messages", field="add_generation_prompt")
    if req.messages is not None and not req.add_generation_prompt:
        raise RequestError("only true is supported: a chat is rendered as chat completions render it, up to the reply", field="add_generation_prompt")
    if req.messages is not None and req.add_special_tokens:
        raise RequestError("the chat template places the special tokens; send it with prompt (text) only", field="add_special_tokens")
    return req


def parse_detokenize_request(body: object) -> DetokenizeRequest:
    req: DetokenizeRequest = structure_body(_converter(), body, DetokenizeRequest)
    if len(req.tokens) > MAX_DETOKENIZE_IDS:
        raise RequestError(f"at most {MAX_DETOKENIZE_IDS} token ids, got {len(req.tokens)}", field="tokens")
    return req


def _token_ids(state: ServerState, model, req: TokenizeRequest) -> list[int]:
    """The ids /v1/completions (prompt) or /v1/chat/completions (messages)
    would make of the request. Blocking: run in a thread."""
    tokenizer = model.engine.tokenizer
    if req.messages is not None:
        return render_prompt_ids(tokenizer, model.template, map(message_dict, req.messages), req.tools, None, req.chat_template_kwargs)
    if model.engine.is_encoder and req.add_special_tokens is not False:  # as /v1/embeddings wraps an input ([CLS] ... [SEP])
        return tokenizer.encode_input(req.prompt)
    add_bos = None if req.add_special_tokens in (None, True) else False
    return tokenizer.encode(req.prompt, add_bos=add_bos, special=state.settings.allow_special_in_prompt)


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def _detokenize(tokenizer, ids: tuple[int, ...]) -> str:
    """The text of ``ids``, special tokens' text included (what a prompt of
    these ids reads as). Blocking: run in a thread."""
    vocab = tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", field="tokens")
    return tokenizer.decode(ids, skip_special=False)


def tokenizer_info(model) -> dict:
    """What a client needs to tokenize as the server does, or to ask it to:
    the special tokens (text and id), whether a BOS is added, the chat
    template's source and the context length."""
    engine = model.engine
    tokenizer = engine.tokenizer

    def text(token: int | None) -> str | None:
        return None if token is None else _token_text(tokenizer, token)

    return {
        "model": model.name,
        "tokenizer_class": "trioserve",
        "vocab_size": tokenizer.vocab_size,
        "model_max_length": engine.max_model_len,
        "bos_token": text(tokenizer.bos_id),
        "bos_token_id": tokenizer.bos_id,
        "eos_token": text(tokenizer.eos_id),
        "eos_token_id": tokenizer.eos_id,
        "stop_token_ids": sorted(tokenizer.stop_ids),
        "pad_token": None,
        "add_bos_token": tokenizer.add_bos,
        "chat_template": model.template.source,
    }


def add_tokenizer_routes(app, state: ServerState) -> None:
    @app.route("/tokenize", methods=["POST"])
    async def tokenize() -> Response:
        try:
            req = await off_loop(parse_tokenize_request, await read_body(state))
            model = state.route(req.model)
            ids = await off_loop(_token_ids, state, model, req)
            tokenizer = model.engine.tokenizer
            strs = [_token_text(tokenizer, t) for t in ids] if req.return_token_strs else None
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return error_response(exc)
        return json_response({"count": len(ids), "max_model_len": model.engine.max_model_len, "tokens": ids, "token_strs": strs})

    @app.route("/detokenize", methods=["POST"])
    async def detokenize() -> Response:
        try:
            req = await off_loop(parse_detokenize_request, await read_body(state))
            model = state.route(req.model)
            text = await off_loop(_detokenize, model.engine.tokenizer, req.tokens)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return json_response({"prompt": text})

    @app.route("/tokenizer_info", methods=["GET"])
    async def info() -> Response:
        try:
            model = state.route(request.args.get("model"))
            body = tokenizer_info(model)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return json_response(body)
