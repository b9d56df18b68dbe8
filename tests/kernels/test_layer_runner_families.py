"""The C layer loop (kernels/layer_runner.py, `trioserve_run_layers`) on
the layers of the families beyond Llama: Qwen3's q/k norm, and sliding-
window attention (every layer of a model given a window here). The same
model with `runner = None` runs layer by layer in Python through the same
kernels; the two must give the same logits and the same KV pool, bit for
bit, on chunked prompts, decode rows beside prompt rows, and pad rows, at
every instruction-set level this CPU runs."""

from __future__ import annotations

import attrs
import pytest
import torch

from tests.families import build_family
from tests.kernels.levels import ALL_LEVELS, use_level
from trioserve.kernels import native
from trioserve.kernels.layer_runner import LayerRunner
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step

BLOCK = 4
DTYPES = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)]
DTYPE_IDS = ["f32", "bf16", "f32-bf16pool"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(params=ALL_LEVELS)
def level(request, monkeypatch) -> str:
    use_level(request.param, monkeypatch, lambda: native.int8_q8_supported(16, 32), "8-bit codes kernel")
    return request.param


def _steps(batch_invariant: bool) -> list:
    """Three sequences over 13 blocks: prompt chunks (one padded to a
    bucket), a decode row beside another sequence's chunk, decode rows
    together, and sequences past a few blocks (so a window of 6 keys
    leaves whole blocks behind)."""
    a, b, c = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12]
    fixed = batch_invariant
    return [
        build_step([SeqChunk(list(range(5, 17)), 0, a)], BLOCK, fixed=fixed),
        build_step([SeqChunk([7], 12, a, decode=True), SeqChunk(list(range(40, 53)), 0, b)], BLOCK, fixed=fixed),
        build_step([SeqChunk([8], 13, a, decode=True), SeqChunk([9], 13, b, decode=True)], BLOCK, fixed=fixed),
        build_step([SeqChunk([10], 14, a, decode=True), SeqChunk([3, 30, 31, 32, 33, 34, 35, 36, 37], 0, c)], BLOCK, fixed=fixed),
        build_step([SeqChunk([11], 15, a, decode=True), SeqChunk([12], 14, b, decode=True), SeqChunk([38, 39], 9, c)], BLOCK, fixed=fixed),
    ]


def _twins(path, dtype, kv_dtype, *, batch_invariant: bool = True, windows: list | None = None) -> tuple[DecoderModel, DecoderModel]:
    """The model twice from ``path``: one running its layers in one C call,
    one layer by layer (runner None). ``windows``: layer i made a
    sliding-window layer of windows[i] keys where not None (as a Mistral's,
    Phi-3's or Gemma 3's)."""
    ckpt = load_checkpoint(path, dtype=dtype)
    models = []
    for _ in range(2):
        model = DecoderModel.from_checkpoint(ckpt, batch_invariant=batch_invariant, activations="int8", kv_dtype=kv_dtype)
        if windows is not None:
            model.specs = [
                spec if w is None else attrs.evolve(spec, mixer="sliding_attention", window=w) for spec, w in zip(model.specs, windows)
            ]  # fmt: skip
            model.windows = sorted({w for w in windows if w is not None})
            model.runner = LayerRunner.for_model(model)
        models.append(model)
    one_call, per_call = models
    per_call.runner = None
    return one_call, per_call


