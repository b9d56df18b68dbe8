"""Every `trioserve serve` option, declared once: its flag, the settings
field it fills, the kind of value (how the flag and the variable parse it),
its default, its TRIOSERVE_* variable, its choices and what it means.

Everything else is made from `OPTIONS`: the attrs fields' defaults and
choice checks (config.py), the variables `settings_from_env` reads
(config.py), the `serve` flags and the mapping from them to the settings
(cli.py), and the table in docs/configuration.md
(`python -m trioserve.options --markdown` prints it, `--write PATH`
rewrites it in place; tests/test_options.py checks the file holds it).

The kinds of value, and the parsers behind them, are option_kinds.py's.
This module sits in the bottom layer beside config.py, which imports it;
it imports only option_kinds.py of trioserve's."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trioserve.option_kinds import (
    BYTES,
    BYTES_OR_AUTO,
    MILLISECONDS,
    PORT,
    POSITIVE_INT,
    SECONDS,
    STATE_URL,
    SWITCH,
    TEXT,
    Kind,
    choice_problem,
    one_of,
)

MIB = 1 << 20

# --dtype values; "auto" is bfloat16 (trioserve.kernels.cpu.DTYPES maps them to torch).
DTYPE_NAMES = ("auto", "bfloat16", "float32", "float16")
SPECULATIVE_MODES = ("off", "ngram")
KERNEL_CHOICES = ("auto", "reference", "triton")  # the first is the default (kernels/ops.py)
# How the 4-bit projections take their inputs (kernels/ops.py
# `select_kernels`, kernels/projection.py `Projection`): bf16, or int8 per block of
# 32 (faster, less exact: docs/kernels.md); auto is int8 where its C kernel
# runs (AVX-512 VNNI), else bf16. The first is the default.
ACTIVATION_CHOICES = ("auto", "bf16", "int8")
# The KV pool's dtype: auto is the weights'; a float32 model on a CPU may keep a bfloat16 pool.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
EMBEDDING_POOLING = ("auto", "mean", "last")  # the first is the default; auto: the model file's (trioserve.types.POOLING_MODES: mean, last)
REASONING_PARSERS = ("auto", "on", "off")
RERANK_METHODS = ("auto", "embedding", "yes-no")  # the first is the default; auto: yes-no for a reranker file (http/rerank.py)
LOG_LEVELS = ("debug", "info", "warning", "error")
PREFIX_CACHE_SCOPES = ("auto", "tenant", "global")


@attrs.frozen
class Option:
    """One option. ``field`` is the settings field it fills ("engine."
    before an EngineConfig field, a ServerSettings one otherwise; None for
    an option that is no setting), ``default`` that field's default.
    A ``--no-`` switch turns its field off; a ``negatable`` one has both
    forms. ``repeatable``: the flag may be given several times.
    ``flag_reads_env``: the flag, when not given, falls back to the
    variable (otherwise only `settings_from_env` reads it). ``shown_default``:
    the docs' default column, where the value alone would not say it."""

    flag: str
    field: str | None
    kind: Kind
    default: Any
    help: str
    env: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negatable: bool = False
    flag_reads_env: bool = False
    shown_default: str | None = None
    repeatable: bool = False  # the flag may be given several times (its values a list)

    @property
    def name(self) -> str:
        """The attrs field's own name (no "engine." before it)."""
        return (self.field or self.dest).rpartition(".")[2]

    @property
    def dest(self) -> str:
        """The argparse attribute the flag fills."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def switches_off(self) -> bool:
        return self.kind is SWITCH and self.flag.startswith("--no-")

    def parse_variable(self, text: str) -> Any:
        """The value of this option's variable set to ``text``."""
        return one_of(self.choices)(text) if self.choices else self.kind.variable(text)


def _o(flag: str, field: str | None, kind: Kind, default: Any, help: str, env: str | None = None, **more: Any) -> Option:
    return Option(flag, field, kind, default, help, env, **more)


