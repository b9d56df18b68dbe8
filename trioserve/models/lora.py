"""LoRA adapters in PEFT's on-disk layout: a directory holding
adapter_config.json and adapter_model.safetensors. ``load_lora_adapter``
reads one, checks every tensor against the model's shape, and returns the
low-rank factors as float32 CPU tensors. Local directories only; nothing
here reaches the Hugging Face hub.

Both files are untrusted input (any API key may name a directory on the
server's disk): each is read through models/files.py, so a FIFO, a device
(a link to /dev/zero), a socket or a directory in a file's place is
refused at once, without blocking, and each is read only up to its bound:
MAX_JSON for the config, and for the weights the most an adapter of the
config's rank and targets can hold on this model (`weights_bound`)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load as load_safetensors

from trioserve.errors import RequestError
from trioserve.models import bounded
from trioserve.models.config import ModelConfig
from trioserve.models.files import MAX_JSON, FileRefused, is_regular_file, read_bytes, read_text

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The submodule of a decoder layer each target sits in (HF Llama naming).
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
REGEX_TIMEOUT_S = 2.0  # matching a regex target_modules against every module name (microseconds, normally)
REGEX_MEMORY_BYTES = 128 << 20
MAX_REGEX_CHARS = 4096
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
# What bounds the weights file (`weights_bound`): 8 bytes a value (float64,
# the widest floating dtype safetensors stores and `_checked` accepts; PEFT
# saves float32 or 16-bit, so real files are at most half of it), plus the
# safetensors header: its 8-byte length, room for PEFT's metadata, and a
# generous entry (name, dtype, shape, offsets: ~150 bytes) per tensor.
WEIGHT_VALUE_BYTES = 8
HEADER_SLACK_BYTES = 1 << 20
HEADER_BYTES_PER_TENSOR = 1024

# "<module>.lora_A[.<adapter name>].weight", after an optional "base_model.model." prefix.
_LORA_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight")
_LAYER_MODULE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<parent>[^.]+)\.(?P<target>[^.]+)")


class AdapterError(RequestError):
    """A LoRA adapter that cannot be applied to this model (HTTP 400): missing
    or unreadable files, an unsupported PEFT option, or weights whose names or
    shapes do not fit. The message starts with ``adapter 'NAME':``."""


def module_name(layer: int, target: str) -> str:
    """PEFT's name of a target inside a LlamaForCausalLM, the string a regex
    ``target_modules`` is matched against."""
    return f"model.layers.{layer}.{_PARENT[target]}.{target}"


def io_features(config: ModelConfig, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a target's weight matrix."""
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    return {
        "q_proj": (config.hidden_size, q_out),
        "k_proj": (config.hidden_size, kv_out),
        "v_proj": (config.hidden_size, kv_out),
        "o_proj": (q_out, config.hidden_size),
        "gate_proj": (config.hidden_size, config.intermediate_size),
        "up_proj": (config.hidden_size, config.intermediate_size),
        "down_proj": (config.intermediate_size, config.hidden_size),
    }[target]


@attrs.frozen
class LoraAdapter:
    """A loaded adapter. ``weights[layer][target]`` is (A [rank, in], B [out,
    rank]), float32, contiguous, on the CPU; the update it makes to that
    matrix is ``scale * B @ A``."""

    name: str
    path: str
    rank: int
    scale: float
    targets: tuple[str, ...]
    weights: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = attrs.field(eq=False, repr=False)

    def delta(self, layer: int, target: str) -> torch.Tensor | None:
        """``scale * B @ A`` ([out, in], float32) for one matrix, or None where
        the adapter leaves it alone."""
        pair = self.weights.get(layer, {}).get(target)
        if pair is None:
            return None
        a, b = pair
        return (b @ a).mul_(self.scale)


