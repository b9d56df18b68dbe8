"""LoRA adapters resident in a model, and their share of a step.

An adapter (models/lora.py reads it) adds ``scale * B @ A`` to some of each
layer's matrices. Here each is laid out for the model's fused projections:
for q, k, v (one qkv matrix) the three A's are stacked into one [3r, in]
and the three B's placed block-diagonally into one [out, 3r] (zeros where
the adapter leaves a target out), with the scale folded into B; likewise
gate and up; o and down are single. A row of adapter ``key`` then gets

    y[row] += (x[row] @ A.T) @ B.T

after the base projection. The rows of one adapter are gathered and
multiplied together, every adapter's in the same step (the base model's
rows are untouched), so rows of different adapters and of the base model
share one step: a segmented low-rank product rather than a step per
adapter. In batch-invariant mode both products run in calls of fixed shape
(`tiled_linear`), so a row's bits never depend on which rows, of its
adapter or others, share its step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trioserve.kernels.tiled import tiled_linear

# The model's fused projections and the adapter targets each holds, in row order.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def _fused(
    adapter, layer: int, targets: tuple[str, ...], outs: list[int], in_features: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A [k r, in], B [sum(outs), k r]) of one fused projection, B scaled;
    None when the adapter touches none of its targets in this layer."""
    parts = adapter.weights.get(layer, {})
    if not any(t in parts for t in targets):
        return None
    r = adapter.rank
    a = torch.zeros(len(targets) * r, in_features, dtype=torch.float32)
    b = torch.zeros(sum(outs), len(targets) * r, dtype=torch.float32)
    row = 0
    for i, (target, out) in enumerate(zip(targets, outs, strict=True)):
        if target in parts:
            lora_a, lora_b = parts[target]
            a[i * r : (i + 1) * r] = lora_a
            b[row : row + out, i * r : (i + 1) * r] = lora_b * adapter.scale
        row += out
    return a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous()


class LoraSet:
    """The adapters a model holds, by key, each as its fused matrices per
    layer; at most ``capacity`` at once (--max-loras)."""

    def __init__(self, config, dtype: torch.dtype, capacity: int, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.capacity = capacity
        self._layers: dict[str, list[dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}

    def __len__(self) -> int:
        return len(self._layers)

    def add(self, key: str, adapter) -> None:
        """Make ``adapter`` resident under ``key``; ValueError when full."""
        if key in self._layers:
            raise ValueError(f"an adapter {key!r} is loaded already")
        if len(self._layers) >= self.capacity:
            raise ValueError(f"{len(self._layers)} adapters are loaded, as many as --max-loras ({self.capacity}) allows")
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {"qkv": ([q, kv, kv], c.hidden_size), "o": ([c.hidden_size], q), "gate_up": ([c.intermediate_size] * 2, c.hidden_size), "down": ([c.hidden_size], c.intermediate_size)}
        layers = []
        for layer in range(c.num_layers):
            fused = {}
            for name, targets in FUSED.items():
                outs, in_features = shapes[name]
                made = _fused(adapter, layer, targets, outs, in_features, self.dtype, self.device)
                if made is not None:
                    fused[name] = made
            layers.append(fused)
        self._layers[key] = layers

    def remove(self, key: str) -> None:
        self._layers.pop(key, None)

    def apply(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor, rows: tuple[tuple[str, torch.Tensor], ...], fixed: bool) -> torch.Tensor:
        """``y`` (the base projection of ``x``) with each adapter's low-rank
        product added to its own rows; ``y`` itself when none applies."""
        for key, index in rows:
            weights = self._layers.get(key)
            if weights is None:
                raise ValueError(f"the step asks for LoRA adapter {key!r}, which is not loaded")
            pair = weights[layer].get(name)
            if pair is None:
                continue
            a, b = pair
            picked = x.index_select(0, index).to(a.dtype)
            if fixed:
                delta = tiled_linear(tiled_linear(picked, a), b)
            else:
                delta = F.linear(F.linear(picked, a), b)
            y = y.index_add(0, index, delta.to(y.dtype))
        return y
