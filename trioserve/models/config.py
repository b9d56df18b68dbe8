"""ModelConfig: the shape of a Llama-family decoder, read from GGUF metadata
or a Hugging Face config.json. Plain data; no torch."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from trioserve.errors import CheckpointError

# GGUF `general.architecture` and HF `model_type` values we can run, mapped to
# whether their attention projections carry biases.
GGUF_ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True}
HF_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True}


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

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not divide into {self.num_kv_heads} KV heads")

    @property
    def kv_bytes_per_token_element(self) -> int:
        """Elements of K and V stored per token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _need(meta: Mapping[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise CheckpointError(path, f"GGUF metadata lacks required key {key!r}")
    return meta[key]


def config_from_gguf(meta: Mapping[str, Any], path: Path, *, vocab_size: int, tie_embeddings: bool) -> ModelConfig:
    """Build the config from GGUF metadata; the vocabulary size and whether the
    output head is tied are read off the tensors by the caller."""
    arch = _need(meta, "general.architecture", path)
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise CheckpointError(path, f"unsupported architecture {arch!r} (supported: {supported})")
    p = f"{arch}."
    hidden = int(_need(meta, p + "embedding_length", path))
    heads = int(_need(meta, p + "attention.head_count", path))
    kv_heads = int(meta.get(p + "attention.head_count_kv", heads))
    head_dim = int(meta.get(p + "attention.key_length", meta.get(p + "rope.dimension_count", hidden // heads)))
    scaling = RopeScaling()
    kind = meta.get(p + "rope.scaling.type", "none")
    if kind == "linear":
        scaling = RopeScaling("linear", float(meta.get(p + "rope.scaling.factor", 1.0)))
    elif kind not in ("none", None):
        raise CheckpointError(path, f"unsupported rope scaling type {kind!r}")
    return _build(
        path,
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_need(meta, p + "feed_forward_length", path)),
        num_layers=int(_need(meta, p + "block_count", path)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rms_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(meta.get(p + "context_length", 4096)),
        tie_embeddings=tie_embeddings,
        attention_bias=GGUF_ARCHITECTURES[arch],
        rope_scaling=scaling,
    )


def _build(path: Path, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise CheckpointError(path, str(exc)) from exc


def config_from_hf(raw: Mapping[str, Any], path: Path) -> ModelConfig:
    """Build the config from a parsed Hugging Face config.json."""
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        supported = ", ".join(sorted(HF_MODEL_TYPES))
        raise CheckpointError(path, f"unsupported model_type {model_type!r} (supported: {supported})")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        scaling = _hf_rope_scaling(raw.get("rope_scaling"), path)
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", HF_MODEL_TYPES[model_type])),
            rope_scaling=scaling,
        )
    except KeyError as exc:
        raise CheckpointError(path, f"config.json lacks required key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(path, f"config.json has a bad value: {exc}") from exc


def _hf_rope_scaling(raw: Mapping[str, Any] | None, path: Path) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(raw["factor"]),
            float(raw.get("low_freq_factor", 1.0)),
            float(raw.get("high_freq_factor", 4.0)),
            int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise CheckpointError(path, f"unsupported rope_scaling type {kind!r}")
