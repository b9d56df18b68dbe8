"""The `trioserve` command. Parsing is strict: an unknown option or a bad value
is a usage error (exit 2) before anything loads. A checkpoint problem is one
line on stderr naming the file, exit 2, no traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from trioserve.config import CPU_FEATURES_ENV
from trioserve.config import ACTIVATION_CHOICES, DTYPE_NAMES, KV_CACHE_DTYPES, EMBEDDING_POOLING, KERNEL_CHOICES, SPECULATIVE_MODES, EngineConfig, activations_setting, batch_invariant_setting, cpu_features_setting, kernels_setting, kv_cache_dtype_setting, kv_huge_pages_setting, native_kernels_setting, parse_byte_size, parse_size_or_auto
from trioserve.errors import ChatTemplateError, CheckpointError, TrioserveError
from trioserve.types import RANGES


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _number_in(kind: type, low: float, high: float, what: str):
    """An argparse type: ``kind(text)`` within [low, high]."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, got {value}")
        return value

    return parse


def _sampling_number(name: str):
    """An argparse type: a number within sampling field ``name``'s range,
    the one the HTTP schemas and the engine apply (trioserve.types.RANGES)."""
    allowed = RANGES[name]

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {allowed.describe()}, got {text!r}") from None
        if not allowed.holds(value):
            raise argparse.ArgumentTypeError(f"must be {allowed.describe()}, got {value}")
        return value

    return parse


