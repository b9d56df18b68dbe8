"""ModelConfig: the shape of a decoder of any family (models/family.py),
read from GGUF metadata or a Hugging Face config.json: the settings every
family has, and the ones some families add (a sliding window, a local RoPE
base, query and embedding scales, logit soft-capping), each read by the
family's own settings function. Plain data; no torch."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from trioserve.errors import CheckpointError

from trioserve.models.family import Reader, family_for_gguf, family_for_hf, supported_gguf, supported_hf


@attrs.frozen
class RopeScaling:
    """How rotary frequencies are stretched for long contexts.

    kind: "none", "linear" (positions divided by factor) or "llama3"
    (low frequencies divided by factor, high ones kept, a smooth band between)."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


# Bounds on a checkpoint's settings, checked before anything is made from
# them. Generous: the longest published context is ~10M positions (Llama 4
# Scout), the deepest decoders have a few hundred layers.
MAX_CONTEXT = 1 << 24
MAX_LAYERS = 4096


class BadSetting(ValueError):
    """A ModelConfig field with a value no model has; ``field`` is the
    attribute's name (the loaders say which key of the file set it)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(problem)


@attrs.frozen
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling = RopeScaling()
    # What some families add (models/family.py); the defaults are a Llama's.
    sliding_window: int | None = None  # the window of a family's sliding-window layers
    rope_local_theta: float | None = None  # the RoPE base of a family's local (sliding-window) layers
    query_scale: float | None = None  # what q.k is multiplied by; None: 1/sqrt(head_dim)
    embed_scale: float = 1.0  # what the embedding rows are multiplied by (Gemma: sqrt(hidden))
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    layer_types: tuple[str, ...] | None = None  # per layer, "full_attention" or "sliding_attention", where the file lists them
    # What the file says the model is for, where it says: how its embeddings pool (mean, cls, last),
    # or "rank" (a reranker: P("yes") at the last token), and its reranking prompt ({query}, {document}).
    pooling: str | None = None
    rerank_template: str | None = None
    # An encoder's: a classification head's outputs (a cross-encoder reranker: 1), 0 for none;
    # where its position ids start (RoBERTa's: 2, after the padding id).
    num_labels: int = 0
    position_offset: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadSetting(name, f"is {value!r}, not a whole number of at least 1")
        if self.num_layers > MAX_LAYERS:
            raise BadSetting("num_layers", f"is {self.num_layers}, more than the {MAX_LAYERS} layers trioserve loads")
        if self.max_position > MAX_CONTEXT:
            raise BadSetting("max_position", f"is {self.max_position}, more than the {MAX_CONTEXT} positions trioserve serves")
        if self.num_heads % self.num_kv_heads:
            raise BadSetting("num_kv_heads", f"{self.num_heads} query heads do not divide into {self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise BadSetting("head_dim", f"is {self.head_dim}: rotary embeddings need an even head size")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise BadSetting("rope_theta", f"is {self.rope_theta!r}, not a finite number greater than 1")
        if not (math.isfinite(self.rms_eps) and 0 < self.rms_eps < 1):
            raise BadSetting("rms_eps", f"is {self.rms_eps!r}, not a finite number between 0 and 1")
        _check_scaling(self.rope_scaling)
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise BadSetting("sliding_window", f"is {self.sliding_window!r}, not a whole number of at least 1")
        for name in ("rope_local_theta",):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 1):
                raise BadSetting(name, f"is {value!r}, not a finite number greater than 1")
        if self.pooling not in (None, "mean", "cls", "last", "rank"):
            raise BadSetting("pooling", f"is {self.pooling!r}, not mean, cls, last or rank")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise BadSetting("layer_types", f"lists {len(self.layer_types)} layers, but the model has {self.num_layers}")
        if self.layer_types is not None and "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise BadSetting("sliding_window", "is not set, but layer_types has sliding-window layers")
        for name in ("query_scale", "embed_scale", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise BadSetting(name, f"is {value!r}, not a finite number greater than 0")

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def kv_bytes_per_token_element(self) -> int:
        """Elements of K and V stored per token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _check_scaling(s: RopeScaling) -> None:
    if not (math.isfinite(s.factor) and s.factor > 0):
        raise BadSetting("rope_scaling.factor", f"is {s.factor!r}, not a finite number greater than 0")
    if s.kind != "llama3":
        return
    if not (math.isfinite(s.low_freq_factor) and s.low_freq_factor > 0):
        raise BadSetting("rope_scaling.low_freq_factor", f"is {s.low_freq_factor!r}, not a finite number greater than 0")
    if not (math.isfinite(s.high_freq_factor) and s.high_freq_factor > s.low_freq_factor):
        raise BadSetting("rope_scaling.high_freq_factor", f"is {s.high_freq_factor!r}, not a finite number greater than the low_freq_factor {s.low_freq_factor!r}")
    if isinstance(s.original_max_position, bool) or not isinstance(s.original_max_position, int) or not 1 <= s.original_max_position <= MAX_CONTEXT:
        raise BadSetting("rope_scaling.original_max_position", f"is {s.original_max_position!r}, not a whole number from 1 to {MAX_CONTEXT}")


