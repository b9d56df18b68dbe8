"""Phi-3 (and Phi-3.5 / Phi-4-mini where their settings fit): a Llama layer
whose files hold Q, K and V as one matrix (qkv_proj; GGUF attn_qkv) and gate
and up as one (gate_up_proj; GGUF ffn_up, gate rows first), split at load;
where the file sets a sliding window (Phi-3-mini: 2047) every layer attends
within it. LongRoPE (the 128k files' per-frequency factors) and partial
rotary embeddings (Phi-4-mini) are refused at load, with the setting named."""

from __future__ import annotations

from trioserve.models.config import ModelConfig
from trioserve.models.family import Family, every_layer, register


def _fused(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "self_attn.qkv_proj.weight": (("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv), ("self_attn.v_proj.weight", kv)),
        "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", config.intermediate_size), ("mlp.up_proj.weight", config.intermediate_size)),
    }


def _window(read, key: str) -> dict:
    value = read.raw(key)
    return {} if value is None else {"sliding_window": read.whole(key)}


PHI3 = register(
    Family(
        name="phi3",
        gguf_architectures=("phi3",),
        hf_model_types=("phi3",),
        layers=every_layer,
        gguf_settings=lambda read: _window(read, read.prefix + "attention.sliding_window"),
        hf_settings=lambda read: _window(read, "sliding_window"),
        gguf_layer_tensors={"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
        fused_layer_tensors=_fused,
    )
)
