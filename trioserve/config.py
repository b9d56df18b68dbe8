"""Settings, as frozen attrs records. Validation happens here, once, so every
later component can trust the numbers. Each option's default, choices and
TRIOSERVE_* variable are declared once, in trioserve/options.py; the fields
below take them from there."""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from trioserve.option_kinds import parse_byte_size, parse_size_or_auto, split_model  # named here too, where callers look for them
from trioserve.option_kinds import parse_flag as _flag
from trioserve.options import (  # the choices are named here too, where callers look for them
    ACTIVATION_CHOICES,
    DTYPE_NAMES,
    EMBEDDING_POOLING,
    KERNEL_CHOICES,
    KV_CACHE_DTYPES,
    MIB,
    OPTIONS,
    SPECULATIVE_MODES,
    UNSET,
    check_choice,
    env_value,
    flag_or_env,
    option,
)

__all__ = [
    "ACTIVATION_CHOICES", "DTYPE_NAMES", "EMBEDDING_POOLING", "KERNEL_CHOICES", "KV_CACHE_DTYPES", "MIB", "SPECULATIVE_MODES",
    "EngineConfig", "ServerSettings", "check_choice", "parse_byte_size", "parse_size_or_auto", "settings_from_env",
    "activations_setting", "batch_invariant_setting", "kernels_setting", "kv_cache_dtype_setting", "kv_huge_pages_setting",
    "CPU_FEATURES_ENV", "CPU_FEATURE_LEVELS", "cpu_features_setting", "NATIVE_KERNELS_ENV", "native_kernels_setting",
]  # fmt: skip


def _positive(instance, attribute, value) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _milliseconds(instance, attribute, value) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a number of milliseconds, 0 or more, got {value!r}")


def _seconds(instance, attribute, value) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


def _setting(field: str, validator=None, converter=None):
    """The attrs field of option ``field`` (trioserve/options.py): its
    default, a check of its choices where it has some, then ``validator``;
    the option rides along as the field's metadata["option"]."""
    opt = option(field)
    checks = [validator] if validator else []
    if opt.choices:
        checks.insert(0, lambda instance, attribute, value: check_choice(field, value))
    return attrs.field(default=opt.default, validator=checks or None, converter=converter, metadata={"option": opt})


