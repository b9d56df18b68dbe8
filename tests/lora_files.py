"""Random LoRA adapters in PEFT's layout for the tiny model, and the model
with an adapter merged into it. ``merged_weights`` reads the adapter files on
its own (numpy, float64), not through trioserve.models.lora, so a test that
compares an adapter served on the base model with the merged model checks
the loader too."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from trioserve.models.lora import TARGETS

_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _features(shape: dict, target: str) -> tuple[int, int]:
    """(in, out) of a target's matrix for a model of ``shape`` (TINY's keys)."""
    h, f = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    q = shape["num_attention_heads"] * head_dim
    kv = shape["num_key_value_heads"] * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}[target]


def write_peft_adapter(
    directory: Path,
    shape: dict,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets=TARGETS,
    seed: int = 0,
    layers=None,
    scale_b: float = 0.05,
    extra_config: dict | None = None,
) -> Path:
    """Write adapter_config.json and adapter_model.safetensors, as PEFT's
    save_pretrained does for a LlamaForCausalLM, into ``directory``.

    targets: a list of module names, or a regex string (written as such, and
    matched against "model.layers.{i}.self_attn.q_proj"-style names to pick
    the tensors to write). layers: indices for layers_to_transform (None: all
    layers). B is random, not PEFT's zero init, so the adapter changes the
    model's output. extra_config: keys that override the written config (the
    tensors follow the arguments, not these)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n_layers = shape["num_hidden_layers"]
    layer_list = list(range(n_layers)) if layers is None else list(layers)
    if isinstance(targets, str):
        regex = re.compile(targets)
        covered = [(i, t) for i in range(n_layers) for t in TARGETS if regex.fullmatch(f"model.layers.{i}.{_PARENT[t]}.{t}")]
        config_targets = targets
    else:
        covered = [(i, t) for i in layer_list for t in targets]
        config_targets = list(targets)

    rng = np.random.default_rng(seed)
    tensors = {}
    for i, target in covered:
        n_in, n_out = _features(shape, target)
        stem = f"base_model.model.model.layers.{i}.{_PARENT[target]}.{target}"
        tensors[f"{stem}.lora_A.weight"] = (0.1 * rng.standard_normal((rank, n_in))).astype(np.float32)
        tensors[f"{stem}.lora_B.weight"] = (scale_b * rng.standard_normal((n_out, rank))).astype(np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))

    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "inference_mode": True,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": config_targets,
        "layers_to_transform": None if layers is None else layer_list,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
    }
    config.update(extra_config or {})
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


def fifo_in_place(path: Path) -> Path:
    """Replace the file at ``path`` with a FIFO of its name (nobody ever
    writes to it: opening it to read blocks, unless opened non-blocking).
    Skips the test where no FIFO can be made."""
    path.unlink(missing_ok=True)
    try:
        os.mkfifo(path)
    except (AttributeError, OSError) as exc:  # no mkfifo here (Windows), or a filesystem without FIFOs
        pytest.skip(f"cannot make a FIFO at {path}: {exc}")
    return path


def dev_zero_in_place(path: Path) -> Path:
    """Replace the file at ``path`` with a link to /dev/zero (endless zeros).
    Skips the test where there is no /dev/zero or no symbolic link."""
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero on this system")
    path.unlink(missing_ok=True)
    try:
        path.symlink_to("/dev/zero")
    except OSError as exc:
        pytest.skip(f"cannot make a symbolic link at {path}: {exc}")
    return path


def adapter_scale(adapter_dir: Path) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA, from the config file."""
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    r = config["r"]
    return config["lora_alpha"] / (np.sqrt(r) if config.get("use_rslora") else r)


def merged_weights(weights: dict[str, np.ndarray], adapter_dir: Path) -> dict[str, np.ndarray]:
    """A copy of the HF-named ``weights`` (tests/tiny_model.py tiny_weights)
    with ``scale * B @ A`` added to each matrix the adapter covers, summed in
    float64 and stored as float32. Untouched entries are the same arrays.
    Merge before write_gguf, which permutes the Q/K rows of what it is given."""
    scale = adapter_scale(adapter_dir)
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(model\.layers\.\d+\.\w+\.\w+)\.lora_([AB])(?:\.\w+)?\.weight", name)
        assert match, f"not a LoRA tensor name: {name}"
        pairs.setdefault(f"{match[1]}.weight", {})[match[2]] = value
    merged = dict(weights)
    for weight_name, pair in pairs.items():
        base = weights[weight_name]
        update = scale * (pair["B"].astype(np.float64) @ pair["A"].astype(np.float64))
        assert update.shape == base.shape, f"{weight_name}: update {update.shape}, weight {base.shape}"
        merged[weight_name] = (base.astype(np.float64) + update).astype(np.float32)
    return merged
