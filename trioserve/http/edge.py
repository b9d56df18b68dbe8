"""What every route does with a request before the engine sees it, in one
place: the state the routes share (`ServerState`), reading the JSON body,
routing to a model (its registry: http/registry.py), the n check, the
request's token budget, the default max_tokens, and resolving the seed.

A seed a client sends is resolved here, once (`resolve_seed`): folded into
the engine's range, plus the choice's place among n choices; a session
turn that sends none continues its session's. A request that sends no seed
gets a fresh one from the engine's edge (trioserve/engine.py), which
reports it back."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sized
from typing import Any

import trio
from quart import current_app, g, request
from werkzeug.exceptions import RequestEntityTooLarge

from trioserve.config import ServerSettings
from trioserve.errors import EngineClosed, RequestError, RequestTooLarge
from trioserve.http import openai
from trioserve.http.chat_parts import Tool, ToolChoice, tools_offered
from trioserve.http.errors import HTTPError
from trioserve.http.guard import form_content_type, not_json
from trioserve.http.registry import Model
from trioserve.http.schemas import ChatCompletionRequest, CompletionRequest, one_call_only
from trioserve.http.structuring import check_json_body
from trioserve.http.tenants import ANONYMOUS, Tenants
from trioserve.http.tools import off_loop
from trioserve.models.checkpoint import Checkpoint
from trioserve.models.output_parser import CALL_CLOSE
from trioserve.state.session import Quota
from trioserve.types import SamplingParams, fold_seed

BIG_BODY = 64 << 10  # bodies larger than this are decoded in a thread
AS_SENT = object()  # sampling_params: the seed the request sent


class ServerState:
    """What the routes share: the model registry once the app runs, and the
    server's phase."""

    def __init__(self, settings: ServerSettings, *, checkpoint: Checkpoint | None = None, requests=None) -> None:
        self.settings = settings
        self.registry = None  # the Registry (http/registry.py), while the app runs
        self.phase = "loading"  # loading -> ok -> draining; or dead
        self.created = openai.now()
        self.engine_scope = trio.CancelScope()
        self.requests = requests  # the InFlight middleware, which counts HTTP requests in flight
        self.checkpoint = checkpoint  # the first model's, preloaded; or None to load it
        self.sessions = None  # the SessionStore, made with the session routes
        self.responses = None  # the stored responses (a SessionStore too), made with their routes
        self.turns = None  # the SessionActors: start session actors while the app runs
        self.tenants = Tenants(settings.api_key, settings.api_keys_file, settings.tenant_max_in_flight)  # TenantsError: a bad keys file

    def quota(self, total_sessions: int, total_bytes: int | None) -> Callable[[str], Quota]:
        """Each tenant's quota in a store holding ``total_sessions`` and
        ``total_bytes``: --tenant-max-sessions and --tenant-history-bytes,
        else an even share between the tenants there are now."""
        settings, tenants = self.settings, self.tenants

        def quota(owner: str) -> Quota:
            sessions = settings.tenant_max_sessions or tenants.share(total_sessions)
            history = settings.tenant_history_bytes or (tenants.share(total_bytes) if total_bytes is not None else None)
            return Quota(sessions, history)

        return quota

    @property
    def cache_scoped(self) -> bool:
        """Prefix-cache blocks are salted per tenant (--prefix-cache-scope)."""
        scope = self.settings.prefix_cache_scope
        return scope == "tenant" or (scope == "auto" and self.tenants.required)

    def route(self, name: object, field: str = "model") -> Model:
        """The ready model ``name`` picks (`Registry.route`: held until the
        request is over), or the reason no request can run now."""
        if self.phase == "draining":
            raise EngineClosed("the server is shutting down")
        if self.registry is None:
            raise HTTPError(503, "the model is still loading", kind="server_error", code="loading")
        return self.registry.route(name, field, tenant() if self.tenants.required else None)

    def engines(self) -> list:
        """The engines of every model that has one now."""
        models = self.registry.models.values() if self.registry is not None else ()
        return [m.engine for m in models if m.engine is not None]


