"""A Q8_0 GGUF runs on its signed 8-bit codes (kernels/int8w.py): no layer
projection is held dense, and with int8 activations the model picks the
float32 model's greedy tokens, through the model and through the engine."""

from __future__ import annotations

import pytest
import torch
import trio

from tests.tiny_model import TINY
from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.kernels import native
from trioserve.kernels.projection import Projection
from trioserve.kernels.int8w import Int8CodesPack, Int8Parts
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step
from trioserve.types import GenerateRequest, SamplingParams, TokenEvent

PROJECTIONS = ("qkv", "o", "gate_up", "down")
# int8 activations outside `--kernels reference` need the C kernels; without
# them (no C compiler, a CPU with none of their instruction sets) the model
# refuses int8 (select_kernels asks for the 4-bit one), and these cases skip
# saying why.
NO_INT8_KERNEL = "no int8-activation C kernel here (no C compiler, or no AVX2 / AVX-512 VNNI / NEON dotprod)"


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_a_q8_0_model_runs_its_codes_and_agrees_with_float32(tiny_checkpoints, kernels):
    if kernels == "auto" and not native.int4_q8_supported(16, 32):
        pytest.skip(NO_INT8_KERNEL)
    ckpt = load_checkpoint(tiny_checkpoints["gguf_q8_0"], dtype=torch.float32)
    # Every layer matrix and the head as their codes.
    assert set(ckpt.int8) == {n for n in ckpt.weights if n.startswith("model.layers.") and n.endswith("proj.weight")} | {"lm_head.weight"}
    assert not any(ckpt.weights.is_held(n) for n in ckpt.int8)
    fast = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, kernels=kernels, activations="int8")
    exact = DecoderModel.from_checkpoint(ckpt, use_int4=False, batch_invariant=True, kernels="reference", activations="bf16")
    for layer in fast.layers:
        for name in PROJECTIONS:
            p = getattr(layer, name)
            assert isinstance(p, Projection) and p.every_row_8bit and p.weight.is_meta, name
            assert isinstance(p.q8_twin if kernels == "reference" else p.native, (Int8Parts, Int8CodesPack)), name
    head = fast.head_codes  # the file's Q8_0 head on the same kernel, no copy (the tiny vocabulary padded to 16s)
    assert head is not None and fast.head_int8 is None and fast.lm_head.is_meta
    assert isinstance(head.q8_twin if kernels == "reference" else head.native, (Int8Parts, Int8CodesPack))
    # Teacher-forced on the float32 model's greedy tokens (that model computes
    # the file's dequantized weights): logits within the 8-bit inputs' reach.
    caches = {m: m.new_kv_cache(8, 4) for m in (fast, exact)}
    step = build_step([SeqChunk([5, 9, 33, 7, 2, 8, 11, 4], 0, [0, 1])], 4, fixed=True)
    same = 0
    for pos in range(8, 16):
        a, b = fast.forward(step, caches[fast])[-1], exact.forward(step, caches[exact])[-1]
        assert (a - b).abs().max() <= 0.03 * b.abs().max(), pos
        same += int(a.argmax()) == int(b.argmax())
        step = build_step([SeqChunk([int(b.argmax())], pos, [0, 1, 2, 3], decode=True)], 4, fixed=True)
    assert same >= 7, f"the codes chose float32's token at {same} of 8 steps"


async def _greedy(path, activations: str, prompt: list[int]) -> tuple[list[int], dict]:
    config = EngineConfig(model=str(path), dtype="float32", activations=activations, max_num_seqs=2)
    async with open_engine(config) as engine:
        out = []
        async for event in engine.generate(GenerateRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))):
            if isinstance(event, TokenEvent):
                out.append(event.token_id)
        return out, engine.compute["weights"]


def test_the_engine_serves_a_q8_0_file_on_its_codes_with_float32s_tokens(tiny_checkpoints):
    if not native.int4_q8_supported(16, 32):
        pytest.skip(NO_INT8_KERNEL)
    prompt = [5, 9, 33, 7, 2, 8, 11, 4]
    codes, held = trio.run(_greedy, tiny_checkpoints["gguf_q8_0"], "int8", prompt)
    dense, held_dense = trio.run(_greedy, tiny_checkpoints["gguf_q8_0"], "bf16", prompt)
    # what the model card and /metrics say of the weights
    assert held == {"layers": {"8-bit": 4 * TINY["num_hidden_layers"]}, "head": "8-bit"}
    assert held_dense == {"layers": {"dense": 4 * TINY["num_hidden_layers"]}, "head": "dense"}
    assert len(codes) == 12
    agree = next((i for i, (a, b) in enumerate(zip(codes, dense)) if a != b), len(codes))
    assert agree >= 6, f"the 8-bit codes left float32's greedy tokens at token {agree}: {codes} vs {dense}"
