"""Hugging Face checkpoint directories: config.json, tokenizer files and one or
many safetensors files (with model.safetensors.index.json when sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError, safe_open

from trioserve.errors import CheckpointError, TokenizerError
from trioserve.models.checkpoint import Checkpoint, Progress, check_complete, check_layers, check_vocabulary, split_fused
from trioserve.models.config import config_from_hf
from trioserve.models.family import family_of
from trioserve.models.files import MAX_JSON, FileRefused, is_regular_file, kind_of, read_text
from trioserve.models.tokenizer import Tokenizer

INDEX = "model.safetensors.index.json"


def _read_json(path: Path, kind: type = dict):
    """A JSON file holding a ``kind`` (an object; a list), read as untrusted (models/files.py)."""
    try:
        value = json.loads(read_text(path, MAX_JSON))
    except FileRefused as exc:
        raise CheckpointError(path, exc.problem) from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(path, f"not valid JSON ({exc})") from None
    if not isinstance(value, kind):
        raise CheckpointError(path, f"holds a JSON {type(value).__name__}, not {'an object' if kind is dict else 'a list'}")
    return value


def _shards(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = directory / INDEX
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(index, "has no 'weight_map' object")
        for name, file in weight_map.items():
            # A shard is a file of this directory: no other directory's, nothing but a plain name.
            if not isinstance(file, str) or file in ("", ".", "..") or Path(file).name != file or "\\" in file:
                raise CheckpointError(index, f"names {file!r} as the file of {name!r}: not a file name in the checkpoint's directory")
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
    if not file.exists():
        raise CheckpointError(file, "no such file (named by the index)")
    if not is_regular_file(file):
        raise CheckpointError(file, f"is {kind_of(file.stat().st_mode)}, not a regular file")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(file, f"truncated or corrupt safetensors file ({exc})") from exc


def load_hf_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer of a Hugging Face directory, without its weights."""
    try:
        return Tokenizer.from_hf_dir(directory)
    except TokenizerError as exc:
        raise CheckpointError(directory, f"bad tokenizer: {exc}") from None
    except (TypeError, ValueError, AttributeError, KeyError, RecursionError) as exc:
        # A tokenizer_config.json whose values have the wrong types (an id where a text belongs, ...).
        raise CheckpointError(directory, f"bad tokenizer: {type(exc).__name__}: {exc}") from None


# sentence-transformers' pooling module config -> ModelConfig.pooling, first set flag wins.
_POOLING_FLAGS = (("pooling_mode_lasttoken", "last"), ("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"))


def hf_pooling(directory: Path) -> str | None:
    """How a sentence-transformers directory pools its embeddings (its
    modules.json's Pooling module's config.json), or None where it has none."""
    modules_file = directory / "modules.json"
    if not modules_file.exists():
        return None
    for module in _read_json(modules_file, list):
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            where = module.get("path")
            if not isinstance(where, str) or Path(where).is_absolute() or ".." in Path(where).parts:
                raise CheckpointError(modules_file, f"names {where!r} as the pooling module's directory: not a directory inside the checkpoint")
            settings = _read_json(directory / where / "config.json")
            for flag, mode in _POOLING_FLAGS:
                if settings.get(flag) is True:
                    return mode
            mode = settings.get("pooling_mode")
            return {"lasttoken": "last", "cls": "cls", "mean": "mean"}.get(mode) if isinstance(mode, str) else None
    return None


def load_hf_dir(directory: Path, *, dtype: torch.dtype, progress: Progress | None = None) -> Checkpoint:
    config = config_from_hf(_read_json(directory / "config.json"), directory / "config.json")
    if family_of(config.architecture).kind == "encoder":
        dtype = torch.float32  # an encoder computes in float32 (models/bert.py): its weights are not rounded on the way
    pooling = hf_pooling(directory)
    if pooling is not None:
        config = attrs.evolve(config, pooling=pooling)
    tokenizer = load_hf_tokenizer(directory)
    owner = _shards(directory)
    rename = family_of(config.architecture).hf_names
    if rename is not None:  # the family's own names for an HF model's tensors (models/family.py)
        renamed = {}
        for name, file in owner.items():
            ours = rename(name)
            if ours is not None:
                renamed[ours] = (name, file)
        file_name = {ours: name for ours, (name, _) in renamed.items()}
        owner = {ours: file for ours, (_, file) in renamed.items()}
    else:
        file_name = {name: name for name in owner}
    check_layers(directory / "config.json", config, owner, key="num_hidden_layers")
    shapes = {}
    ours_of = {name: ours for ours, name in file_name.items()}
    for file in sorted(set(owner.values())):
        handle = _open(file)
        for name in handle.keys():
            if name in ours_of:
                shapes[ours_of[name]] = tuple(handle.get_slice(name).get_shape())

    def rows(shape) -> int:
        return int(shape[0])

    def part(shape, start: int, end: int) -> tuple[int, ...]:
        return (end - start, *shape[1:])

    check_complete(directory, config, split_fused(directory, config, {n: shapes[n] for n in owner if n in shapes}, rows, part))
    check_vocabulary(directory, config, tokenizer, tokens="tokenizer.json", rows="vocab_size in config.json")

    offset = family_of(config.architecture).hf_norm_offset
    by_file: dict[Path, list[str]] = {}
    for name, file in owner.items():
        by_file.setdefault(file, []).append(name)
    weights: dict[str, torch.Tensor] = {}
    done = 0
    for file, names in by_file.items():
        handle = _open(file)
        for name in names:
            try:
                tensor = handle.get_tensor(file_name[name])
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(file, f"cannot read tensor {name!r} ({exc})") from exc
            if not torch.isfinite(tensor.float()).all():
                raise CheckpointError(file, f"corrupt tensor {name!r}: contains NaN or infinity")
            if offset and name.endswith("norm.weight"):
                tensor = tensor.float() + offset  # the family computes with offset + w (models/family.py)
            weights[name] = tensor.to(dtype)
            done += 1
            if progress is not None:
                progress(done, len(owner))
    weights = split_fused(directory, config, weights, lambda t: int(t.shape[0]), lambda t, start, end: t[start:end].contiguous())
    return Checkpoint(path=directory, config=config, tokenizer=tokenizer, weights=weights)