def load_lora_adapter(path: str | Path, config: ModelConfig, *, name: str, max_rank: int) -> LoraAdapter:
    """Read the PEFT adapter in directory ``path`` for a model of ``config``;
    any problem is an AdapterError naming it. ``max_rank``: the server's
    --max-lora-rank."""
    directory = Path(path)

    def fail(problem: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: {problem}", field="path")

    raw = _read_config(directory, fail)
    rank, scale = _rank_and_scale(raw, max_rank, fail)
    allowed = _allowed_modules(raw, config, fail)
    covered = "every module of this model" if allowed is None else f"the {len(allowed)} module{'s' * (len(allowed) != 1)} {CONFIG_FILE} targets"
    bound_reason = f"the most an adapter of rank {rank} for {covered} can hold"
    tensors = _read_tensors(directory, weights_bound(config, rank, allowed), bound_reason, fail)

    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        layer, target, ab = _parse_name(tensor_name, config, fail)
        slot = factors.setdefault((layer, target), {})
        if ab in slot:
            raise fail(f"{WEIGHTS_FILE} holds two lora_{ab} tensors for {_short(layer, target)} "
                       "(weights of more than one adapter, or the same weight under two names)")
        slot[ab] = tensor
    if not factors:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")

    weights: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for layer, target in sorted(factors, key=lambda key: (key[0], TARGETS.index(key[1]))):
        slot = factors[(layer, target)]
        short = _short(layer, target)
        for have, lacks in (("A", "B"), ("B", "A")):
            if lacks not in slot:
                raise fail(f"{short}.lora_{have}.weight has no matching {short}.lora_{lacks}.weight")
        if allowed is not None and (layer, target) not in allowed:
            raise fail(f"{WEIGHTS_FILE} holds weights for {short}, which {CONFIG_FILE} does not target")
        in_features, out_features = io_features(config, target)
        a = _checked(slot["A"], f"{short}.lora_A.weight", (rank, in_features), fail)
        b = _checked(slot["B"], f"{short}.lora_B.weight", (out_features, rank), fail)
        weights.setdefault(layer, {})[target] = (a, b)

    if allowed is not None:
        missing = sorted(allowed - set(factors), key=lambda key: (key[0], TARGETS.index(key[1])))
        if missing:
            listed = ", ".join(_short(*key) for key in missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise fail(f"{WEIGHTS_FILE} holds no LoRA weights for {listed}, which {CONFIG_FILE} targets")

    targets = tuple(t for t in TARGETS if any(t in per_layer for per_layer in weights.values()))
    return LoraAdapter(name=name, path=str(directory), rank=rank, scale=scale, targets=targets, weights=weights)


def _short(layer: int, target: str) -> str:
    return f"layers.{layer}.{_PARENT[target]}.{target}"


def _read_config(directory: Path, fail) -> dict[str, Any]:
    if not directory.is_dir():
        raise fail(f"{directory} is not a directory")
    try:
        text = read_text(directory / CONFIG_FILE, MAX_JSON)
    except FileRefused as exc:
        # The file's name alone, never the path: what a tenant is told says nothing of the server's directories.
        raise fail(f"no {CONFIG_FILE} in {directory}" if exc.missing else _refused(CONFIG_FILE, exc)) from None
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise fail(f"{CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise fail(f"{CONFIG_FILE} is not a JSON object")

    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type!r} is not LORA")
    if raw.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out is true (weights stored transposed, for GPT-2 style Conv1D layers); not supported")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise fail(f"bias {bias!r} is not supported (only 'none': an adapter that trains no biases)")
    if raw.get("modules_to_save"):
        raise fail(f"modules_to_save {raw['modules_to_save']!r} is not supported (the adapter replaces whole modules)")
    if raw.get("use_dora"):
        raise fail("use_dora is true; DoRA adapters are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise fail(f"{key} is not supported (one rank and alpha for every module)")
    return raw


def _refused(file: str, exc: FileRefused) -> str:
    """Why ``file`` (its name alone, never its path) was not read."""
    return f"{file} {exc.problem}" if exc.problem.startswith("is ") else f"{file} cannot be read: {exc.problem}"


def _rank_and_scale(raw: dict[str, Any], max_rank: int, fail) -> tuple[int, float]:
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise fail(f"{CONFIG_FILE} has r {rank!r}; it must be a whole number")
    if rank < 1:
        raise fail(f"rank {rank} is less than 1")
    if rank > max_rank:
        raise fail(f"rank {rank} is more than --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)  # PEFT's default
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise fail(f"{CONFIG_FILE} has lora_alpha {alpha!r}; it must be a finite number")
    divisor = math.sqrt(rank) if raw.get("use_rslora") else rank
    return rank, float(alpha) / divisor


def _allowed_modules(raw: dict[str, Any], config: ModelConfig, fail) -> set[tuple[int, str]] | None:
    """The (layer, target) pairs the config says the adapter covers, or None
    when it does not say (then the tensors alone decide)."""
    spec = raw.get("target_modules")
    layers = raw.get("layers_to_transform")
    if layers is None:
        layers = list(range(config.num_layers))
    elif isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise fail(f"layers_to_transform {raw.get('layers_to_transform')!r} is not a list of layer indices")
    for i in layers:
        if not 0 <= i < config.num_layers:
            raise fail(f"layers_to_transform names layer {i}; the model has {config.num_layers} layers (0..{config.num_layers - 1})")
    if spec is None:
        return None
    if spec == "all-linear":
        return {(i, t) for i in layers for t in TARGETS}
    if isinstance(spec, str):  # a regex PEFT fullmatches against module names
        # PEFT applies layers_to_transform only to a list of names, not to a regex.
        modules = [(i, t) for i in range(config.num_layers) for t in TARGETS]
        return {m for m, hit in zip(modules, _fullmatches(spec, [module_name(i, t) for i, t in modules], fail)) if hit}
    if not isinstance(spec, list) or not all(isinstance(t, str) for t in spec):
        raise fail(f"target_modules {spec!r} is neither a list of module names nor a regex")
    for target in spec:
        if target not in TARGETS:
            raise fail(f"target module {target!r} is not one of {', '.join(TARGETS)}")
    return {(i, t) for i in layers for t in spec}


def _fullmatches(spec: str, names: list[str], fail) -> list[bool]:
    """Which ``names`` the regex ``spec`` matches whole, worked out in a
    child process killed after REGEX_TIMEOUT_S (models/bounded.py): Python's
    re holds the GIL for a whole match, and a pattern such as ``(.*)*Z``
    backtracks for minutes on one module name."""
    if len(spec) > MAX_REGEX_CHARS:
        raise fail(f"target_modules is a regex of {len(spec)} characters; at most {MAX_REGEX_CHARS} are accepted")
    try:
        reply = bounded.run(
            {"op": "fullmatch", "pattern": spec, "names": names},
            timeout_s=REGEX_TIMEOUT_S,
            memory_bytes=REGEX_MEMORY_BYTES,
            reply_limit=64 + 8 * len(names),
            what=f"matching target_modules {spec!r} against the model's {len(names)} module names",
        )
    except bounded.Overrun as exc:
        raise fail(f"{exc}; give target_modules as a list of module names, or a regex that does not backtrack") from None
    if "error" in reply:
        raise fail(f"target_modules {spec!r} is {reply['error']}")
    return reply["matches"]


def weights_bound(config: ModelConfig, rank: int, allowed: set[tuple[int, str]] | None) -> int:
    """The most bytes a weights file of an adapter of ``rank`` can hold on a
    model of ``config`` and still be loaded: an A [rank, in] and a B [out,
    rank] for each module it may cover (those ``allowed``, or every one when
    the config does not say), at WEIGHT_VALUE_BYTES a value, plus the
    header's room. A bigger file cannot be a valid adapter, so refusing it
    by its size turns nothing good away, and no more than this is read."""
    modules = allowed if allowed is not None else {(i, t) for i in range(config.num_layers) for t in TARGETS}
    values = sum(rank * sum(io_features(config, target)) for _, target in modules)
    return values * WEIGHT_VALUE_BYTES + HEADER_SLACK_BYTES + HEADER_BYTES_PER_TENSOR * 2 * len(modules)


def _read_tensors(directory: Path, bound: int, bound_reason: str, fail) -> dict[str, torch.Tensor]:
    """Every tensor of the weights file, read whole (at most ``bound``
    bytes, which ``bound_reason`` explains) from one descriptor checked to
    be a regular file: nothing opens the path again, so nothing can swap
    the file after it was checked."""
    try:
        data = read_bytes(directory / WEIGHTS_FILE, bound)
    except FileRefused as exc:
        if not exc.missing:
            why = f" ({bound_reason})" if exc.oversize else ""
            raise fail(f"{_refused(WEIGHTS_FILE, exc)}{why}") from None
        if is_regular_file(directory / PICKLE_FILE):
            raise fail(f"{directory} has only {PICKLE_FILE}, a pickle file, which is not loaded (it can run code); "
                       f"convert it to {WEIGHTS_FILE} (e.g. load and save the adapter with PEFT's "
                       "save_pretrained(..., safe_serialization=True))") from None
        raise fail(f"no {WEIGHTS_FILE} in {directory}") from None
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError, and KeyError, ValueError for odd dtypes or shapes
        raise fail(f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    return {name: tensors[name] for name in sorted(tensors)}  # in name order, as safe_open lists them: the same first refusal every time


def _parse_name(tensor_name: str, config: ModelConfig, fail) -> tuple[int, str, str]:
    """(layer, target, "A" or "B") of one tensor name, or an AdapterError."""
    bare = tensor_name.removeprefix("base_model.model.")
    match = _LORA_TENSOR.fullmatch(bare)
    if match is None:
        raise fail(f"{WEIGHTS_FILE} holds {tensor_name!r}, which is not a LoRA A or B weight")
    module = match["module"]
    target = module.rsplit(".", 1)[-1]
    if target not in TARGETS:
        raise fail(f"target module {target!r} is not one of {', '.join(TARGETS)} (tensor {tensor_name!r})")
    where = _LAYER_MODULE.fullmatch(module)
    if where is None or where["parent"] != _PARENT[target] or where["target"] != target:
        raise fail(f"tensor {tensor_name!r} is not at a decoder layer's {target} (model.layers.N.{_PARENT[target]}.{target})")
    layer = int(where["layer"])
    if layer >= config.num_layers:
        raise fail(f"tensor {tensor_name!r} is for layer {layer}; the model has {config.num_layers} layers (0..{config.num_layers - 1})")
    return layer, target, match["ab"]


def _checked(tensor: torch.Tensor, label: str, shape: tuple[int, int], fail) -> torch.Tensor:
    """``tensor`` as contiguous float32 after its shape, dtype and values pass."""
    if tuple(tensor.shape) != shape:
        raise fail(f"{label} has shape {tuple(tensor.shape)}; the model needs {shape}")
    if not tensor.is_floating_point():
        raise fail(f"{label} has dtype {str(tensor.dtype).removeprefix('torch.')}; LoRA weights must be floating point")
    out = tensor.to(torch.float32).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise fail(f"{label} holds a non-finite value (NaN or infinity)")
    return out