OPTIONS: tuple[Option, ...] = (
    _o("--host", "host", TEXT, "127.0.0.1", "address to bind"),
    _o("--port", "port", PORT, 8000, "port"),
    _o("--model", "engine.model", TEXT, "smollm2",
       "`smollm2` (built in), a `.gguf` file or a Hugging Face directory; `NAME=PATH` serves it under NAME. Given "
       "several times, every model is served, each on its own engine with these settings, the request's `model` "
       "picking one (docs/models.md)", "TRIOSERVE_MODEL", metavar="[NAME=]PATH", repeatable=True),
    _o("--served-model-name", "served_model_name", TEXT, None, "the model id clients send and `/v1/models` lists",
       "TRIOSERVE_SERVED_MODEL_NAME", shown_default="the `--model` value"),
    _o("--dtype", "engine.dtype", TEXT, "auto",
       "`auto` (bfloat16 on CPUs with native bf16, float32 elsewhere; see below), `bfloat16`, `float32`, `float16`",
       "TRIOSERVE_DTYPE", choices=DTYPE_NAMES),
    _o("--device", "engine.device", TEXT, "cpu",
       "torch device: `cpu`, or `cuda` (weights in bf16 by default there; the KV pool is `--kv-cache-bytes` but at most "
       "90% of the GPU's free memory; docs/kernels.md)", "TRIOSERVE_DEVICE"),
    _o("--kernels", "engine.kernels", TEXT, KERNEL_CHOICES[0],
       "what runs the forward pass's operations: `auto` (Triton on CUDA, the C kernels on a CPU where they build, else "
       "torch), `reference` (torch) or `triton` (refused on a CPU); docs/kernels.md",
       "TRIOSERVE_KERNELS", choices=KERNEL_CHOICES, flag_reads_env=True),
    _o("--activations", "engine.activations", TEXT, ACTIVATION_CHOICES[0],
       "how the 4-bit projections take their inputs: `int8` (rounded to 8 bits per block of 32, integer dot products "
       "in the C kernels, the same bits at every CPU level (AVX-512, AVX2, NEON, plain C): llama.cpp's arithmetic; faster "
       "at many streams, greedy replies further from the exact model's; refused where the C kernels cannot run), `bf16` (exact products) or `auto`: "
       "int8 where its kernel runs, else bf16; the 5-6-bit (Q5_0, Q5_1, Q5_K, Q6_K) and 8-bit (Q8_0) layers run on "
       "their codes only with `int8`, dense with `bf16`; F16/BF16 layers run on their 16 bits either way; what the "
       "model ran is recorded in traces, and the model card's `compute.weights` says how each kind of layer is held; "
       "docs/kernels.md", "TRIOSERVE_ACTIVATIONS", choices=ACTIVATION_CHOICES, flag_reads_env=True),
    _o("--max-num-seqs", "engine.max_num_seqs", POSITIVE_INT, 32, "sequences decoded together in one step", "TRIOSERVE_MAX_NUM_SEQS"),
    _o("--max-model-len", "engine.max_model_len", POSITIVE_INT, None, "longest prompt + output", "TRIOSERVE_MAX_MODEL_LEN",
       shown_default="the model's"),
    _o("--kv-cache-bytes", "engine.kv_cache_bytes", BYTES, 512 * MIB,
       "memory of the KV block pool (`512MiB`, `2GiB`, bytes); resident only as blocks are first written", "TRIOSERVE_KV_CACHE_BYTES"),
    _o("--kv-cache-dtype", "engine.kv_cache_dtype", TEXT, KV_CACHE_DTYPES[0],
       "the KV pool's dtype: `auto` (the weights'), `float32`, or `bfloat16` for a float32 model on a CPU (half the "
       "pool's memory and attention's reads; K and V rounded to bf16 as stored; docs/kernels.md)",
       "TRIOSERVE_KV_CACHE_DTYPE", choices=KV_CACHE_DTYPES, flag_reads_env=True),
    _o("--kv-huge-pages", "engine.kv_huge_pages", SWITCH, False,
       "the KV pool on transparent huge pages: attention over scattered blocks ~1.1x faster, but the first request "
       "makes the whole pool resident", "TRIOSERVE_KV_HUGE_PAGES", flag_reads_env=True),
    _o("--max-queue", "engine.max_queue", POSITIVE_INT, 256, "requests waiting for admission before new ones get 429", "TRIOSERVE_MAX_QUEUE"),
    _o("--prefill-budget", "engine.prefill_budget", POSITIVE_INT, 512,
       "tokens per engine step (decode rows + prefill chunks); must exceed `--max-num-seqs`", "TRIOSERVE_PREFILL_BUDGET"),
    _o("--max-step-ms", "engine.max_step_ms", MILLISECONDS, 0.0,
       "while streams are decoding, plan each step to take about this long at most: a long prompt goes in smaller "
       "chunks, sized from what the last steps took, so the decoding streams wait less between tokens; the long "
       "prompt's first token comes later. For slow CPUs and big models, where a 512-token chunk takes seconds (below)",
       "TRIOSERVE_MAX_STEP_MS", shown_default="`0` (off)"),
    _o("--no-prefix-cache", "engine.prefix_cache", SWITCH, True,
       "share the KV blocks of identical prompt prefixes between requests", "TRIOSERVE_PREFIX_CACHE"),
    _o("--prefix-cache-max-blocks", "engine.prefix_cache_max_blocks", POSITIVE_INT, None, "most blocks the prefix cache keeps",
       "TRIOSERVE_PREFIX_CACHE_MAX_BLOCKS", shown_default="as many as fit"),
    _o("--prefix-cache-bytes", "engine.prefix_cache_max_bytes", BYTES, None,
       "most KV memory the prefix cache keeps in idle blocks (the stricter of this and the block limit applies)",
       "TRIOSERVE_PREFIX_CACHE_BYTES", shown_default="as much as fits"),
    _o("--prefix-cache-idle", "engine.prefix_cache_idle_s", SECONDS, None, "seconds an unused cached block is kept", "TRIOSERVE_PREFIX_CACHE_IDLE"),
    _o("--batch-invariant", "engine.batch_invariant", SWITCH, True,
       "a request's logits are bit-identical whatever else shares its steps and however its prompt is chunked, so a "
       "seeded request gives the same text alone or under load (docs/determinism.md). Off runs the older "
       "batch-dependent arithmetic, faster on long prompts. `/v1/models`, `/metrics` and `/metrics/prometheus` say "
       "which mode runs", "TRIOSERVE_BATCH_INVARIANT", negatable=True, flag_reads_env=True),
    _o("--speculative", "engine.speculative", TEXT, SPECULATIVE_MODES[0],
       "`ngram`: speculative decoding with prompt-lookup drafts. While at most 4 sequences decode, each decode row "
       "also carries a guess at its next tokens, copied from where its last 2-3 tokens occurred earlier in its own "
       "prompt or output, and the step checks the guess; only tokens plain decoding would have produced are kept, so "
       "outputs, logprobs and seeds' draw positions are the same with and without it (tested). It pays where replies "
       "copy from the prompt (quoting, editing, code); on free text few drafts are right (bench/README.md, "
       "\"Speculative decoding\"). Guided requests are never drafted. `/metrics` reports drafted and kept tokens",
       "TRIOSERVE_SPECULATIVE", choices=SPECULATIVE_MODES),
    _o("--speculative-tokens", "engine.speculative_tokens", POSITIVE_INT, 4,
       "most draft tokens per sequence and step (also at most half of what the step budget leaves after the decode rows)",
       "TRIOSERVE_SPECULATIVE_TOKENS"),
    _o("--embedding-pooling", "engine.embedding_pooling", TEXT, EMBEDDING_POOLING[0],
       "how `/v1/embeddings` pools an input's final hidden states (after the last RMSNorm) into its vector: `mean` "
       "over all its tokens, or `last`, the last token's; either is then scaled to length 1; `auto`: what the model "
       "file declares (a GGUF's `pooling_type`, a sentence-transformers directory's pooling module: Qwen3-Embedding "
       "says `last`), else `mean` (docs/embeddings.md)",
       "TRIOSERVE_EMBEDDING_POOLING", choices=EMBEDDING_POOLING),
    _o("--lora", "loras", TEXT, (),
       "a LoRA adapter in PEFT's layout (a directory with `adapter_config.json` and `adapter_model.safetensors`) "
       "for the first model, served as model `NAME`; may be given several times (docs/models.md)",
       metavar="NAME=PATH", repeatable=True, shown_default="none"),
    _o("--max-loras", "engine.max_loras", POSITIVE_INT, 4,
       "LoRA adapters a model holds at once; rows of all of them and of the base model share each step", "TRIOSERVE_MAX_LORAS"),
    _o("--max-lora-rank", "engine.max_lora_rank", POSITIVE_INT, 64, "the highest rank an adapter may have", "TRIOSERVE_MAX_LORA_RANK"),
    _o("--record", "engine.record_dir", TEXT, None,
       "write every engine-core input and output of this run to a new trace file in DIR, for `trioserve replay` "
       "(docs/replay.md)", "TRIOSERVE_RECORD", metavar="DIR", flag_reads_env=True, shown_default="off"),
    _o("--reasoning-parser", "reasoning_parser", TEXT, "auto",
       "split `<think>…</think>` into `reasoning_content`: `on`, `off`, or `auto` (when the tokenizer has `<think>` "
       "as one token)", "TRIOSERVE_REASONING_PARSER", choices=REASONING_PARSERS),
    _o("--rerank-method", "rerank_method", TEXT, RERANK_METHODS[0],
       "how `/v1/rerank` and `/v1/score` score a query against a document: `embedding`, the cosine of their pooled "
       "embeddings (`--embedding-pooling`), or `yes-no`, the probability that the model answers \"yes\" rather than "
       "\"no\" when asked in its chat template whether the document meets the query, as Qwen3-Reranker-style models "
       "are used; `auto`: `yes-no` for a model whose file says it is a reranker (a GGUF with `pooling_type` rank), "
       "else `embedding` (docs/api.md, \"Rerank and score\")", "TRIOSERVE_RERANK_METHOD", choices=RERANK_METHODS),
    _o("--allow-special-in-prompt", "allow_special_in_prompt", SWITCH, False,
       "a `/v1/completions` text prompt that spells a special token (`<|im_start|>`) gets its id; off, it is "
       "tokenized as text like all client text (see api.md, \"Special tokens\")", "TRIOSERVE_ALLOW_SPECIAL_IN_PROMPT"),
    _o("--state-dir", "state_dir", TEXT, "auto",
       "where sessions and stored responses are kept across restarts (an SQLite file, `state.sqlite3`, in DIR): `auto` "
       "is the user's data directory (`$XDG_DATA_HOME/trioserve`, else `~/.local/share/trioserve`), `none` keeps them "
       "in memory only, as before (docs/sessions.md, \"Durability\")", "TRIOSERVE_STATE_DIR", metavar="DIR"),
    _o("--state-url", "state_url", STATE_URL, None,
       "keep sessions and stored responses in PostgreSQL instead of the `--state-dir` file "
       "(`postgresql://user:password@host:port/database`), shared by every replica given the same URL, so another "
       "replica continues a conversation whose replica is gone (docs/scaling.md)", "TRIOSERVE_STATE_URL", metavar="URL",
       shown_default="none (the --state-dir file)"),
    _o("--max-sessions", "max_sessions", POSITIVE_INT, 1024,
       "sessions kept at once; beyond it idle ones go, least recently used first", "TRIOSERVE_MAX_SESSIONS"),
    _o("--session-idle", "session_idle_s", SECONDS, 3600.0, "seconds an idle session is kept", "TRIOSERVE_SESSION_IDLE"),
    _o("--session-history-bytes", "session_history_bytes", BYTES, 64 * MIB,
       "total history text kept by all sessions; beyond it idle ones go", "TRIOSERVE_SESSION_HISTORY_BYTES"),
    _o("--api-key", "api_key", TEXT, (),
       "require `Authorization: Bearer KEY` (or `X-Api-Key: KEY`) on `/v1` routes and the metrics; may be given several "
       "times, each key a tenant of its own (docs/security.md)", "TRIOSERVE_API_KEY", repeatable=True, shown_default="none"),
    _o("--api-keys-file", "api_keys_file", TEXT, None,
       "API keys and their tenants, one `tenant: key` a line (a tenant may have several), read again on SIGHUP "
       "(docs/security.md)", "TRIOSERVE_API_KEYS_FILE", metavar="FILE", shown_default="none"),
    _o("--tenant-max-sessions", "tenant_max_sessions", POSITIVE_INT, None,
       "sessions, and stored responses, each tenant may keep; beyond it its own idle ones go (or, with none idle, a "
       "429)", "TRIOSERVE_TENANT_MAX_SESSIONS", shown_default="an even share of --max-sessions"),
    _o("--tenant-history-bytes", "tenant_history_bytes", BYTES, None,
       "history and stored-response bytes each tenant may keep; beyond it its own idle ones go",
       "TRIOSERVE_TENANT_HISTORY_BYTES", shown_default="an even share of --session-history-bytes"),
    _o("--tenant-max-in-flight", "tenant_max_in_flight", POSITIVE_INT, None,
       "requests one tenant may have running at once; more are refused with 429 and `Retry-After`",
       "TRIOSERVE_TENANT_MAX_IN_FLIGHT", shown_default="no limit"),
    _o("--prefix-cache-scope", "prefix_cache_scope", TEXT, "auto",
       "who shares prefix-cache blocks: `tenant` salts the cache's hashes with the API key's tenant, so one tenant "
       "never hits, times or counts another's; `global` shares them between all; `auto` is `tenant` when API keys are "
       "set (docs/security.md)", "TRIOSERVE_PREFIX_CACHE_SCOPE", choices=PREFIX_CACHE_SCOPES),
    _o("--metrics-public", "metrics_public", SWITCH, False,
       "serve `/metrics` and `/metrics/prometheus` without an API key even when keys are set",
       "TRIOSERVE_METRICS_PUBLIC"),
    _o("--cors-origins", "cors_origins", TEXT, None,
       "web origins (comma-separated, or `*`) whose pages may call the API from a browser; none: no CORS headers, so "
       "only same-origin pages (the chat page at `/`) can", "TRIOSERVE_CORS_ORIGINS", shown_default="none"),
    _o("--admin-api-key", "admin_api_key", TEXT, None,
       "turns on the `/admin/models` routes (load and unload models at run time), which then need "
       "`Authorization: Bearer KEY`; without it they are off (docs/models.md)", "TRIOSERVE_ADMIN_API_KEY", shown_default="none (off)"),
    _o("--memory-budget", "memory_budget", BYTES, None,
       "most memory the served models may take together, each counted as its weights file plus its KV pool "
       "(`--kv-cache-bytes`); a load that would pass it is refused with the numbers (docs/models.md)",
       "TRIOSERVE_MEMORY_BUDGET", shown_default="none"),
    _o("--max-body-bytes", "max_body_bytes", BYTES, 4 * MIB, "larger request bodies get 413", "TRIOSERVE_MAX_BODY_BYTES"),
    _o("--max-request-tokens", "max_request_tokens", POSITIVE_INT, 131072,
       "most prompt tokens one request may bring, counted together once tokenized: every prompt of `/v1/completions`, "
       "or the rendered prompt of a chat, messages, responses or session turn, times `n`; all inputs of "
       "`/v1/embeddings`; the query and documents of `/v1/rerank` and `/v1/score` as they are scored. More is a 400 "
       "naming the field, with the count, before the engine sees any of it. The default is 16 contexts of the default "
       "model (8192 tokens each): a full-context chat prompt with `n` 16, the most `n` may be, still fits. Lower it to "
       "bound the prefill one request can ask of a slow CPU (docs/security.md)", "TRIOSERVE_MAX_REQUEST_TOKENS"),
    _o("--drain-timeout", "drain_timeout_s", SECONDS, 30.0, "seconds in-flight requests get after SIGINT/SIGTERM", "TRIOSERVE_DRAIN_TIMEOUT"),
    _o("--write-timeout", "write_timeout_s", SECONDS, 30.0,
       "seconds one response write may stall (a client that stopped reading) before the connection is closed and its "
       "request cancelled", "TRIOSERVE_WRITE_TIMEOUT"),
    _o("--keep-alive-timeout", "keep_alive_timeout_s", SECONDS, 5.0,
       "seconds a kept-alive connection may sit idle (or spend sending the head of its next request) before it is closed",
       "TRIOSERVE_KEEP_ALIVE_TIMEOUT"),
    _o("--read-timeout", "read_timeout_s", SECONDS, 30.0,
       "seconds a client may stay silent while its request body is still due before the connection is closed", "TRIOSERVE_READ_TIMEOUT"),
    _o("--send-buffer-bytes", "send_buffer_bytes", BYTES_OR_AUTO, 64 * 1024,
       "kernel send buffer of each connection (`auto`: the kernel's autotuning, up to megabytes); how much output a "
       "client that stopped reading can hold back before the write timeout starts counting", "TRIOSERVE_SEND_BUFFER_BYTES"),
    _o("--default-max-tokens", "default_max_tokens", POSITIVE_INT, 2048,
       "`max_tokens` of a request that sends none (never more than the rest of the context or what the KV pool holds "
       "beside the prompt)", "TRIOSERVE_DEFAULT_MAX_TOKENS"),
    _o("--log-level", "log_level", TEXT, "info", "hypercorn's log level", choices=LOG_LEVELS),
    _o("--threads", None, POSITIVE_INT, None,
       "CPU threads (torch and the C kernels); the default is the affinity mask (`taskset`, cpusets, container "
       "limits), not the machine's count", shown_default="the cores this process may run on"),
)  # fmt: skip