async def read_body(state: ServerState) -> object:
    """The request's JSON body, decoded and passed through check_json_body
    (no lone surrogates, bounded nesting), or an HTTPError/RequestError for
    the client. Bodies over BIG_BODY are decoded in a thread (`off_loop`).

    Whatever the Content-Type the guard let through (JSON, none, another
    type), the body is read as JSON; sent as curl's form default (`curl -d`,
    http/guard.py), a body that is not a JSON object is the guard's 415."""
    limit = state.settings.max_body_bytes
    form = form_content_type(request.headers.get("Content-Type", ""))
    try:
        raw = await request.get_data(cache=False)
    except RequestEntityTooLarge:
        raise HTTPError(413, f"the request body is larger than {limit} bytes", code="body_too_large") from None

    def decode() -> object:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge ints, deep nesting
            if form is not None:  # a real form body (a=1&b=2), or JSON with a mistake (curl -d '{...')
                raise not_json(form, str(exc) if raw.lstrip()[:1] in (b"{", b"[") else None) from None
            raise HTTPError(400, f"the request body is not valid JSON: {exc}") from exc
        if form is not None and not isinstance(body, dict):
            raise not_json(form)
        check_json_body(body, raw)
        return body

    return decode() if len(raw) <= BIG_BODY else await off_loop(decode)


AFFINITY_HEADER = "X-Session-Id"  # what a load balancer hashes to keep a conversation on one replica (docs/scaling.md)
_AFFINITY_KEY = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def tenant() -> str:
    """The tenant of the request being served (app.py's guard names it;
    "" without API keys, and on routes that need no key)."""
    return g.get("tenant", ANONYMOUS)


def cache_salt(sent: str | None = None) -> str | None:
    """The prefix-cache salt of the request being served: its tenant's
    when the cache is scoped by tenant (--prefix-cache-scope), narrowed by
    the request's own ``cache_salt`` field (vLLM's) when it sent one; None
    (shared with every unsalted request) when neither applies."""
    state: ServerState = current_app.extensions["trioserve"]
    scoped = state.cache_scoped
    if not scoped and sent is None:
        return None
    who = tenant() if scoped else ""
    return f"{len(who)}:{who}:{sent or ''}"  # the length first: no two (tenant, salt) pairs spell the same text


def affinity_key() -> str | None:
    """The request's X-Session-Id (a conversation's key, chosen by the
    client), or None; a 400 naming the header when it is not 1-128 of
    letters, digits and ._:- (it may become a session's id)."""
    key = request.headers.get(AFFINITY_HEADER)
    if key is None:
        return None
    if not _AFFINITY_KEY.fullmatch(key):
        raise HTTPError(400, f"{AFFINITY_HEADER}: 1 to 128 letters, digits and ._:- expected, got {key[:40]!r}", param=AFFINITY_HEADER)
    return key


def with_affinity(response, key: str):
    """``response`` telling the client (and a load balancer) the key its
    conversation goes on with."""
    response.headers[AFFINITY_HEADER] = key
    return response


def check_n(engine, n: int, prompts: int = 1) -> None:
    """n choices of each prompt are that many requests; more than the queue
    holds could never all be accepted, so say so instead of answering 429
    forever."""
    limit = engine.config.max_queue
    if n > limit:
        raise RequestError(f"n ({n}) is more than this server queues at once ({limit}, --max-queue)", field="n")
    if n * prompts > limit:
        raise RequestError(
            f"{prompts} prompts x n ({n}) = {n * prompts} choices, more than this server queues at once ({limit}, --max-queue)",
            field="prompt",
        )


