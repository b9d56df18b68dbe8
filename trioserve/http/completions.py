"""POST /v1/chat/completions and POST /v1/completions.

Each route reads its body into a `GenerationJob` (trioserve/http/job.py),
in one place, and a `Connection` runs it (trioserve/http/connection.py).

Prompt scores: `prompt_logprobs` (vLLM's field, both routes) and, on
completions, `echo` with `logprobs` ask the engine to score the prompt
(SamplingParams.prompt_logprobs, with the longer of the two top lists);
`max_tokens` 0 with `echo` scores it and generates nothing."""

from __future__ import annotations

import attrs
from quart import Response

from trioserve.errors import RequestError
from trioserve.http import openai
from trioserve.http.connection import Connection
from trioserve.http.edge import ServerState, cache_salt, check_n, check_request_tokens, default_max_tokens, output_parsing, read_body, sampling_params, tenant
from trioserve.http.errors import error_response
from trioserve.http.job import GenerationJob, Prompt
from trioserve.http.schemas import parse_chat_request, parse_completion_request
from trioserve.http.tools import compile_guides, message_dict, off_loop, render_prompt_ids


def add_completion_routes(app, state: ServerState) -> None:
    @app.route("/v1/chat/completions", methods=["POST"])
    async def chat() -> Response:
        try:
            req = await off_loop(parse_chat_request, await read_body(state))
            model = state.route(req.model)
            engine = model.engine
            check_n(engine, req.n)
            messages = map(message_dict, req.messages)  # made in the thread that renders them
            prompt_ids = await off_loop(render_prompt_ids, engine.tokenizer, model.template, messages, req.tools, req.tool_choice, req.chat_template_kwargs)
            check_request_tokens(state, "messages", [prompt_ids], req.n, max_len=engine.max_model_len)
            params = sampling_params(req, default_max_tokens=default_max_tokens(state, engine, prompt_ids, "messages"))
            params = attrs.evolve(params, prompt_logprobs=req.prompt_logprobs)
            job = GenerationJob(
                id=openai.new_id("chatcmpl"), shape="chat", model=model.name, created=openai.now(),
                prompts=[Prompt("", prompt_ids, params)], n=req.n, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
                guides=await compile_guides(engine, req, req.n), stream=req.stream,
                include_usage=bool(req.stream_options and req.stream_options.include_usage),
                adapter=model.adapter_key, cache_salt=cache_salt(req.cache_salt), tenant=tenant() or None, **output_parsing(model, req.tools, req.tool_choice),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return error_response(exc)
        return await Connection(job, engine).respond()

    @app.route("/v1/completions", methods=["POST"])
    async def completions() -> Response:
        try:
            req = await off_loop(parse_completion_request, await read_body(state))
            model = state.route(req.model)
            engine = model.engine
            # A list of prompts is that many independent prompts, n choices
            # each; counted before any is tokenized.
            check_n(engine, req.n, _prompt_count(req.prompt))
            prompts = await off_loop(_completion_prompts, engine, req.prompt, state.settings.allow_special_in_prompt)
            check_request_tokens(state, "prompt", [ids for _, ids in prompts], req.n, max_len=engine.max_model_len)
            job = GenerationJob(
                id=openai.new_id("cmpl"), shape="text", model=model.name, created=openai.now(),
                prompts=[Prompt(text, ids, _completion_params(state, engine, req, ids)) for text, ids in prompts],
                n=req.n, logprobs=req.logprobs is not None, echo=req.echo, prompt_logprobs=req.prompt_logprobs,
                guides=await compile_guides(engine, req, req.n * len(prompts)), stream=req.stream,
                include_usage=bool(req.stream_options and req.stream_options.include_usage), adapter=model.adapter_key,
                cache_salt=cache_salt(req.cache_salt), tenant=tenant() or None,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return await Connection(job, engine).respond()


def _completion_params(state: ServerState, engine, req, ids: list[int]):
    """One prompt's SamplingParams. Its prompt is scored for
    `prompt_logprobs` and for `echo` with `logprobs` (the longer top list
    serves both); the default max_tokens is only worked out when none was
    sent (a prompt filling the context may still be scored, max_tokens 0)."""
    default = default_max_tokens(state, engine, ids, "prompt") if req.max_tokens is None else 1
    asked = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    return attrs.evolve(sampling_params(req, default_max_tokens=default), prompt_logprobs=max(asked) if asked else None)


def _prompt_count(prompt) -> int:
    """How many prompts a parsed `prompt` field holds: a string or one list
    of token ids is one."""
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def _completion_prompts(engine, prompt, special: bool) -> list[tuple[str, list[int]]]:
    """(text, ids) of each prompt; token ids are checked before decoding.
    Text is tokenized as text unless ``special`` (--allow-special-in-prompt):
    then special-token text becomes its id. Token ids are taken as sent.
    Blocking: the route runs it in a thread."""
    if isinstance(prompt, str):
        return [(prompt, engine.tokenizer.encode(prompt, special=special))]
    if prompt and all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, engine.tokenizer.encode(p, special=special)))
            continue
        ids = list(p)
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", field="prompt")
        out.append((engine.tokenizer.decode(ids), ids))
    return out