def _need(meta: Mapping[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise CheckpointError(path, f"GGUF metadata lacks required key {key!r}")
    return meta[key]


def _whole(value: Any, key: str, path: Path, where: str) -> int:
    """``value`` as an int: an int, or a float with no fraction (JSON writers
    spell some so); CheckpointError naming ``key`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise CheckpointError(path, f"{where}{key!r} is {value!r}, not a whole number")


def _positive(value: int, key: str, path: Path, where: str) -> int:
    """``value`` where it is at least 1 (what other settings are divided by)."""
    if value < 1:
        raise CheckpointError(path, f"{where}{key!r} is {value}, not a whole number of at least 1")
    return value


def _number(value: Any, key: str, path: Path, where: str) -> float:
    """``value`` as a float (an int or a float, never a bool or a text)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise CheckpointError(path, f"{where}{key!r} is {value!r}, not a number")


def config_from_gguf(meta: Mapping[str, Any], path: Path, *, vocab_size: int, tie_embeddings: bool) -> ModelConfig:
    """Build the config from GGUF metadata; the vocabulary size and whether the
    output head is tied are read off the tensors by the caller. Every value
    is checked (type, range, consistency) before anything is made from it;
    a refusal names the metadata key."""
    arch = _need(meta, "general.architecture", path)
    family = family_for_gguf(arch)
    if family is None:
        supported = ", ".join(supported_gguf())
        raise CheckpointError(path, f"unsupported architecture {arch!r} (supported: {supported})")
    p = f"{arch}."
    keys = {
        "vocab_size": "token_embd.weight's rows", "hidden_size": p + "embedding_length", "intermediate_size": p + "feed_forward_length",
        "num_layers": p + "block_count", "num_heads": p + "attention.head_count", "num_kv_heads": p + "attention.head_count_kv",
        "head_dim": p + "attention.key_length", "rope_theta": p + "rope.freq_base", "rms_eps": p + "attention.layer_norm_rms_epsilon",
        "max_position": p + "context_length", "rope_scaling.factor": p + "rope.scaling.factor",
    }  # fmt: skip

    def whole(key: str, default: int | None = None) -> int:
        return _whole(_need(meta, key, path) if default is None else meta.get(key, default), key, path, "metadata ")

    def number(key: str, default: float) -> float:
        return _number(meta.get(key, default), key, path, "metadata ")

    def flag(key: str, default: bool) -> bool:
        value = meta.get(key, default)
        if not isinstance(value, bool):
            raise CheckpointError(path, f"metadata {key!r} is {value!r}, not true or false")
        return value

    hidden = _positive(whole(p + "embedding_length"), p + "embedding_length", path, "metadata ")
    heads = _positive(whole(p + "attention.head_count"), p + "attention.head_count", path, "metadata ")
    kv_heads = whole(p + "attention.head_count_kv", heads)
    # As llama.cpp reads them: a head is key_length wide (else hidden / heads), and
    # rotated over rope.dimension_count of it (else all of it), which must be all here.
    head_dim = whole(p + "attention.key_length", hidden // heads)
    if p + "attention.key_length" not in meta:
        keys["head_dim"] = p + "embedding_length"
    rotary = meta.get(p + "rope.dimension_count")
    if rotary is not None and _whole(rotary, p + "rope.dimension_count", path, "metadata ") != head_dim:
        raise CheckpointError(
            path, f"metadata {p + 'rope.dimension_count'!r} is {rotary}, but the heads are {head_dim} wide: partial rotary embeddings are not supported"
        )
    scaling = RopeScaling()
    kind = meta.get(p + "rope.scaling.type", "none")
    if kind == "linear":
        scaling = RopeScaling("linear", number(p + "rope.scaling.factor", 1.0))
    elif kind not in ("none", None):
        raise CheckpointError(path, f"unsupported rope scaling type {kind!r}")
    return _build(
        path,
        keys,
        "metadata ",
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=whole(p + "feed_forward_length"),
        num_layers=whole(p + "block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=number(p + "rope.freq_base", 10000.0),
        rms_eps=number(p + "attention.layer_norm_rms_epsilon", 1e-5),
        max_position=whole(p + "context_length", 4096),
        tie_embeddings=tie_embeddings,
        attention_bias=family.attention_bias,
        rope_scaling=scaling,
        family_fields={
            **_family_settings(family.gguf_settings, Reader(whole, number, flag, meta.get, lambda v, k: _number(v, k, path, "metadata "), p), path, "metadata "),
            **_gguf_purpose(meta, p, path),
        },
    )


# GGUF `<arch>.pooling_type` (llama.cpp's enum) -> ModelConfig.pooling.
GGUF_POOLING = {0: None, 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def _gguf_purpose(meta: Mapping[str, Any], prefix: str, path: Path) -> dict[str, Any]:
    """What a GGUF says its model is for: ``pooling`` and ``rerank_template``."""
    out: dict[str, Any] = {}
    kind = meta.get(prefix + "pooling_type")
    if kind is not None:
        if isinstance(kind, bool) or not isinstance(kind, int) or (kind not in GGUF_POOLING and kind != -1):
            raise CheckpointError(path, f"metadata {prefix + 'pooling_type'!r} is {kind!r}, not one of {sorted(GGUF_POOLING)}")
        out["pooling"] = GGUF_POOLING.get(kind)
    template = meta.get("tokenizer.chat_template.rerank")
    if template is not None:
        if not isinstance(template, str) or "{query}" not in template or "{document}" not in template:
            raise CheckpointError(path, "metadata 'tokenizer.chat_template.rerank' is not a text with {query} and {document} in it")
        out["rerank_template"] = template
    return out


def _family_settings(read, reader: Reader, path: Path, where: str) -> dict[str, Any]:
    """A family's own settings (models/family.py), or CheckpointError."""
    try:
        return dict(read(reader))
    except BadSetting as exc:
        raise CheckpointError(path, f"{where}{reader.prefix}{exc.field!r} {exc.problem}") from None


def _build(path: Path, keys: Mapping[str, str], where: str, family_fields: Mapping[str, Any] = {}, **fields: Any) -> ModelConfig:  # noqa: B006 - read only
    """The config of ``fields``, the family's own settings (``family_fields``)
    taking precedence over the common reading (an encoder's norm epsilon)."""
    fields.update(family_fields)
    try:
        return ModelConfig(**fields)
    except BadSetting as exc:
        key = keys.get(exc.field, exc.field)
        if exc.field == "num_kv_heads" and "divide" in exc.problem:
            raise CheckpointError(path, f"{exc.problem} ({where}{key!r})") from None
        raise CheckpointError(path, f"{where}{key!r} {exc.problem}") from None


# config.json's key for each ModelConfig field.
HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "rope_theta": "rope_theta", "rms_eps": "rms_norm_eps", "max_position": "max_position_embeddings",
    "rope_scaling.factor": "rope_scaling.factor", "rope_scaling.low_freq_factor": "rope_scaling.low_freq_factor",
    "rope_scaling.high_freq_factor": "rope_scaling.high_freq_factor",
    "rope_scaling.original_max_position": "rope_scaling.original_max_position_embeddings",
}  # fmt: skip


def config_from_hf(raw: Mapping[str, Any], path: Path) -> ModelConfig:
    """Build the config from a parsed Hugging Face config.json, every value
    checked as `config_from_gguf` checks; a refusal names the key."""
    model_type = raw.get("model_type")
    family = family_for_hf(model_type)
    if family is None:
        supported = ", ".join(supported_hf())
        raise CheckpointError(path, f"unsupported model_type {model_type!r} (supported: {supported})")

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise CheckpointError(path, f"config.json lacks required key {key!r}")
        return raw[key]

    def whole(key: str, default: int | None = None) -> int:
        value = raw.get(key)
        return _whole(need(key) if default is None else default if value is None else value, key, path, "")

    def number(key: str, default: float) -> float:
        value = raw.get(key)
        return _number(default if value is None else value, key, path, "")

    def flag(key: str, default: bool) -> bool:
        value = raw.get(key)
        value = default if value is None else value
        if not isinstance(value, bool):
            raise CheckpointError(path, f"{key!r} is {value!r}, not true or false")
        return value

    hidden = _positive(whole("hidden_size"), "hidden_size", path, "")
    heads = _positive(whole("num_attention_heads"), "num_attention_heads", path, "")
    params = _rope_parameters(raw)
    partial = raw.get("partial_rotary_factor", params.get("partial_rotary_factor") if isinstance(params, Mapping) else None)
    if partial is not None and _number(partial, "partial_rotary_factor", path, "") != 1.0:
        raise CheckpointError(path, f"'partial_rotary_factor' is {partial!r}: partial rotary embeddings are not supported")
    tie = raw.get("tie_word_embeddings", False)
    bias = raw.get("attention_bias", family.attention_bias)
    for key, value in (("tie_word_embeddings", tie), ("attention_bias", bias)):
        if not isinstance(value, bool):
            raise CheckpointError(path, f"{key!r} is {value!r}, not true or false")
    return _build(
        path,
        HF_KEYS,
        "",
        architecture=model_type,
        vocab_size=whole("vocab_size"),
        hidden_size=hidden,
        intermediate_size=whole("intermediate_size"),
        num_layers=whole("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=whole("num_key_value_heads", heads),
        head_dim=whole("head_dim", hidden // heads),
        rope_theta=_hf_rope_theta(raw, path),
        rms_eps=number("rms_norm_eps", 1e-6),
        max_position=whole("max_position_embeddings", 4096),
        tie_embeddings=tie,
        attention_bias=bias,
        rope_scaling=_hf_rope_scaling(_rope_parameters(raw), path),
        family_fields=_family_settings(family.hf_settings, Reader(whole, number, flag, raw.get, lambda v, k: _number(v, k, path, ""), ""), path, ""),
    )


def _rope_parameters(raw: Mapping[str, Any], layer_type: str = "full_attention") -> Any:
    """config.json's RoPE settings: ``rope_scaling``, or the ``rope_parameters``
    transformers 5 writes (its base as ``rope_theta``, "default" for no
    scaling; one entry per layer type where they differ, as Gemma 3's:
    ``layer_type``'s entry then). {} where there are none."""
    value = raw.get("rope_scaling")
    if value is None:
        value = raw.get("rope_parameters")
    if isinstance(value, Mapping) and isinstance(value.get(layer_type), Mapping):
        value = value[layer_type]
    return value if isinstance(value, Mapping) or value is not None else {}


def _hf_rope_theta(raw: Mapping[str, Any], path: Path, layer_type: str = "full_attention") -> float:
    """The RoPE base: ``rope_theta``, or transformers 5's in ``rope_parameters``."""
    if raw.get("rope_theta") is not None:
        return _number(raw["rope_theta"], "rope_theta", path, "")
    params = _rope_parameters(raw, layer_type)
    value = params.get("rope_theta") if isinstance(params, Mapping) else None
    return 10000.0 if value is None else _number(value, "rope_parameters.rope_theta", path, "")


def _hf_rope_scaling(raw: Any, path: Path) -> RopeScaling:
    if not raw:
        return RopeScaling()
    if isinstance(raw, Mapping) and set(raw) <= {"rope_theta", "rope_type", "type", "partial_rotary_factor"} and raw.get("rope_type", raw.get("type")) in (None, "default"):
        return RopeScaling()
    if not isinstance(raw, Mapping):
        raise CheckpointError(path, f"'rope_scaling' is {raw!r}, not an object")
    kind = raw.get("rope_type", raw.get("type", "default"))

    def number(key: str, default: float | None = None) -> float:
        if raw.get(key) is None and default is None:
            raise CheckpointError(path, f"config.json lacks required key 'rope_scaling.{key}'")
        return _number(raw.get(key, default), f"rope_scaling.{key}", path, "")

    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", number("factor"))
    if kind == "llama3":
        original = raw.get("original_max_position_embeddings", 8192)
        return RopeScaling(
            "llama3",
            number("factor"),
            number("low_freq_factor", 1.0),
            number("high_freq_factor", 4.0),
            _whole(original, "rope_scaling.original_max_position_embeddings", path, ""),
        )
    raise CheckpointError(path, f"unsupported rope_scaling type {kind!r}")
