"""Qwen3 (dense): a Llama layer whose query and key heads are each
RMS-normed (q_norm, k_norm: one weight vector over a head's width) before
RoPE, with no Q/K/V biases, and heads whose width is set on its own
(head_dim, not hidden / heads). Rotate-half RoPE in both file kinds."""

from __future__ import annotations

from trioserve.models.config import BadSetting, ModelConfig
from trioserve.models.family import Family, LayerSpec, every_layer, register


def _layers(config: ModelConfig) -> list[LayerSpec]:
    return every_layer(config, qk_norm=True)


def _hf_settings(read) -> dict:
    if read.flag("use_sliding_window", False):
        # Qwen3's own checkpoints never set it; where one does, its layers past max_window_layers
        # would attend within a window this family does not describe.
        raise BadSetting("use_sliding_window", "is true: Qwen3's sliding-window layers are not supported")
    return {}


QWEN3 = register(
    Family(
        name="qwen3",
        gguf_architectures=("qwen3",),
        hf_model_types=("qwen3",),
        layers=_layers,
        hf_settings=_hf_settings,
        gguf_layer_tensors={"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
        extra_layer_shapes=lambda c: {"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)},
    )
)
