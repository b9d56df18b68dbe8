"""Settings, as frozen attrs records. Validation happens here, once, so every
later component can trust the numbers."""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

MIB = 1 << 20
# --dtype values; "auto" is bfloat16 (trioserve.kernels.cpu.DTYPES maps them to torch).
DTYPE_NAMES = ("auto", "bfloat16", "float32", "float16")


def _positive(instance, attribute, value) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _milliseconds(instance, attribute, value) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a number of milliseconds, 0 or more, got {value!r}")


def _seconds(instance, attribute, value) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


SPECULATIVE_MODES = ("off", "ngram")
KERNEL_CHOICES = ("auto", "reference", "triton")  # the first is the default (kernels/ops.py)
# How the 4-bit projections take their inputs (kernels/ops.py
# `select_kernels`, kernels/int4.py `Projection`): bf16, or int8 per block of
# 32 (faster, less exact: docs/kernels.md); auto is int8 where its C kernel
# runs (AVX-512 VNNI), else bf16. The first is the default.
ACTIVATION_CHOICES = ("auto", "bf16", "int8")
# The KV pool's dtype: auto is the weights'; a float32 model on a CPU may keep a bfloat16 pool.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
EMBEDDING_POOLING = ("mean", "last")  # the first is the default (trioserve.types.POOLING_MODES holds both)


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

    model: str = "smollm2"
    dtype: str = "auto"
    device: str = "cpu"
    use_int4: bool = True
    batch_invariant: bool = True
    max_num_seqs: int = attrs.field(default=32, validator=_positive)
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    kv_cache_bytes: int = attrs.field(default=512 * MIB, validator=_positive)
    kv_huge_pages: bool = False
    kv_cache_dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(KV_CACHE_DTYPES))
    block_size: int = attrs.field(default=16, validator=_positive)
    prefill_budget: int = attrs.field(default=512, validator=_positive)
    max_step_ms: float = attrs.field(default=0.0, validator=_milliseconds)
    max_queue: int = attrs.field(default=256, validator=_positive)
    channel_size: int = attrs.field(default=64, validator=_positive)
    retry_after_s: float = 1.0
    prefix_cache: bool = True
    prefix_cache_max_blocks: int | None = attrs.field(default=None, validator=_positive)
    prefix_cache_max_bytes: int | None = attrs.field(default=None, validator=_positive)
    prefix_cache_idle_s: float | None = attrs.field(default=None, validator=_positive)
    record_dir: str | None = None  # write a trace of the run there (docs/replay.md)
    # Speculative decoding: "off", or "ngram" (prompt-lookup drafts of up to
    # speculative_tokens tokens, checked in the same step; outputs unchanged).
    speculative: str = attrs.field(default="off", validator=attrs.validators.in_(SPECULATIVE_MODES))
    speculative_tokens: int = attrs.field(default=4, validator=_positive)
    embedding_pooling: str = attrs.field(default=EMBEDDING_POOLING[0], validator=attrs.validators.in_(EMBEDDING_POOLING))
    kernels: str = attrs.field(default=KERNEL_CHOICES[0], validator=attrs.validators.in_(KERNEL_CHOICES))
    activations: str = attrs.field(default=ACTIVATION_CHOICES[0], validator=attrs.validators.in_(ACTIVATION_CHOICES))

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
    "off", or "auto" (on when the tokenizer has <think> as one token)."""

    engine: EngineConfig = EngineConfig()
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = attrs.field(default=4 * MIB, validator=_positive)
    drain_timeout_s: float = attrs.field(default=30.0, validator=_seconds)
    write_timeout_s: float = attrs.field(default=30.0, validator=_seconds)
    keep_alive_timeout_s: float = attrs.field(default=5.0, validator=_seconds)
    read_timeout_s: float = attrs.field(default=30.0, validator=_seconds)
    send_buffer_bytes: int | None = attrs.field(default=64 * 1024, validator=_positive)
    default_max_tokens: int = attrs.field(default=2048, validator=_positive)
    max_sessions: int = attrs.field(default=1024, validator=_positive)
    session_idle_s: float | None = attrs.field(default=3600.0, validator=_positive)
    session_history_bytes: int | None = attrs.field(default=64 * MIB, validator=_positive)
    reasoning_parser: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "on", "off")))
    allow_special_in_prompt: bool = False
    log_level: str = "info"


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def parse_byte_size(text: str) -> int:
    """'512MiB', '2GiB', '1000000' -> bytes; ValueError otherwise."""
    number = text.strip().rstrip("BbKkMmGgIi")
    unit = text.strip()[len(number) :].lower()
    try:
        value = int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"must be a size like 512MiB or 2GiB, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"must be positive, got {text!r}")
    return value


def parse_size_or_auto(text: str) -> int | None:
    """'auto' -> None (the kernel's choice); otherwise parse_byte_size."""
    return None if text.strip().lower() == "auto" else parse_byte_size(text)


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {text!r}")


def batch_invariant_setting(flag: bool | None, environ: dict[str, str]) -> bool:
    """--batch-invariant / --no-batch-invariant when given, else
    $TRIOSERVE_BATCH_INVARIANT, else on."""
    return _flag_setting(flag, environ, "TRIOSERVE_BATCH_INVARIANT", attrs.fields(EngineConfig).batch_invariant.default)


def kv_huge_pages_setting(flag: bool | None, environ: dict[str, str]) -> bool:
    """--kv-huge-pages when given, else $TRIOSERVE_KV_HUGE_PAGES, else off."""
    return _flag_setting(flag, environ, "TRIOSERVE_KV_HUGE_PAGES", attrs.fields(EngineConfig).kv_huge_pages.default)


def _flag_setting(flag: bool | None, environ: dict[str, str], var: str, default: bool) -> bool:
    if flag is not None:
        return flag
    text = environ.get(var)
    if text is None:
        return default
    try:
        return _flag(text)
    except ValueError as exc:
        raise ValueError(f"{var}: {exc}") from None


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
# The instruction-set levels the C kernels can be built for (kernels/native.py
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


def _one_of(choices: tuple[str, ...]):
    """A parser of a variable that must be one of ``choices``."""

    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


_speculative, _kernels, _pooling = _one_of(SPECULATIVE_MODES), _one_of(KERNEL_CHOICES), _one_of(EMBEDDING_POOLING)
_activations, _kv_dtype = _one_of(ACTIVATION_CHOICES), _one_of(KV_CACHE_DTYPES)


def _choice_setting(environ: Mapping[str, str], var: str, choices: tuple[str, ...]) -> str:
    """$var, one of ``choices``, or the first of them when unset; a bad
    value is a ValueError naming the variable."""
    text = environ.get(var)
    if not text:
        return choices[0]
    try:
        return _one_of(choices)(text)
    except ValueError as exc:
        raise ValueError(f"{var}: {exc}") from None


def kernels_setting(environ: Mapping[str, str]) -> str:
    """$TRIOSERVE_KERNELS, or the default; a bad value is a ValueError naming it."""
    return _choice_setting(environ, "TRIOSERVE_KERNELS", KERNEL_CHOICES)


def kv_cache_dtype_setting(environ: Mapping[str, str]) -> str:
    """$TRIOSERVE_KV_CACHE_DTYPE, or the default; a bad value is a ValueError naming it."""
    return _choice_setting(environ, "TRIOSERVE_KV_CACHE_DTYPE", KV_CACHE_DTYPES)


def activations_setting(environ: Mapping[str, str]) -> str:
    """$TRIOSERVE_ACTIVATIONS, or the default; a bad value is a ValueError naming it."""
    return _choice_setting(environ, "TRIOSERVE_ACTIVATIONS", ACTIVATION_CHOICES)


# TRIOSERVE_* variable -> (settings field, parser); engine fields are prefixed "engine.".
_ENV = {
    "TRIOSERVE_MODEL": ("engine.model", str),
    "TRIOSERVE_DTYPE": ("engine.dtype", str),
    "TRIOSERVE_DEVICE": ("engine.device", str),
    "TRIOSERVE_MAX_NUM_SEQS": ("engine.max_num_seqs", int),
    "TRIOSERVE_MAX_MODEL_LEN": ("engine.max_model_len", int),
    "TRIOSERVE_KV_CACHE_BYTES": ("engine.kv_cache_bytes", parse_byte_size),
    "TRIOSERVE_KV_HUGE_PAGES": ("engine.kv_huge_pages", _flag),
    "TRIOSERVE_KV_CACHE_DTYPE": ("engine.kv_cache_dtype", _kv_dtype),
    "TRIOSERVE_MAX_QUEUE": ("engine.max_queue", int),
    "TRIOSERVE_PREFILL_BUDGET": ("engine.prefill_budget", int),
    "TRIOSERVE_MAX_STEP_MS": ("engine.max_step_ms", float),
    "TRIOSERVE_PREFIX_CACHE": ("engine.prefix_cache", _flag),
    "TRIOSERVE_PREFIX_CACHE_MAX_BLOCKS": ("engine.prefix_cache_max_blocks", int),
    "TRIOSERVE_PREFIX_CACHE_BYTES": ("engine.prefix_cache_max_bytes", parse_byte_size),
    "TRIOSERVE_PREFIX_CACHE_IDLE": ("engine.prefix_cache_idle_s", float),
    "TRIOSERVE_RECORD": ("engine.record_dir", str),
    "TRIOSERVE_BATCH_INVARIANT": ("engine.batch_invariant", _flag),
    "TRIOSERVE_SPECULATIVE": ("engine.speculative", _speculative),
    "TRIOSERVE_SPECULATIVE_TOKENS": ("engine.speculative_tokens", int),
    "TRIOSERVE_EMBEDDING_POOLING": ("engine.embedding_pooling", _pooling),
    "TRIOSERVE_KERNELS": ("engine.kernels", _kernels),
    "TRIOSERVE_ACTIVATIONS": ("engine.activations", _activations),
    "TRIOSERVE_SERVED_MODEL_NAME": ("served_model_name", str),
    "TRIOSERVE_API_KEY": ("api_key", str),
    "TRIOSERVE_MAX_BODY_BYTES": ("max_body_bytes", parse_byte_size),
    "TRIOSERVE_DRAIN_TIMEOUT": ("drain_timeout_s", float),
    "TRIOSERVE_WRITE_TIMEOUT": ("write_timeout_s", float),
    "TRIOSERVE_KEEP_ALIVE_TIMEOUT": ("keep_alive_timeout_s", float),
    "TRIOSERVE_READ_TIMEOUT": ("read_timeout_s", float),
    "TRIOSERVE_SEND_BUFFER_BYTES": ("send_buffer_bytes", parse_size_or_auto),
    "TRIOSERVE_DEFAULT_MAX_TOKENS": ("default_max_tokens", int),
    "TRIOSERVE_MAX_SESSIONS": ("max_sessions", int),
    "TRIOSERVE_REASONING_PARSER": ("reasoning_parser", str),
    "TRIOSERVE_ALLOW_SPECIAL_IN_PROMPT": ("allow_special_in_prompt", _flag),
    "TRIOSERVE_SESSION_IDLE": ("session_idle_s", float),
    "TRIOSERVE_SESSION_HISTORY_BYTES": ("session_history_bytes", parse_byte_size),
}


def settings_from_env(environ: dict[str, str]) -> ServerSettings:
    """ServerSettings from TRIOSERVE_* variables (for `hypercorn -k trio
    'trioserve.http.app:create_app()'`). A bad value is a ValueError naming
    the variable."""
    native_kernels_setting(environ)  # read by kernels/native.py; a bad value stops here, by name
    engine: dict = {}
    server: dict = {}
    for var, (field, parse) in _ENV.items():
        if var not in environ:
            continue
        try:
            value = parse(environ[var])
        except ValueError as exc:
            raise ValueError(f"{var}: {exc}") from None
        if field.startswith("engine."):
            engine[field.removeprefix("engine.")] = value
        else:
            server[field] = value
    try:
        return ServerSettings(engine=EngineConfig(**engine), **server)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"TRIOSERVE_* settings: {exc}") from None
