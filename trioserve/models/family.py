"""The model interface: what a family of decoder models is, and the registry
that finds one by a GGUF file's `general.architecture` or a config.json's
`model_type`.

A family is a description, not a class that runs: its file under models/
(llama.py, qwen3.py, gemma3.py) says which settings it reads beyond the
common ones, which tensors each layer has (their GGUF and HF names), and
what each layer does (`LayerSpec`: the mixer, the norms, the activation,
RoPE, q/k norm). One generic forward (models/decoder.py) runs every family
from those descriptions; the engine, the step runner, replay, LoRA and the
weight card see that model and these records, never a family's code.
Weight formats are not a family's business either: the decoder's
projection factory (kernels/factory.py) chooses them per tensor."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from trioserve.models.config import ModelConfig

# The families' modules: each registers itself with `register` when imported.
FAMILY_MODULES = ("trioserve.models.llama", "trioserve.models.qwen3", "trioserve.models.gemma3", "trioserve.models.phi3", "trioserve.models.bert")

MIXERS = ("attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_tanh")


@attrs.frozen
class LayerSpec:
    """What one decoder layer computes, in order:

    x = norm(h, input_layernorm); q, k, v = x W_qkv (+ biases)
    [q, k per head = norm(q, q_norm), norm(k, k_norm)]          qk_norm
    q, k rotated (rotate-half RoPE at ``rope_theta``, the config's scaling
        where ``rope_scaled``); K/V written to the pool
    a = attention(q, K, V) over the whole history (``mixer`` "attention")
        or over its last ``window`` positions ("sliding_attention")
    o = a W_o [then norm(o, post_attention_layernorm)]            sandwich_norms
    h += o
    x = norm(h, post_attention_layernorm, or pre_feedforward_layernorm with sandwich_norms)
    m = act(x W_gate) * (x W_up) W_down  [then norm(m, post_feedforward_layernorm)]
    h += m"""

    mixer: str = "attention"
    window: int | None = None
    rope_theta: float = 10000.0
    rope_scaled: bool = True  # the config's rope_scaling applies (Gemma 3's local layers: unscaled)
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"

    def __attrs_post_init__(self) -> None:
        if self.mixer not in MIXERS:
            raise ValueError(f"unknown mixer {self.mixer!r} (known: {', '.join(MIXERS)})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r} (known: {', '.join(ACTIVATIONS)})")
        if (self.mixer == "sliding_attention") != (self.window is not None):
            raise ValueError("a sliding-window layer has a window, and only it")

    @property
    def plain(self) -> bool:
        """A Llama layer: what the C layer loop (kernels/layer_runner.py) runs."""
        return self == attrs.evolve(PLAIN, rope_theta=self.rope_theta, rope_scaled=self.rope_scaled)


PLAIN = LayerSpec()


def every_layer(config: ModelConfig, **spec: Any) -> list[LayerSpec]:
    """The same layer ``spec`` at the config's RoPE base on every layer,
    each attending within the config's sliding window where it sets one
    shorter than the context (Mistral 7B v0.1, Phi-3-mini)."""
    window = config.sliding_window
    if window is not None and window < config.max_position:
        spec = {"mixer": "sliding_attention", "window": window, **spec}
    return [LayerSpec(rope_theta=config.rope_theta, **spec)] * config.num_layers


# A family's reading of its own settings: from the file's mapping of keys
# (GGUF metadata with the "<arch>." prefix, or config.json), through the
# loader's checked readers, into ModelConfig fields beyond the common ones.
SettingsReader = Callable[["Reader"], Mapping[str, Any]]


class Reader:
    """The checked readers a family's settings function uses: every value
    typed and bounded, a refusal naming the file's key (models/config.py)."""

    def __init__(
        self, whole: Callable[..., int], number: Callable[..., float], flag: Callable[..., bool], raw: Callable[[str], Any],
        number_of: Callable[[Any, str], float], prefix: str,
    ) -> None:  # fmt: skip
        # whole(key, default=None), number(key, default), flag(key, default): a key's checked value
        # (None: required); raw(key): its value unchecked, or None; number_of(value, key): a value
        # found inside another checked as a number; prefix: "<arch>." in GGUF metadata, "" in config.json.
        self.whole, self.number, self.flag, self.raw, self.number_of, self.prefix = whole, number, flag, raw, number_of, prefix