_temperature = _sampling_number("temperature")
_positive_float = _number_in(float, 1e-3, 1e9, "a number of seconds")
_port = _number_in(int, 0, 65535, "a port number")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trioserve", description="OpenAI-compatible LLM inference server on trio.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = commands.add_parser("generate", help="answer one chat prompt and print the reply")
    gen.add_argument("--model", default="smollm2", help="'smollm2' (built in), a .gguf file, or a Hugging Face directory")
    gen.add_argument("--prompt", required=True, help="the user message")
    gen.add_argument("--system", default=None, help="a system message (the template's default when omitted)")
    gen.add_argument("--max-tokens", type=_positive_int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", type=_temperature, default=0.0, help="0 is greedy (default); up to 2")
    gen.add_argument("--seed", type=int, default=0, help="the request's seed, as the server takes it: any integer (default 0)")
    gen.add_argument("--dtype", choices=DTYPE_NAMES, default="auto", help="weights' dtype; auto = bfloat16 where the CPU has native bf16, else float32")
    gen.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: the cores this process may run on)")
    _batch_invariant_flag(gen)

    srv = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    srv.add_argument("--model", default="smollm2", help="'smollm2' (built in), a .gguf file, or a Hugging Face directory")
    srv.add_argument("--served-model-name", default=None, help="model id clients use (default: the --model value)")
    srv.add_argument("--dtype", choices=DTYPE_NAMES, default="auto", help="weights' dtype; auto = bfloat16 where the CPU has native bf16, else float32")
    srv.add_argument("--device", default="cpu", help="torch device: cpu, or cuda (docs/kernels.md) (default cpu)")
    srv.add_argument(
        "--kernels",
        choices=KERNEL_CHOICES,
        default=None,
        help="what runs the forward pass's operations: auto (Triton on CUDA, the C kernels on a CPU where they build), "
        "reference (torch) or triton (default: $TRIOSERVE_KERNELS, else auto)",
    )
    srv.add_argument(
        "--activations",
        choices=ACTIVATION_CHOICES,
        default=None,
        help="how the 4-bit projections take their inputs: int8 (rounded per block of 32, integer dot products: "
        "llama.cpp's arithmetic, faster at many streams; needs AVX-512 VNNI, AVX2 or NEON dotprod), bf16 (exact products, closer to the "
        "model's own answers), or auto: int8 where it runs, else bf16 (default: $TRIOSERVE_ACTIVATIONS, else auto)",
    )
    srv.add_argument("--max-num-seqs", type=_positive_int, default=32, help="sequences decoded together (default 32)")
    srv.add_argument("--max-model-len", type=_positive_int, default=None, help="longest prompt + output (default: the model's)")
    srv.add_argument("--kv-cache-bytes", type=_byte_size, default="512MiB", help="KV cache memory, e.g. 512MiB, 2GiB (default 512MiB; resident as it is used)")
    srv.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="the KV pool's dtype: bfloat16 for a float32 model on a CPU halves its memory and the bytes attention "
        "reads (K and V rounded to bf16 as stored); auto: the weights' dtype (default: $TRIOSERVE_KV_CACHE_DTYPE, else auto)",
    )
    srv.add_argument(
        "--kv-huge-pages",
        action="store_true",
        default=None,
        help="put the KV pool on transparent huge pages: faster attention over scattered blocks, but the whole pool is "
        "resident from the first request (default: $TRIOSERVE_KV_HUGE_PAGES, else off)",
    )
    srv.add_argument("--max-queue", type=_positive_int, default=256, help="waiting requests before 429 (default 256)")
    srv.add_argument("--prefill-budget", type=_positive_int, default=512, help="tokens per engine step (default 512)")
    srv.add_argument(
        "--max-step-ms",
        type=_number_in(float, 0, 3_600_000, "a number of milliseconds"),
        default=0.0,
        help="while streams are decoding, plan each step to take about this long at most: a long prompt goes in "
        "smaller chunks, so the others wait less between tokens (0: off, chunks up to --prefill-budget; default 0)",
    )
    srv.add_argument(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default="off",
        help="speculative decoding: 'ngram' drafts tokens from the request's own history and checks them in the same step; "
        "outputs are unchanged (default off)",
    )
    srv.add_argument("--speculative-tokens", type=_positive_int, default=4, help="most draft tokens per sequence and step (default 4)")
    srv.add_argument(
        "--embedding-pooling",
        choices=EMBEDDING_POOLING,
        default=EMBEDDING_POOLING[0],
        help=f"how /v1/embeddings pools an input's final hidden states: the mean over its tokens, or its last token's "
        f"(default {EMBEDDING_POOLING[0]})",
    )
    srv.add_argument("--no-prefix-cache", action="store_true", help="do not share KV blocks between requests with the same prompt prefix")
    srv.add_argument("--prefix-cache-max-blocks", type=_positive_int, default=None, help="most KV blocks the prefix cache keeps (default: as many as fit)")
    srv.add_argument("--prefix-cache-bytes", type=_byte_size, default=None, help="most KV memory the prefix cache keeps for idle blocks, e.g. 64MiB (default: as much as fits)")
    srv.add_argument("--prefix-cache-idle", type=_positive_float, default=None, help="seconds an unused cached block is kept (default: until room is needed)")
    _batch_invariant_flag(srv)
    srv.add_argument("--record", metavar="DIR", default=os.environ.get("TRIOSERVE_RECORD") or None, help="write a trace of every engine input to a new file in DIR, for `trioserve replay` (default: $TRIOSERVE_RECORD, else off)")
    srv.add_argument("--reasoning-parser", choices=("auto", "on", "off"), default="auto", help="split <think>...</think> into reasoning_content (auto: when the tokenizer has <think> as one token)")
    srv.add_argument("--max-sessions", type=_positive_int, default=1024, help="sessions kept at once; idle ones beyond go least recently used first (default 1024)")
    srv.add_argument("--session-idle", type=_positive_float, default=3600.0, help="seconds an idle session is kept (default 3600)")
    srv.add_argument("--session-history-bytes", type=_byte_size, default="64MiB", help="total history text all sessions may keep (default 64MiB)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--max-body-bytes", type=_byte_size, default="4MiB", help="largest request body (default 4MiB)")
    srv.add_argument("--drain-timeout", type=_positive_float, default=30.0, help="seconds in-flight requests get on SIGTERM (default 30)")
    srv.add_argument("--write-timeout", type=_positive_float, default=30.0, help="seconds a response write may stall before the connection is closed and the request cancelled (default 30)")
    srv.add_argument("--keep-alive-timeout", type=_positive_float, default=5.0, help="seconds a connection may stay idle, or spend sending a request's head, before it is closed (default 5)")
    srv.add_argument("--read-timeout", type=_positive_float, default=30.0, help="seconds a client may stay silent while its request body is still arriving (default 30)")
    srv.add_argument("--send-buffer-bytes", type=_size_or_auto, default="64KiB", help="kernel send buffer per connection, e.g. 64KiB, or auto (the kernel's): how much a client that stopped reading can hold back before the write timeout counts (default 64KiB)")
    srv.add_argument("--allow-special-in-prompt", action="store_true", help="let /v1/completions text prompts spell special tokens such as <|im_start|> (default: they are text)")
    srv.add_argument("--default-max-tokens", type=_positive_int, default=2048, help="max_tokens for requests that send none (default 2048)")
    srv.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    srv.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: the cores this process may run on)")

    rep = commands.add_parser("replay", help="check a trace recorded with `serve --record`: exit 0 when identical, 1 at the first difference, 2 when unreadable")
    rep.add_argument("trace", metavar="TRACE", help="one .jsonl trace file")
    rep.add_argument("--model", action="store_true", help="also re-run every step on the real model and check its tokens and logprobs")
    rep.add_argument("--checkpoint", metavar="PATH", default=None, help="where the recorded checkpoint is now (default: the path in the trace)")
    rep.add_argument("--threads", type=_positive_int, default=None, help="CPU threads in --model mode (default: the cores this process may run on)")
    return parser


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_or_auto(text: str) -> int | None:
    try:
        return parse_size_or_auto(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or auto)") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        native_kernels_setting(os.environ)  # a bad TRIOSERVE_NATIVE_KERNELS stops here, by name
        _check_cpu_features()  # and a bad or unfit TRIOSERVE_CPU_FEATURES
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "replay":
            return _replay(args)
    except (CheckpointError, ChatTemplateError, TrioserveError, ValueError) as exc:
        print(f"trioserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trioserve: interrupted", file=sys.stderr)
        return 130
    return 2