_BY_FIELD = {opt.field: opt for opt in OPTIONS if opt.field}


def option(field: str) -> Option:
    """The option that fills ``field`` ("engine.kernels", "api_key")."""
    return _BY_FIELD[field]


def check_choice(field: str, value: object) -> None:
    """ValueError, naming the field, when ``value`` is not one of the choices
    of the option that fills ``field``."""
    opt = option(field)
    problem = choice_problem(opt.choices or (), value)
    if problem:
        raise ValueError(f"{opt.name} {problem}")


UNSET = object()  # what env_value gives for a variable that is not set


def env_value(opt: Option, environ: Mapping[str, str]) -> Any:
    """The value $opt.env gives, or UNSET where it is unset or empty; a bad
    value is a ValueError naming the variable."""
    text = environ.get(opt.env) if opt.env else None
    if not text:
        return UNSET
    try:
        return opt.parse_variable(text)
    except ValueError as exc:
        raise ValueError(f"{opt.env}: {exc}") from None


def flag_or_env(opt: Option, given: Any, environ: Mapping[str, str]) -> Any:
    """A flag's value when given (not None), else its variable's, else the default."""
    if given is not None:
        return given
    value = env_value(opt, environ)
    return opt.default if value is UNSET else value


# -- the docs' table ----------------------------------------------------------------


