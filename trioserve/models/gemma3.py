"""Gemma 3 (text): five sliding-window layers to one global layer, the local
ones with their own RoPE base (10,000, unscaled) and the global ones with the
model's (1,000,000, linearly scaled on the 4B and larger); four norms a layer
(before and after attention, before and after the MLP) and q/k norm, every
norm computing with 1 + w (the GGUF converter stores w + 1; an HF directory
stores w, and the loader adds the 1); a GeGLU MLP (gelu, tanh approximation);
the embedding scaled by sqrt(hidden); q.k scaled by query_pre_attn_scalar^-1/2.

In GGUF files llama.cpp fixes what the metadata does not say: the pattern of
six, the local base where `rope.freq_base_swa` is absent (10,000), and the
query scale (1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 62-layer
27B)."""

from __future__ import annotations

import math

from trioserve.models.config import BadSetting, ModelConfig
from trioserve.models.family import Family, LayerSpec, register

PATTERN = 6  # every sixth layer global, where a file does not list its layers' types
LOCAL_BASE = 10000.0


def _layers(config: ModelConfig) -> list[LayerSpec]:
    kinds = config.layer_types or tuple(
        "full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(config.num_layers)
    )
    local = LayerSpec(
        mixer="sliding_attention", window=config.sliding_window, rope_theta=config.rope_local_theta or LOCAL_BASE, rope_scaled=False,
        qk_norm=True, sandwich_norms=True, activation="gelu_tanh",
    )  # fmt: skip
    full = LayerSpec(rope_theta=config.rope_theta, qk_norm=True, sandwich_norms=True, activation="gelu_tanh")
    return [local if kind == "sliding_attention" else full for kind in kinds]


def _gguf_settings(read) -> dict:
    p = read.prefix
    hidden, heads = read.whole(p + "embedding_length"), read.whole(p + "attention.head_count")
    head_dim = read.whole(p + "attention.key_length", hidden // max(1, heads))
    width = hidden // max(1, heads) if read.whole(p + "block_count") == 62 else head_dim
    return {
        "sliding_window": read.whole(p + "attention.sliding_window"),
        "rope_local_theta": read.number(p + "rope.freq_base_swa", LOCAL_BASE),  # llama.cpp's converter writes it; 10,000 where absent
        "query_scale": 1.0 / math.sqrt(max(1, width)),
        "embed_scale": math.sqrt(hidden),
    }


def _hf_settings(read) -> dict:
    if read.raw("attn_logit_softcapping") is not None:
        raise BadSetting("attn_logit_softcapping", f"is {read.raw('attn_logit_softcapping')!r}: soft-capped attention logits are not supported")
    if read.raw("use_bidirectional_attention"):
        raise BadSetting("use_bidirectional_attention", "is true: bidirectional (encoder) attention is not supported")
    hidden = read.whole("hidden_size")
    rope = read.raw("rope_parameters")
    local = rope.get("sliding_attention", {}).get("rope_theta") if isinstance(rope, dict) and isinstance(rope.get("sliding_attention"), dict) else None
    if local is None:
        local = read.raw("rope_local_base_freq")
    cap = read.raw("final_logit_softcapping")
    kinds = read.raw("layer_types")
    return {
        "sliding_window": read.whole("sliding_window", 4096),
        "rope_local_theta": LOCAL_BASE if local is None else read.number_of(local, "rope_parameters.sliding_attention.rope_theta"),
        "query_scale": 1.0 / math.sqrt(read.number("query_pre_attn_scalar", 256.0)),
        "embed_scale": math.sqrt(hidden),
        "final_softcap": None if cap is None else read.number("final_logit_softcapping", 0.0),
        "layer_types": None if kinds is None else _layer_types(kinds),
    }


def _layer_types(kinds: object) -> tuple[str, ...]:
    if not isinstance(kinds, list) or not all(k in ("full_attention", "sliding_attention") for k in kinds):
        raise BadSetting("layer_types", f"is {kinds!r}, not a list of 'full_attention' and 'sliding_attention'")
    return tuple(kinds)


GEMMA3 = register(
    Family(
        name="gemma3",
        gguf_architectures=("gemma3",),
        hf_model_types=("gemma3_text",),
        layers=_layers,
        gguf_settings=_gguf_settings,
        hf_settings=_hf_settings,
        gguf_layer_tensors={
            "attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight",
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        extra_layer_shapes=lambda c: {
            "self_attn.q_norm.weight": (c.head_dim,),
            "self_attn.k_norm.weight": (c.head_dim,),
            "pre_feedforward_layernorm.weight": (c.hidden_size,),
            "post_feedforward_layernorm.weight": (c.hidden_size,),
        },
        hf_norm_offset=1.0,
    )
)
