"""The `trioserve` command. Parsing is strict: an unknown option or a bad value
is a usage error (exit 2) before anything loads. A checkpoint problem is one
line on stderr naming the file, exit 2, no traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from trioserve.config import CPU_FEATURES_ENV, EngineConfig, ServerSettings, batch_invariant_setting, cpu_features_setting, native_kernels_setting
from trioserve.option_kinds import SWITCH, lora_spec, positive_int, split_model
from trioserve.options import OPTIONS, Option, flag_or_env, option, shown_default
from trioserve.errors import ChatTemplateError, CheckpointError, TrioserveError, sole_error
from trioserve.types import RANGES


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trioserve", description="OpenAI-compatible LLM inference server on trio.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = commands.add_parser("generate", help="answer one chat prompt and print the reply")
    model = option("engine.model")
    gen.add_argument("--model", default=model.default, metavar="PATH", help=f"smollm2 (built in), a .gguf file or a Hugging Face directory (default: {model.default})")
    gen.add_argument("--prompt", required=True, help="the user message")
    gen.add_argument("--system", default=None, help="a system message (the template's default when omitted)")
    gen.add_argument("--max-tokens", type=positive_int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", type=_temperature, default=0.0, help="0 is greedy (default); up to 2")
    gen.add_argument("--seed", type=int, default=0, help="the request's seed, as the server takes it: any integer (default 0)")
    for opt in (option("engine.dtype"), THREADS, option("engine.batch_invariant")):
        add_option(gen, opt)

    srv = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    for opt in OPTIONS:  # every flag of trioserve/options.py's table
        add_option(srv, opt)

    rep = commands.add_parser(
        "replay",
        help="check a trace recorded with `serve --record`: exit 0 when identical, 1 at the first difference, 2 when unreadable, "
        "3 when it came from a CPU class whose level this CPU cannot run",
    )
    rep.add_argument("trace", metavar="TRACE", help="one .jsonl trace file")
    rep.add_argument("--model", action="store_true", help="also re-run every step on the real model and check its tokens and logprobs")
    rep.add_argument("--checkpoint", metavar="PATH", default=None, help="where the recorded checkpoint is now (default: the path in the trace)")
    rep.add_argument("--threads", type=positive_int, default=None, help="CPU threads in --model mode (default: the cores this process may run on)")
    return parser


THREADS = next(opt for opt in OPTIONS if opt.flag == "--threads")  # no setting: torch's, set before anything runs (_set_threads)


def add_option(parser: argparse.ArgumentParser, opt: Option) -> None:
    """``opt``'s flag on ``parser``: its kind's argparse type, its choices,
    and its default, which is None where the flag falls back to its
    variable (resolved in `serve_settings`, so a bad variable is one error
    line rather than a usage message)."""
    default = None if opt.flag_reads_env else (False if opt.switches_off else opt.default)
    help_text = f"{_plain(opt.help)} (default: {_default_help(opt)})".replace("%", "%%")
    if opt.repeatable:
        parser.add_argument(opt.flag, type=opt.kind.flag, action="append", default=None, metavar=opt.metavar, help=help_text)
    elif opt.kind is SWITCH:
        action = argparse.BooleanOptionalAction if opt.negatable else "store_true"
        parser.add_argument(opt.flag, action=action, default=default, help=help_text)
    else:
        parser.add_argument(opt.flag, type=opt.kind.flag, choices=opt.choices, default=default, metavar=opt.metavar, help=help_text)


def _plain(markdown: str) -> str:
    return markdown.replace("`", "")


def _default_help(opt: Option) -> str:
    shown = _plain(shown_default(opt))
    return f"${opt.env}, else {shown}" if opt.flag_reads_env and opt.env else shown


def serve_settings(args: argparse.Namespace, environ: dict[str, str]) -> ServerSettings:
    """The settings `trioserve serve ARGS` runs with: each option's flag
    (a `--no-` switch given turns its field off), or, for a flag that falls
    back to its variable, $VARIABLE, else the default."""
    engine: dict = {}
    server: dict = {}
    for opt in OPTIONS:
        if opt.field is None:
            continue
        value = getattr(args, opt.dest)
        if opt.switches_off:
            value = not value
        if opt.flag_reads_env:
            value = flag_or_env(opt, value, environ)
        (engine if opt.field.startswith("engine.") else server)[opt.name] = value
    (first_name, engine["model"]), *more = [split_model(text) for text in engine["model"] or [option("engine.model").default]]
    # The first model's name: its NAME=, else --served-model-name, else the --model value (the docs' default).
    server["served_model_name"] = first_name or server["served_model_name"] or engine["model"]
    server["more_models"] = [(name or path, path) for name, path in more]
    server["loras"] = [lora_spec(text) for text in server["loras"] or ()]
    return ServerSettings(engine=EngineConfig(**engine), **server)


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
    from trioserve.http.edge import sampling_params
    from trioserve.http.schemas import parse_chat_request
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
        raise sole_error(group) from None
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


def _serve(args: argparse.Namespace) -> int:
    from trioserve.http.serve import run_server

    from trioserve.http.tenants import Tenants
    from trioserve.state.durable import open_store

    _set_threads(args.threads)
    settings = serve_settings(args, dict(os.environ))
    Tenants(settings.api_key, settings.api_keys_file)  # so does an API keys file that cannot be used (TenantsError)
    store = open_store(settings.state_dir, settings.state_url, os.environ)  # a store that cannot be used stops here, as one line (StateError)
    if store is not None:
        store.close()
    return run_server(settings)


def _replay(args: argparse.Namespace) -> int:
    from trioserve.core.replay import main as replay_main

    _set_threads(args.threads)
    return replay_main(args.trace, checkpoint=args.checkpoint, model=args.model, threads=args.threads)


if __name__ == "__main__":
    sys.exit(main())