def check_request_tokens(state: ServerState, field: str, prompts: Iterable[Sized], n: int = 1, *, max_len: int | None = None) -> None:
    """The request's token budget (--max-request-tokens): the tokens of all
    ``prompts`` (token id lists), n times over for n choices, counted
    together. Over it, a 400 naming ``field`` with the count and the limit.
    Every route that submits work calls it once its prompts are tokenized
    and before the engine sees any of them. A prompt longer than the
    model's context (``max_len``) is left to the context check, whose
    error says more (context_length_exceeded)."""
    limit = state.settings.max_request_tokens
    prompts = list(prompts)
    if max_len is not None and any(len(prompt) > max_len for prompt in prompts):
        return
    each = sum(len(prompt) for prompt in prompts)
    total = each * n
    if total > limit:
        times = f" ({each} x n {n})" if n > 1 else ""
        raise HTTPError(
            400, f"{field}: this request has {total} prompt tokens in all{times}, more than --max-request-tokens {limit}",
            param=field, code="too_many_tokens",
        )  # fmt: skip


def default_max_tokens(state: ServerState, engine, prompt_ids, field: str) -> int:
    """max_tokens for a request that did not send one: the rest of the
    context, but no more than --default-max-tokens nor than the whole KV
    pool can hold beside the prompt (admission reserves prompt + max_tokens)."""
    room = engine.max_model_len - len(prompt_ids)
    if room < 1:
        raise RequestTooLarge(f"the prompt has {len(prompt_ids)} tokens; the maximum model length is {engine.max_model_len}", field=field)
    stats = engine.statistics()
    pool_room = stats.kv_blocks_total * stats.block_size - len(prompt_ids)
    return max(1, min(room, state.settings.default_max_tokens, pool_room))


def resolve_seed(sent: int | None, choice: int = 0) -> int | None:
    """The engine's seed for a sent one (any integer, as OpenAI allows),
    for choice ``choice`` of n: seed + choice, folded into [0, 2**63).
    None stays None: the engine picks a fresh seed and reports it."""
    return None if sent is None else fold_seed(sent + choice)


def output_parsing(model: Model, tools: tuple[Tool, ...] | None, choice: ToolChoice | None) -> dict[str, bool]:
    """What a chat-shaped job's parser splits out of its replies, as
    GenerationJob fields: tool calls (tools offered), reasoning (the
    server's --reasoning-parser, for ``model``), and whether a call is forced."""
    return {
        "calls": tools_offered(tools, choice),
        "reasoning": model.reasoning,
        "forced_call": choice is not None and choice.mode in ("required", "function"),
    }


# Chat and completion fields that become the SamplingParams field of the same name, as
# sent; left out (null), they take SamplingParams' own default.
_AS_SENT = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_params(request: ChatCompletionRequest | CompletionRequest, *, default_max_tokens: int, seed: object = AS_SENT) -> SamplingParams:
    """The SamplingParams a parsed request asks for. Unset fields take
    SamplingParams' own defaults (the engine's); max_tokens defaults to
    ``default_max_tokens``. The seed is the request's, unless ``seed`` is
    given (a session turn's: its session's), resolved by `resolve_seed`."""
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        logprobs = request.logprobs
        top_logprobs = request.top_logprobs or 0
    else:
        max_tokens = request.max_tokens
        logprobs = request.logprobs is not None
        top_logprobs = request.logprobs or 0
    stop = (request.stop,) if isinstance(request.stop, str) else (request.stop or ())
    if isinstance(request, ChatCompletionRequest) and one_call_only(request):
        stop += (CALL_CLOSE,)
    given: dict[str, Any] = {name: getattr(request, name) for name in _AS_SENT if getattr(request, name) is not None}
    if request.top_k is not None:
        given["top_k"] = max(request.top_k, 0)  # -1 and 0 both turn it off; SamplingParams' off is 0
    if request.logit_bias is not None:
        given["logit_bias"] = tuple(request.logit_bias.items())
    if request.stop_token_ids is not None:
        given["stop_token_ids"] = request.stop_token_ids
    sent = request.seed if seed is AS_SENT else seed
    if sent is not None:
        given["seed"] = resolve_seed(sent)
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stop=stop,
        ignore_eos=request.ignore_eos,
        **given,
    )