@attrs.frozen
class Family:
    """One family: its names in GGUF and HF files, the extra tensors of its
    layers, its settings, and its layers' descriptions.

    ``gguf_layer_tensors``: GGUF per-layer tensor name -> HF name (after
    ``model.layers.<i>.``), for the tensors the common Llama set lacks or
    names otherwise. ``extra_layer_shapes(config)``: HF per-layer name ->
    shape, for tensors beyond the common Llama set. ``permuted_qk``: the
    GGUF converter interleaved each Q/K head's rotary halves (llama.cpp's
    "normal" RoPE), undone at load. ``hf_norm_offset``: added to every norm
    weight read from an HF directory (Gemma stores w and computes 1 + w;
    its GGUF converter stores w + 1 already). ``attention_bias``: the
    default for Q/K/V biases. ``fused_layer_tensors(config)``: see
    `split_layer_tensors`."""

    name: str
    gguf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    layers: Callable[[ModelConfig], list[LayerSpec]]
    gguf_settings: SettingsReader = lambda r: {}
    hf_settings: SettingsReader = lambda r: {}
    gguf_layer_tensors: Mapping[str, str] = attrs.field(factory=dict)
    extra_layer_shapes: Callable[[ModelConfig], Mapping[str, tuple[int, ...]]] = lambda c: {}
    permuted_qk: bool = False
    hf_norm_offset: float = 0.0
    attention_bias: bool = False
    fused_layer_tensors: Callable[[ModelConfig], Mapping[str, tuple[tuple[str, int], ...]]] = lambda c: {}
    # An encoder (bidirectional attention, no output head: embeddings only) rather than a decoder.
    kind: str = "decoder"
    # GGUF top-level tensor name -> internal name, beyond the common embedding, norm and head.
    gguf_top_tensors: Mapping[str, str] = attrs.field(factory=dict)
    # An HF directory's tensor name -> the internal name, or None for one not used (None: names as they are).
    hf_names: Callable[[str], str | None] | None = None
    # Every tensor the model needs with its shape, where the family's set is not a Llama's (None: the Llama set).
    all_shapes: Callable[[ModelConfig], Mapping[str, tuple[int, ...]]] | None = None

    def split_layer_tensors(self, config: ModelConfig) -> Mapping[str, tuple[tuple[str, int], ...]]:
        """HF per-layer name of a matrix the family's files hold fused ->
        the (name, rows) of its parts, in row order: the loaders split it
        (Phi-3's qkv_proj into q, k and v; its gate_up_proj into gate and up)."""
        return self.fused_layer_tensors(config)


_BY_GGUF: dict[str, Family] = {}
_BY_HF: dict[str, Family] = {}


def register(family: Family) -> Family:
    for arch in family.gguf_architectures:
        _BY_GGUF[arch] = family
    for model_type in family.hf_model_types:
        _BY_HF[model_type] = family
    return family


def _load_all() -> None:
    for module in FAMILY_MODULES:
        importlib.import_module(module)


def family_for_gguf(architecture: object) -> Family | None:
    _load_all()
    return _BY_GGUF.get(architecture) if isinstance(architecture, str) else None


def family_for_hf(model_type: object) -> Family | None:
    _load_all()
    return _BY_HF.get(model_type) if isinstance(model_type, str) else None


def family_of(architecture: str) -> Family:
    """The family of a loaded config (its `architecture` is a GGUF
    architecture or an HF model type)."""
    family = family_for_gguf(architecture) or family_for_hf(architecture)
    if family is None:
        raise ValueError(f"no family for architecture {architecture!r}")
    return family


def supported_gguf() -> list[str]:
    _load_all()
    return sorted(_BY_GGUF)


def supported_hf() -> list[str]:
    _load_all()
    return sorted(_BY_HF)
