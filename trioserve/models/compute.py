"""How a model computes, in words a person or a trace can read: the model
card's `compute` (device, dtype, kernel set, the C kernels' instruction
sets, activations, threads, weights), its one-line form for the start-up
line, and the CPU class a trace's header records (`cpu_class`), which
core/replay.py compares with the replaying machine's."""

from __future__ import annotations

import platform

import torch

from trioserve.models.decoder import DecoderModel


def compute_card(model: DecoderModel) -> dict[str, object]:
    """How ``model`` computes, for the start-up line, the model card and
    /metrics: device, dtype, kernel set, the instruction sets of the CPU's C
    kernels (null where they do not run), the 4-bit rows' activations, the
    CPU threads, and how the weights are held (`weight_card`)."""
    from trioserve.kernels import native

    cpu = model.device.type == "cpu"
    return {
        "device": model.device.type,
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_dtype": str(model.kv_dtype).removeprefix("torch."),
        "kernels": model.kernels.name,
        "cpu_kernels": native.isa() if cpu and model.kernels.name == "native" else None,
        "activations": model.kernels.activations,
        "threads": torch.get_num_threads() if cpu else None,
        "weights": weight_card(model),
    }


def weight_card(model: DecoderModel) -> dict[str, object] | None:
    """How the model holds its weights: the layer matrices counted by kind
    (`Projection.kind`: 4-, 6- or 8-bit codes, an F16/BF16 file's 16 bits,
    or dense; a fused matrix whose parts differ counts each part), and the
    output head's kind (the same words, or "8-bit copy"). None for a model handed to the engine that does
    not show its layers."""
    if not hasattr(model, "layers"):
        return None
    layers: dict[str, int] = {}
    for layer in model.layers:
        for fused in (layer.qkv, layer.o, layer.gate_up, layer.down):
            for part in getattr(fused, "parts", [fused]):
                layers[part.kind] = layers.get(part.kind, 0) + 1
    head_codes = getattr(model, "head_codes", None)
    if head_codes is not None:  # the file's own codes (its type's kind)
        head = head_codes.kind
    else:  # the model's 8-bit copy of a head whose type has no kernel, an F16/BF16 file's bits, or dense
        head = "8-bit copy" if model.head_int8 is not None else "16-bit" if model.head_w16 is not None else "dense"
    return {"layers": dict(sorted(layers.items())), "head": head}


def describe_compute(card: dict[str, object]) -> str:
    """`compute_card` in one line of words."""
    isa = f" ({card['cpu_kernels']})" if card.get("cpu_kernels") else ""
    threads = f", {card['threads']} thread{'' if card.get('threads') == 1 else 's'}" if card.get("threads") else ""
    pool = f" ({card['kv_dtype']} KV pool)" if card.get("kv_dtype", card["dtype"]) != card["dtype"] else ""
    return f"{card['device']}, {card['dtype']}{pool}, {card['kernels']} kernels{isa}, {card['activations']} activations{threads}"


def cpu_class(model: DecoderModel) -> dict[str, object]:
    """What a model's bits may depend on besides its settings, for a trace's
    header: the machine's architecture, torch's CPU capability (the vector
    width of its own operations), the C kernels' instruction sets, and how
    the model computes (`compute_card`: kernels, dtype, activations,
    weights). core/replay.py compares it with the replaying machine's."""
    card = compute_card(model)
    card.pop("threads", None)
    card.pop("device", None)
    return {"arch": platform.machine(), "torch": torch.backends.cpu.get_cpu_capability(), **card}
