"""A step's layers in one C call (kernels/layer_runner.py,
`trioserve_run_layers`): where every per-layer call of a model would be a C
kernel, the model runs its layers through the runner, and the logits and
the KV pool it leaves are the same bits as the layer-by-layer forward's, for
prompt chunks, decode rows, both in one step, pad rows, mixed-type fused
projections (Q4_K with 5-bit v and down, Q8_0 o), bf16 and float32
weights, a bf16 pool under float32 weights, at every instruction-set level
this CPU runs. Where some call would not be a C kernel there is no runner;
a bad step is refused with the per-call kernels' words."""

from __future__ import annotations

import gguf
import pytest
import torch

from tests.kernels.test_native_q8 import LEVELS, _use_level
from tests.models.test_k_quants import SHAPE, _mixed
from tests.tiny_model import tiny_weights, write_gguf
from tests.tiny_tokenizer import train_tiny_tokenizer
from trioserve.kernels import native_build
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step

Q = gguf.GGMLQuantizationType
BLOCK = 4
FILES = {"q4_k_m-like": _mixed, "q4_0": lambda name: Q.Q4_0, "q8_0": lambda name: Q.Q8_0}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, object]:
    tokenizer = train_tiny_tokenizer()
    weights = tiny_weights(tokenizer.get_vocab_size(), seed=5, shape=SHAPE)
    root = tmp_path_factory.mktemp("runner")
    return {name: write_gguf(root / f"{name}.gguf", weights, tokenizer, shape=SHAPE, qtype_of=pick) for name, pick in FILES.items()}


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch) -> str:
    _use_level(request.param, monkeypatch)
    return request.param


def _steps() -> list:
    """A prompt chunk; a decode row beside another sequence's prompt chunk
    (two attention groups); two decode rows; a prompt whose chunk is padded
    to a bucket (pad rows after the real ones)."""
    a, b, c = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12]
    return [
        build_step([SeqChunk(list(range(5, 17)), 0, a)], BLOCK, fixed=True),
        build_step([SeqChunk([7], 12, a, decode=True), SeqChunk(list(range(40, 53)), 0, b)], BLOCK, fixed=True),
        build_step([SeqChunk([8], 13, a, decode=True), SeqChunk([9], 13, b, decode=True)], BLOCK, fixed=True),
        build_step([SeqChunk([3, 30, 31, 32, 33, 34, 35, 36, 37], 0, c)], BLOCK, fixed=True),
    ]


@pytest.mark.parametrize("file", list(FILES))
@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)], ids=["f32", "bf16", "f32-bf16pool"])
def test_the_runner_gives_the_layer_by_layer_bits(level, files, file, dtype, kv_dtype):
    ckpt = load_checkpoint(files[file], dtype=dtype)
    one_call = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, activations="int8", kv_dtype=kv_dtype)
    per_call = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, activations="int8", kv_dtype=kv_dtype)
    assert one_call.runner is not None, "every call of this model is a C kernel: the runner should take it"
    per_call.runner = None
    caches = {m: m.new_kv_cache(16, BLOCK) for m in (one_call, per_call)}
    for i, step in enumerate(_steps()):
        if i == 3:
            assert step.token_ids.shape[0] > step.num_tokens, "the last step should carry pad rows"
        got, want = one_call.forward(step, caches[one_call]), per_call.forward(step, caches[per_call])
        assert got.dtype == torch.float32 and torch.equal(got, want), f"step {i}: logits differ"
        assert torch.equal(caches[one_call].k, caches[per_call].k) and torch.equal(caches[one_call].v, caches[per_call].v), f"step {i}: pool differs"
    # forward_hidden (embeddings, speculative verification) goes through the same layers.
    step = build_step([SeqChunk(list(range(60, 66)), 0, [13, 14])], BLOCK, fixed=True)
    rows = torch.tensor([5], dtype=torch.int64)
    hidden = torch.arange(6, dtype=torch.int64)
    (la, ha), (lb, hb) = (m.forward_hidden(step, caches[m], rows, hidden) for m in (one_call, per_call))
    assert torch.equal(la, lb) and torch.equal(ha, hb)


def test_the_stacked_projection_of_a_mixed_file_runs_in_parts(level, files):
    """q and k in Q4_K, v in Q5_1: the runner describes the fused qkv as two parts side by side."""
    model = DecoderModel.from_checkpoint(load_checkpoint(files["q4_k_m-like"], dtype=torch.float32), batch_invariant=True, activations="int8")
    layer = model.runner._layers[0]
    assert layer.qkv.parts == 2 and layer.qkv.n == layer.qkv.part[0].n + layer.qkv.part[1].n
    assert (layer.o.parts, layer.gate_up.parts, layer.down.parts) == (1, 1, 1)
    assert [layer.qkv.part[0].kind, layer.qkv.part[1].kind, layer.o.part[0].kind, layer.down.part[0].kind] == [1, 2, 4, 2]


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"kernels": "reference", "activations": "int8"}, "the torch twins"),
        ({"activations": "bf16"}, "bf16 activations: prompt rows through torch's matmul"),
        ({"use_int4": False, "activations": "int8"}, "dense float32 weights"),
    ],
)
def test_no_runner_where_some_call_is_not_a_c_kernel(files, options, why):
    if native_build.library() is None:
        pytest.skip("no C kernels here (no C compiler, or TRIOSERVE_NATIVE_KERNELS=0)")
    model = DecoderModel.from_checkpoint(load_checkpoint(files["q4_0"], dtype=torch.float32), batch_invariant=True, **options)
    assert model.runner is None, why
    logits = model.forward(_steps()[0], model.new_kv_cache(16, BLOCK))  # and it runs layer by layer
    assert logits.shape[0] == 1 and torch.isfinite(logits).all()


def test_a_slot_outside_the_pool_is_refused_with_the_per_call_words(level, files):
    model = DecoderModel.from_checkpoint(load_checkpoint(files["q4_0"], dtype=torch.float32), batch_invariant=True, activations="int8")
    assert model.runner is not None
    step = build_step([SeqChunk([5, 6, 7], 0, [40])], BLOCK, fixed=True)  # block 40 of a 16-block pool
    with pytest.raises(RuntimeError, match="rope_write_kv failed with code 3: a position or slot is out of range"):
        model.forward(step, model.new_kv_cache(16, BLOCK))
    model.runner = None
    with pytest.raises(RuntimeError, match="rope_write_kv: a position or slot is out of range"):
        model.forward(step, model.new_kv_cache(16, BLOCK))
