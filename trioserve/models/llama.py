"""The Llama family: Llama 2/3, Mistral, Qwen2 (and SmolLM2, a Llama). Every
layer is the plain one (models/family.LayerSpec): RMSNorm, fused Q/K/V with
rotate-half RoPE, attention over the whole history, a SwiGLU MLP; where an
HF Mistral config sets a window shorter than the context, every layer
attends within it. Qwen2 adds biases to Q, K and V. llama.cpp's converter interleaves the rotary halves of
Llama and Mistral Q/K rows (undone at load); Qwen2's it leaves alone."""

from __future__ import annotations

from trioserve.models.config import BadSetting
from trioserve.models.family import Family, every_layer, register


def _hf_window(read) -> dict:
    """Mistral 7B v0.1's config.json sets a 4,096-token window on every layer
    (later Mistrals set none); Llama's has no such key."""
    return {} if read.raw("sliding_window") is None else {"sliding_window": read.whole("sliding_window")}


def _qwen2_window(read) -> dict:
    if read.flag("use_sliding_window", False):
        raise BadSetting("use_sliding_window", "is true: Qwen2's sliding-window layers are not supported")
    return {}


LLAMA = register(
    Family(
        name="llama", gguf_architectures=("llama", "mistral"), hf_model_types=("llama", "mistral"), layers=every_layer, hf_settings=_hf_window,
        permuted_qk=True,
    )  # fmt: skip
)
QWEN2 = register(
    Family(name="qwen2", gguf_architectures=("qwen2",), hf_model_types=("qwen2",), layers=every_layer, hf_settings=_qwen2_window, attention_bias=True)
)