def _same_bits(one_call: DecoderModel, per_call: DecoderModel, steps: list) -> None:
    caches = {m: m.new_kv_cache(16, BLOCK) for m in (one_call, per_call)}
    for i, step in enumerate(steps):
        got, want = one_call.forward(step, caches[one_call]), per_call.forward(step, caches[per_call])
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert torch.equal(got, want), f"step {i}: logits differ (largest gap {float((got - want).abs().max()):.3g})"
        for name in ("k", "v"):
            assert torch.equal(getattr(caches[one_call], name), getattr(caches[per_call], name)), f"step {i}: the pool's {name} differs"
    # forward_hidden (embeddings, speculative verification) goes through the same layers.
    step = build_step([SeqChunk(list(range(60, 66)), 0, [13, 14])], BLOCK, fixed=one_call.batch_invariant)
    rows, hidden = torch.tensor([5], dtype=torch.int64), torch.arange(6, dtype=torch.int64)
    (la, ha), (lb, hb) = (m.forward_hidden(step, caches[m], rows, hidden) for m in (one_call, per_call))
    assert torch.equal(la, lb) and torch.equal(ha, hb)


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
def test_qwen3_layers_run_in_c_with_the_per_call_bits(level, qwen3, dtype, kv_dtype):
    one_call, per_call = _twins(qwen3["gguf_q8_0"], dtype, kv_dtype)
    assert all(spec.qk_norm for spec in one_call.specs)
    assert one_call.runner is not None, "Qwen3's layers (q/k norm) on the codes kernels: the C loop should take them"
    assert all(layer.q_norm and layer.k_norm for layer in one_call.runner._layers)
    _same_bits(one_call, per_call, _steps(True))


def test_qwen3_without_batch_invariance_too(level, qwen3):
    one_call, per_call = _twins(qwen3["gguf_q8_0"], torch.float32, None, batch_invariant=False)
    assert one_call.runner is not None
    _same_bits(one_call, per_call, _steps(False))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("phi3"), "phi3")


@pytest.mark.parametrize("windows", [[6, 6], [3, None], [None, 1]], ids=["every-layer", "first-layer", "a-window-of-one"])
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
def test_sliding_window_layers_run_in_c_with_the_per_call_bits(level, qwen3, dtype, kv_dtype, windows):
    """Qwen3's layers given windows: the C loop reads each layer's own
    window (`trioserve_window_attention`), as the per-call path's kernel does."""
    one_call, per_call = _twins(qwen3["gguf_q8_0"], dtype, kv_dtype, windows=windows)
    assert one_call.runner is not None, "sliding-window layers on the codes kernels: the C loop should take them"
    assert [layer.window for layer in one_call.runner._layers] == [w or 0 for w in windows]
    assert per_call.kernels.windows_in_place  # so the per-call path reads the window in place too
    _same_bits(one_call, per_call, _steps(True))


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
def test_phi3_runs_in_c_with_the_per_call_bits(level, phi3, dtype, kv_dtype):
    """Phi-3 (every layer within its window of 8, head width 16) as its files describe it."""
    one_call, per_call = _twins(phi3["gguf_q8_0"], dtype, kv_dtype)
    assert {spec.window for spec in one_call.specs} == {8}
    assert one_call.runner is not None
    _same_bits(one_call, per_call, _steps(True))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("gemma3"), "gemma3", tie=True)


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
def test_gemma3_layers_run_in_c_with_the_per_call_bits(level, gemma3, dtype, kv_dtype):
    """Gemma 3: five local layers (a window of 8, their own RoPE tables) to a
    global one, q/k norm, sandwich norms, GeGLU; the embedding scale and
    the soft-capped head stay in Python."""
    one_call, per_call = _twins(gemma3["gguf_q8_0"], dtype, kv_dtype)
    assert [spec.window for spec in one_call.specs] == [8, 8, 8, 8, 8, None, 8]
    assert one_call.runner is not None, "Gemma 3's layers on the codes kernels: the C loop should take them"
    layers = one_call.runner._layers
    assert [layer.window for layer in layers] == [8, 8, 8, 8, 8, 0, 8]
    assert all(layer.post_attn_norm and layer.post_mlp_norm and layer.q_norm and layer.activation == 1 for layer in layers)
    assert layers[0].cos != layers[5].cos and layers[0].cos == layers[1].cos  # local and global RoPE tables
    _same_bits(one_call, per_call, _steps(True))


def test_gemma3_without_batch_invariance_too(level, gemma3):
    one_call, per_call = _twins(gemma3["gguf_q8_0"], torch.float32, None, batch_invariant=False)
    assert one_call.runner is not None
    _same_bits(one_call, per_call, _steps(False))
