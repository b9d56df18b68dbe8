"""Hugging Face checkpoint directories: config.json, tokenizer files and one or
many safetensors files (with model.safetensors.index.json when sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from trioserve.errors import CheckpointError, TokenizerError
from trioserve.models.checkpoint import Checkpoint, Progress, check_complete
from trioserve.models.config import config_from_hf
from trioserve.models.tokenizer import Tokenizer

INDEX = "model.safetensors.index.json"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(path, "no such file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"not valid JSON ({exc})") from exc


def _shards(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = directory / INDEX
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(index, "has no 'weight_map' object")
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(directory, "no *.safetensors files in the directory")
    owner: dict[str, Path] = {}
    for file in files:
        for name in _open(file).keys():
            owner[name] = file
    return owner


def _open(file: Path):
    if not file.is_file():
        raise CheckpointError(file, "no such file (named by the index)")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(file, f"truncated or corrupt safetensors file ({exc})") from exc


def load_hf_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer of a Hugging Face directory, without its weights."""
    try:
        return Tokenizer.from_hf_dir(directory)
    except TokenizerError as exc:
        raise CheckpointError(directory, f"bad tokenizer: {exc}") from exc


def load_hf_dir(directory: Path, *, dtype: torch.dtype, progress: Progress | None = None) -> Checkpoint:
    config = config_from_hf(_read_json(directory / "config.json"), directory / "config.json")
    tokenizer = load_hf_tokenizer(directory)
    owner = _shards(directory)
    shapes = {}
    for file in sorted(set(owner.values())):
        handle = _open(file)
        for name in handle.keys():
            shapes[name] = tuple(handle.get_slice(name).get_shape())
    check_complete(directory, config, {n: shapes[n] for n in owner if n in shapes})

    by_file: dict[Path, list[str]] = {}
    for name, file in owner.items():
        by_file.setdefault(file, []).append(name)
    weights: dict[str, torch.Tensor] = {}
    done = 0
    for file, names in by_file.items():
        handle = _open(file)
        for name in names:
            try:
                tensor = handle.get_tensor(name)
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(file, f"cannot read tensor {name!r} ({exc})") from exc
            if not torch.isfinite(tensor.float()).all():
                raise CheckpointError(file, f"corrupt tensor {name!r}: contains NaN or infinity")
            weights[name] = tensor.to(dtype)
            done += 1
            if progress is not None:
                progress(done, len(owner))
    return Checkpoint(path=directory, config=config, tokenizer=tokenizer, weights=weights)