def _check_cpu_features() -> None:
    """ValueError for a $TRIOSERVE_CPU_FEATURES that is not a level, or one
    this CPU cannot run, naming the variable and what is missing."""
    from trioserve.kernels.cpu import level_fits

    level = cpu_features_setting(os.environ)
    unfit = level_fits(level)
    if unfit:
        raise ValueError(f"{CPU_FEATURES_ENV}={level}: {unfit}")


def _set_threads(threads: int | None) -> None:
    """torch's CPU threads: --threads, else the cores this process may run
    on (its affinity mask), which is what a container or taskset gives it."""
    import torch

    from trioserve.kernels.cpu import default_threads

    torch.set_num_threads(threads or default_threads())


def _batch_invariant_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a request's output never depends on what shares its steps (default: $TRIOSERVE_BATCH_INVARIANT, else on); "
        "--no-batch-invariant is faster on long prompts (docs/determinism.md)",
    )


def generate_engine_config(model: str, dtype: str, batch_invariant: bool = True) -> EngineConfig:
    """The engine `trioserve generate` opens: the one `trioserve serve
    --model MODEL --dtype DTYPE` opens (serve's other defaults are
    EngineConfig's), so the same request gives the same text."""
    return EngineConfig(model=model, dtype=dtype, batch_invariant=batch_invariant)