@attrs.frozen
class EngineConfig:
    """What the engine serves and its limits.

    max_num_seqs: sequences decoded together (rows of a step).
    max_model_len: longest prompt + output; None = the model's context length.
    kv_cache_bytes: memory for the KV block pool (resident as it is used).
    kv_cache_dtype: the pool's dtype: "auto" (the weights'), "float32" or
    "bfloat16" (a float32 model on a CPU may keep a bf16 pool: half the
    memory and half the bytes attention reads; docs/kernels.md).
    kv_huge_pages: the pool on transparent huge pages: attention reads
    scattered blocks faster, but the first request makes the whole pool
    resident (kernels/memory.py).
    prefill_budget: tokens per step, decode rows and prefill chunks together.
    max_step_ms: the time a step that carries decode rows is planned to take
    at most: its prompt chunks shrink to fit, by what recent steps took, so
    decoding streams do not wait seconds for a long prompt's chunk on a slow
    CPU (0: off, chunks up to prefill_budget; state/scheduling.py).
    max_queue: requests waiting for admission before new ones get QueueFull.
    channel_size: bound of each actor's inbox.
    prefix_cache: share KV blocks of identical prompt prefixes; idle cached
    blocks are evicted LRU when admission needs room, beyond
    prefix_cache_max_blocks or prefix_cache_max_bytes (whichever is
    fewer blocks), or after prefix_cache_idle_s without use. Blocks that
    sessions keep pinned are outside these limits.
    record_dir: a directory where each run writes one trace file of every
    input to the engine core, for `trioserve replay` (docs/replay.md).
    batch_invariant: a request's logits are bit-identical whatever else
    shares its steps and however its prompt is chunked (docs/determinism.md);
    off runs the faster batch-dependent arithmetic.
    embedding_pooling: how /v1/embeddings pools a prompt's final hidden
    states: "mean" over its tokens, or its "last" token's (docs/embeddings.md).
    kernels: which implementation runs each operation of the forward pass:
    "auto" (Triton on CUDA, the C kernels on a CPU where they build, torch
    elsewhere), "reference" (torch) or "triton" (docs/kernels.md).
    activations: how generated tokens' 4-bit projections take their inputs:
    "bf16" (exact products) or "int8" (rounded to 8 bits per block of 32
    and multiplied in integers, llama.cpp's arithmetic for these blocks:
    ~1.7x faster projections at 32 rows, greedy replies further from the
    exact model's; needs AVX-512 VNNI, AVX2 or NEON dotprod; docs/kernels.md)."""

    model: str = _setting("engine.model")
    dtype: str = _setting("engine.dtype")
    device: str = _setting("engine.device")
    use_int4: bool = True
    batch_invariant: bool = _setting("engine.batch_invariant")
    max_num_seqs: int = _setting("engine.max_num_seqs", _positive)
    max_model_len: int | None = _setting("engine.max_model_len", _positive)
    kv_cache_bytes: int = _setting("engine.kv_cache_bytes", _positive)
    kv_huge_pages: bool = _setting("engine.kv_huge_pages")
    kv_cache_dtype: str = _setting("engine.kv_cache_dtype")
    block_size: int = attrs.field(default=16, validator=_positive)
    prefill_budget: int = _setting("engine.prefill_budget", _positive)
    max_step_ms: float = _setting("engine.max_step_ms", _milliseconds)
    max_queue: int = _setting("engine.max_queue", _positive)
    channel_size: int = attrs.field(default=64, validator=_positive)
    retry_after_s: float = 1.0
    prefix_cache: bool = _setting("engine.prefix_cache")
    prefix_cache_max_blocks: int | None = _setting("engine.prefix_cache_max_blocks", _positive)
    prefix_cache_max_bytes: int | None = _setting("engine.prefix_cache_max_bytes", _positive)
    prefix_cache_idle_s: float | None = _setting("engine.prefix_cache_idle_s", _positive)
    record_dir: str | None = _setting("engine.record_dir")  # write a trace of the run there (docs/replay.md)
    # Speculative decoding: "off", or "ngram" (prompt-lookup drafts of up to
    # speculative_tokens tokens, checked in the same step; outputs unchanged).
    speculative: str = _setting("engine.speculative")
    speculative_tokens: int = _setting("engine.speculative_tokens", _positive)
    embedding_pooling: str = _setting("engine.embedding_pooling")
    kernels: str = _setting("engine.kernels")
    activations: str = _setting("engine.activations")
    max_loras: int = _setting("engine.max_loras", _positive)
    max_lora_rank: int = _setting("engine.max_lora_rank", _positive)

    @property
    def draft_tokens(self) -> int:
        """Draft tokens per decode row the core plans (0: off)."""
        return self.speculative_tokens if self.speculative == "ngram" else 0

    def __attrs_post_init__(self) -> None:
        if self.prefill_budget <= self.max_num_seqs:
            raise ValueError(
                f"prefill_budget ({self.prefill_budget}) must exceed max_num_seqs ({self.max_num_seqs}) "
                "so prefill can progress while every row decodes"
            )


