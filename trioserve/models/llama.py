"""The Llama family: Llama 2/3, Mistral, Qwen2 (and SmolLM2, a Llama). Every
layer is the plain one (models/family.LayerSpec): RMSNorm, fused Q/K/V with
rotate-half RoPE, attention over the whole history, a SwiGLU MLP. Qwen2 adds
biases to Q, K and V. llama.cpp's converter interleaves the rotary halves of
Llama and Mistral Q/K rows (undone at load); Qwen2's it leaves alone."""

from __future__ import annotations

from trioserve.models.config import ModelConfig
from trioserve.models.family import Family, LayerSpec, register


def _layers(config: ModelConfig) -> list[LayerSpec]:
    return [LayerSpec(rope_theta=config.rope_theta)] * config.num_layers


LLAMA = register(Family(name="llama", gguf_architectures=("llama", "mistral"), hf_model_types=("llama", "mistral"), layers=_layers, permuted_qk=True))
QWEN2 = register(Family(name="qwen2", gguf_architectures=("qwen2",), hf_model_types=("qwen2",), layers=_layers, attention_bias=True))