def generate_request_body(args: argparse.Namespace) -> dict:
    """`trioserve generate`'s request as a chat completions body: the reply
    to --system/--prompt, with the sampling settings the flags give."""
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": args.prompt}
    ]
    return {"messages": messages, "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}


def _generate(args: argparse.Namespace) -> int:
    """One chat request through the engine, as the server's chat route runs
    it: the body parsed and mapped to SamplingParams by the HTTP schemas,
    the prompt rendered and tokenized by the route's function. The reply's
    text is printed as it streams."""
    import trio

    from trioserve.kernels.cpu import resolve_dtype
    from trioserve.http.schemas import parse_chat_request, sampling_params
    from trioserve.models.checkpoint import load_checkpoint
    from trioserve.progress import ProgressBar

    _set_threads(args.threads)
    request = parse_chat_request(generate_request_body(args))
    params = sampling_params(request, default_max_tokens=args.max_tokens)
    config = generate_engine_config(args.model, args.dtype, batch_invariant_setting(args.batch_invariant, dict(os.environ)))
    dtype = resolve_dtype(config.dtype)  # auto: by the CPU (kernels/cpu.py)
    progress = ProgressBar("Loading weights")
    checkpoint = load_checkpoint(config.model, dtype=dtype, progress=progress)
    try:
        final = trio.run(_run_generation, config, checkpoint, request, params, lambda: progress.finish(f" ({checkpoint.path}, {dtype})"))
    except BaseExceptionGroup as group:  # the engine's nursery wraps what its body raised
        raise _sole_error(group) from None
    sys.stdout.write("\n")
    print(
        f"[{final.usage.prompt_tokens} prompt tokens, {final.usage.completion_tokens} generated, finish: {final.finish_reason}]",
        file=sys.stderr,
    )
    return 0


async def _run_generation(config: EngineConfig, checkpoint, request, params, loaded):
    from trioserve.engine import open_engine
    from trioserve.http.tools import message_dict, render_prompt_ids
    from trioserve.models.chat_template import ChatTemplate
    from trioserve.types import FinalEvent, GenerateRequest

    async with open_engine(config, checkpoint=checkpoint) as engine:
        loaded()
        tok = engine.tokenizer
        template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
        prompt_ids = render_prompt_ids(tok, template, map(message_dict, request.messages))
        async for event in engine.generate(GenerateRequest(prompt_ids, params)):  # ends with its FinalEvent
            if event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            final = event
    assert isinstance(final, FinalEvent)
    if final.finish_reason == "error":
        raise TrioserveError(f"generation failed: {final.error}")
    return final


def _sole_error(group: BaseExceptionGroup) -> BaseException:
    """The one exception inside ``group`` (nested groups included), or the
    group itself when there are several."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else group


def _serve(args: argparse.Namespace) -> int:
    from trioserve.config import EngineConfig, ServerSettings
    from trioserve.http.serve import run_server

    _set_threads(args.threads)
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_huge_pages=kv_huge_pages_setting(args.kv_huge_pages, dict(os.environ)),
        kv_cache_dtype=args.kv_cache_dtype or kv_cache_dtype_setting(os.environ),
        max_queue=args.max_queue,
        prefill_budget=args.prefill_budget,
        max_step_ms=args.max_step_ms,
        prefix_cache=not args.no_prefix_cache,
        prefix_cache_max_blocks=args.prefix_cache_max_blocks,
        prefix_cache_max_bytes=args.prefix_cache_bytes,
        prefix_cache_idle_s=args.prefix_cache_idle,
        record_dir=args.record,
        batch_invariant=batch_invariant_setting(args.batch_invariant, dict(os.environ)),
        speculative=args.speculative,
        speculative_tokens=args.speculative_tokens,
        embedding_pooling=args.embedding_pooling,
        kernels=args.kernels or kernels_setting(os.environ),
        activations=args.activations or activations_setting(os.environ),
    )
    settings = ServerSettings(
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
        write_timeout_s=args.write_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        read_timeout_s=args.read_timeout,
        send_buffer_bytes=args.send_buffer_bytes,
        default_max_tokens=args.default_max_tokens,
        max_sessions=args.max_sessions,
        session_idle_s=args.session_idle,
        session_history_bytes=args.session_history_bytes,
        reasoning_parser=args.reasoning_parser,
        allow_special_in_prompt=args.allow_special_in_prompt,
        log_level=args.log_level,
    )
    return run_server(settings)


def _replay(args: argparse.Namespace) -> int:
    from trioserve.core.replay import main as replay_main

    _set_threads(args.threads)
    return replay_main(args.trace, checkpoint=args.checkpoint, model=args.model)


if __name__ == "__main__":
    sys.exit(main())