@attrs.frozen
class ServerSettings:
    """The HTTP server around an engine.

    served_model_name: the model id clients send and see (default: the
    checkpoint's name). api_key: when set, every /v1 route needs
    `Authorization: Bearer <key>`. max_body_bytes: larger bodies get 413.
    max_request_tokens: the most prompt tokens one request brings, all its
    prompts (times n) or inputs counted together; more is a 400.
    drain_timeout_s: on SIGINT/SIGTERM, how long in-flight requests may run.
    write_timeout_s: a response write that does not complete in this time
    (a client that stopped reading) closes the connection, which cancels
    the request.
    keep_alive_timeout_s: a connection with no request under way (idle, or
    its next request's head not yet complete) is closed after this long.
    read_timeout_s: while a request body is still arriving, the connection
    is closed when the client sends nothing for this long.
    send_buffer_bytes: the kernel send buffer of each connection
    (SO_SNDBUF); it bounds how much a client that stopped reading can have
    buffered before writes stall and the write timeout starts counting.
    None leaves the kernel's autotuning (up to megabytes per connection).
    default_max_tokens: the cap on max_tokens for requests that send none
    (they also never reserve more than the rest of the context or the pool).
    allow_special_in_prompt: /v1/completions prompts given as text may spell
    special tokens ("<|im_start|>") and get their ids; off, such text is
    tokenized as text, like all text a client sends.
    reasoning_parser: split <think>...</think> into reasoning_content: "on",
    "off", or "auto" (on when the tokenizer has <think> as one token).
    rerank_method: how /v1/rerank and /v1/score score a pair of texts:
    "embedding" (cosine of pooled embeddings) or "yes-no" (P(yes) of the
    model's one-token answer, asked through its chat template)."""

    engine: EngineConfig = EngineConfig()
    host: str = _setting("host")
    port: int = _setting("port")
    served_model_name: str | None = _setting("served_model_name")
    api_key: tuple[str, ...] = _setting("api_key", converter=lambda keys: (keys,) if isinstance(keys, str) else tuple(keys or ()))
    api_keys_file: str | None = _setting("api_keys_file")
    tenant_max_sessions: int | None = _setting("tenant_max_sessions", _positive)
    tenant_history_bytes: int | None = _setting("tenant_history_bytes", _positive)
    tenant_max_in_flight: int | None = _setting("tenant_max_in_flight", _positive)
    prefix_cache_scope: str = _setting("prefix_cache_scope")
    metrics_public: bool = _setting("metrics_public")
    cors_origins: str | None = _setting("cors_origins")
    max_body_bytes: int = _setting("max_body_bytes", _positive)
    max_request_tokens: int = _setting("max_request_tokens", _positive)
    drain_timeout_s: float = _setting("drain_timeout_s", _seconds)
    write_timeout_s: float = _setting("write_timeout_s", _seconds)
    keep_alive_timeout_s: float = _setting("keep_alive_timeout_s", _seconds)
    read_timeout_s: float = _setting("read_timeout_s", _seconds)
    send_buffer_bytes: int | None = _setting("send_buffer_bytes", _positive)
    default_max_tokens: int = _setting("default_max_tokens", _positive)
    state_dir: str = _setting("state_dir")
    state_url: str | None = _setting("state_url")
    max_sessions: int = _setting("max_sessions", _positive)
    session_idle_s: float | None = _setting("session_idle_s", _positive)
    session_history_bytes: int | None = _setting("session_history_bytes", _positive)
    reasoning_parser: str = _setting("reasoning_parser")
    rerank_method: str = _setting("rerank_method")
    allow_special_in_prompt: bool = _setting("allow_special_in_prompt")
    log_level: str = _setting("log_level")
    admin_api_key: str | None = _setting("admin_api_key")
    memory_budget: int | None = _setting("memory_budget", _positive)
    # Further models, (name, path) each, served beside the first on engines
    # of their own with the first's engine settings (docs/models.md).
    more_models: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=lambda pairs: tuple(tuple(p) for p in pairs))
    # LoRA adapters loaded at start for the first model, (name, path) each (--lora NAME=PATH).
    loras: tuple[tuple[str, str], ...] = _setting("loras", converter=lambda pairs: tuple(tuple(p) for p in pairs))

    @property
    def model_name(self) -> str:
        """The first model's name."""
        return self.served_model_name or self.engine.model

    def models(self) -> tuple[tuple[str, EngineConfig], ...]:
        """Every model served from the start: (name, its engine's config)."""
        more = ((name, attrs.evolve(self.engine, model=path)) for name, path in self.more_models)
        return ((self.model_name, self.engine), *more)

    def __attrs_post_init__(self) -> None:
        seen: set[str] = set()
        for name, _ in self.models():
            if not name:
                raise ValueError("a model name may not be empty")
            if name in seen:
                raise ValueError(f"the model name {name!r} is given twice (name them with --model NAME=PATH)")
            seen.add(name)


