"""An F16 or BF16 GGUF keeps its layer matrices in the file's 16 bits
(kernels/w16.py): none is held as a float32 copy, every row runs through the
16-bit weight kernel, and the model computes what the dense float32 model of
the same values computes (to float32 rounding), through the model and
through the engine."""

from __future__ import annotations

import gguf
import pytest
import torch
import trio

from tests.tiny_model import TINY, tiny_weights, write_gguf
from tests.tiny_tokenizer import train_tiny_tokenizer
from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.kernels import native_build
from trioserve.kernels.projection import Projection
from trioserve.kernels.w16 import W16Pack
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step
from trioserve.types import GenerateRequest, SamplingParams, TokenEvent

Q = gguf.GGMLQuantizationType
needs_kernels = pytest.mark.skipif(native_build.library() is None, reason="the C kernels do not build here (no C compiler)")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tokenizer = train_tiny_tokenizer()
    weights = tiny_weights(tokenizer.get_vocab_size(), seed=4)
    root = tmp_path_factory.mktemp("w16")
    out = {q: write_gguf(root / f"tiny-{q.name}.gguf", weights, tokenizer, qtype=q) for q in (Q.F16, Q.BF16)}
    tied = tiny_weights(tokenizer.get_vocab_size(), seed=4, tie=True)
    out["tied"] = write_gguf(root / "tiny-tied-F16.gguf", tied, tokenizer, qtype=Q.F16)
    return out


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, "tied"], ids=lambda q: getattr(q, "name", q))
def test_sixteen_bit_layers_are_kept_as_such_and_compute_the_float32_models_logits(files, qtype):
    ckpt = load_checkpoint(files[qtype], dtype=torch.float32)
    tied = qtype == "tied"
    layers = {n for n in ckpt.weights if n.startswith("model.layers.") and n.endswith("proj.weight")}
    head = {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    assert set(ckpt.w16) == layers | head and not any(ckpt.weights.is_held(n) for n in layers | head)
    assert all(ckpt.w16[n].bf16 == (qtype == Q.BF16) for n in layers)
    fast = DecoderModel.from_checkpoint(ckpt, batch_invariant=True)
    exact = DecoderModel.from_checkpoint(ckpt, use_int4=False, batch_invariant=True, kernels="reference")
    for layer in fast.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            p = getattr(layer, name)
            assert isinstance(p, Projection) and isinstance(p.native, W16Pack) and p.weight.is_meta and p.every_row_kernel, name
            assert not p.quantized  # no 8-bit head is made for a 16-bit model
    # The head too runs on the file's bits (into float32 logits), and the embedding's rows come from the file.
    assert fast.head_int8 is None and fast.head_w16 is not None and fast.lm_head.is_meta
    assert fast.embed_rows is not None and fast.embed.is_meta
    assert not ckpt.weights.is_held("model.embed_tokens.weight") and ("lm_head.weight" in ckpt.weights) != tied
    caches = {m: m.new_kv_cache(8, 4) for m in (fast, exact)}
    step = build_step([SeqChunk([5, 9, 33, 7, 2, 8, 11, 4], 0, [0, 1])], 4, fixed=True)
    for pos in range(8, 14):
        a, b = fast.forward(step, caches[fast])[-1], exact.forward(step, caches[exact])[-1]
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), pos
        assert int(a.argmax()) == int(b.argmax())
        step = build_step([SeqChunk([int(b.argmax())], pos, [0, 1, 2, 3], decode=True)], 4, fixed=True)


async def _greedy(path, use_int4: bool) -> list[int]:
    async with open_engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=2, use_int4=use_int4)) as engine:
        kind = "16-bit" if use_int4 else "dense"
        assert engine.compute["weights"] == {"layers": {kind: 4 * TINY["num_hidden_layers"]}, "head": kind}
        request = GenerateRequest([5, 9, 33, 7, 2, 8, 11, 4], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        return [e.token_id async for e in engine.generate(request) if isinstance(e, TokenEvent)]


@needs_kernels
def test_the_engine_serves_an_f16_file_with_the_float32_models_tokens(files):
    got = trio.run(_greedy, files[Q.F16], True)
    assert len(got) == 10
    assert got == trio.run(_greedy, files[Q.F16], False)  # the dense float32 copy (use_int4=False)