def shown_default(opt: Option) -> str:
    """The default as the docs' table says it (markdown)."""
    if opt.shown_default is not None:
        return opt.shown_default
    value = opt.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if opt.kind in (BYTES, BYTES_OR_AUTO):
        return f"`{_size_text(value)}`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def _size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)



def _flag_cell(opt: Option) -> str:
    if opt.negatable:
        return f"`{opt.flag}` / `--no-{opt.flag.removeprefix('--')}`"
    return f"`{opt.flag} {opt.metavar}`" if opt.metavar else f"`{opt.flag}`"


def _variable_cell(opt: Option) -> str:
    """The variable; for a one-way switch, with the value its flag stands for."""
    if opt.env is None:
        return ""
    if opt.kind is SWITCH and not opt.negatable:
        return f"`{opt.env}={'false' if opt.switches_off else 'true'}`"
    return f"`{opt.env}`"


def markdown_table(options: Sequence[Option] = OPTIONS) -> str:
    """The options table of docs/configuration.md, one row per option."""
    rows = ["| option | variable | default | meaning |", "|---|---|---|---|"]
    for opt in options:
        cells = (_flag_cell(opt), _variable_cell(opt), shown_default(opt), opt.help.replace("|", "\\|"))
        rows.append("|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|")
    return "\n".join(rows) + "\n"


BEGIN = "<!-- options: made by `python -m trioserve.options --write docs/configuration.md`; edit trioserve/options.py, not this table -->"
END = "<!-- end of options -->"


def with_table(document: str) -> str:
    """``document`` with what stands between BEGIN and END replaced by the
    table; ValueError when the markers are missing."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.DOTALL)
    if not pattern.search(document):
        raise ValueError(f"no {BEGIN!r} ... {END!r} markers")
    return pattern.sub(lambda _: f"{BEGIN}\n{markdown_table()}{END}", document, count=1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trioserve.options", description="the options table of docs/configuration.md")
    parser.add_argument("--markdown", action="store_true", help="print the table")
    parser.add_argument("--write", metavar="PATH", help="rewrite the table between the markers of PATH")
    args = parser.parse_args(argv)
    if args.write:
        with open(args.write, encoding="utf-8") as f:
            text = f.read()
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(with_table(text))
    if args.markdown or not args.write:
        sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