def _flag_or_env(field: str, flag, environ: Mapping[str, str]):
    """A `serve` flag's value when given (not None), else its variable's,
    else the option's default; a bad variable is a ValueError naming it."""
    return flag_or_env(option(field), flag, environ)


def batch_invariant_setting(flag: bool | None, environ: Mapping[str, str]) -> bool:
    """--batch-invariant / --no-batch-invariant when given, else
    $TRIOSERVE_BATCH_INVARIANT, else on."""
    return _flag_or_env("engine.batch_invariant", flag, environ)


def kv_huge_pages_setting(flag: bool | None, environ: Mapping[str, str]) -> bool:
    """--kv-huge-pages when given, else $TRIOSERVE_KV_HUGE_PAGES, else off."""
    return _flag_or_env("engine.kv_huge_pages", flag, environ)


def kernels_setting(environ: Mapping[str, str]) -> str:
    """$TRIOSERVE_KERNELS, or the default; a bad value is a ValueError naming it."""
    return _flag_or_env("engine.kernels", None, environ)


def kv_cache_dtype_setting(environ: Mapping[str, str]) -> str:
    """$TRIOSERVE_KV_CACHE_DTYPE, or the default; a bad value is a ValueError naming it."""
    return _flag_or_env("engine.kv_cache_dtype", None, environ)


def activations_setting(environ: Mapping[str, str]) -> str:
    """$TRIOSERVE_ACTIVATIONS, or the default; a bad value is a ValueError naming it."""
    return _flag_or_env("engine.activations", None, environ)


NATIVE_KERNELS_ENV = "TRIOSERVE_NATIVE_KERNELS"


def native_kernels_setting(environ: Mapping[str, str]) -> bool:
    """$TRIOSERVE_NATIVE_KERNELS: unset or true builds the CPU's C kernels
    (kernels/native.py), false chooses the torch reference; anything else
    is a ValueError naming the variable (the CLI checks it first)."""
    text = environ.get(NATIVE_KERNELS_ENV)
    if text is None:
        return True
    try:
        return _flag(text)
    except ValueError as exc:
        raise ValueError(f"{NATIVE_KERNELS_ENV}: {exc}") from None


CPU_FEATURES_ENV = "TRIOSERVE_CPU_FEATURES"
# The instruction-set levels the C kernels can be built for (kernels/native_build.py
# `LEVELS` has each one's compiler flags): "native" is everything this CPU has.
CPU_FEATURE_LEVELS = ("native", "avx2-vnni", "avx2", "generic")


def cpu_features_setting(environ: Mapping[str, str]) -> str:
    """$TRIOSERVE_CPU_FEATURES: the instruction-set level the C kernels are
    built for, one of CPU_FEATURE_LEVELS (unset: native). A narrower level
    runs the kernels a CPU without the wider instructions would (for tests,
    and for an operator comparing paths); anything else is a ValueError
    naming the variable (the CLI checks it first)."""
    text = environ.get(CPU_FEATURES_ENV)
    if text is None or text == "":
        return "native"
    if text not in CPU_FEATURE_LEVELS:
        raise ValueError(f"{CPU_FEATURES_ENV}: must be one of {', '.join(CPU_FEATURE_LEVELS)}, got {text!r}")
    return text


def settings_from_env(environ: dict[str, str]) -> ServerSettings:
    """ServerSettings from TRIOSERVE_* variables (for `hypercorn -k trio
    'trioserve.http.app:create_app()'`). A bad value is a ValueError naming
    the variable."""
    native_kernels_setting(environ)  # read by kernels/native_build.py; a bad value stops here, by name
    engine: dict = {}
    server: dict = {}
    for opt in OPTIONS:  # those with a variable (trioserve/options.py); unset or empty ones are left to the default
        value = env_value(opt, environ)
        if value is not UNSET:
            (engine if opt.field.startswith("engine.") else server)[opt.name] = value
    if "model" in engine:
        name, engine["model"] = split_model(engine["model"])
        server.setdefault("served_model_name", name)
    try:
        return ServerSettings(engine=EngineConfig(**engine), **server)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"TRIOSERVE_* settings: {exc}") from None
