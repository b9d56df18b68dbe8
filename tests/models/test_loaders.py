"""The checkpoint loaders on the tiny random Llama (tests/tiny_model.py).

The HF safetensors directory and the F32 GGUF are written from the same
weights, the GGUF with llama.cpp's Q/K row permutation, so equal loaded
weights and equal logits show the loaders agree and the permutation is undone.
The quantized GGUFs are checked against the error their formats allow. Every
broken checkpoint must be one CheckpointError naming the file and the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest
import tokenizers
import torch

from tests import tiny_model
from tests.tiny_model import permute_rows, set_gguf_u32, tiny_weights, write_gguf, write_hf_dir
from tests.tiny_tokenizer import BOS_ID, EOS_ID, train_tiny_tokenizer
from trioserve.errors import CheckpointError
from trioserve.models.checkpoint import Checkpoint, load_checkpoint
from trioserve.models.gguf_file import open_reader
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step

BLOCK_SIZE = 4  # KV cache block size: the prompt spans several blocks
PROMPT = "The quick brown fox jumps over 3 lazy dogs."
QK = 32  # Q8_0 and Q4_1 both quantize runs of 32 values along a row
FP16_REL = 2.0**-11  # relative rounding error of the fp16 scale and minimum
N_TENSORS = 21  # embed, norm, lm_head + 2 layers x 9


@pytest.fixture(scope="module")
def originals() -> dict[str, np.ndarray]:
    """The weights build_tiny_checkpoints wrote (HF names, unpermuted)."""
    return tiny_weights(train_tiny_tokenizer().get_vocab_size(), seed=0)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints) -> dict[str, Checkpoint]:
    return {kind: load_checkpoint(path, dtype=torch.float32) for kind, path in tiny_checkpoints.items()}


def last_logits(config, weights, ids: list[int]) -> torch.Tensor:
    """Logits after prefilling ``ids`` in one chunk, blocks deliberately out of order."""
    model = DecoderModel(config, weights)
    blocks = -(-len(ids) // BLOCK_SIZE)
    cache = model.new_kv_cache(blocks + 1, BLOCK_SIZE)
    table = list(range(blocks, 0, -1))
    return model.forward(build_step([SeqChunk(ids, 0, table)], BLOCK_SIZE), cache)[0]


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# -- the HF directory and the F32 GGUF are one model ---------------------------


def test_hf_and_f32_gguf_have_the_same_config(loaded):
    hf, gg = loaded["hf"].config, loaded["gguf_f32"].config
    assert (hf.architecture, hf.vocab_size, hf.hidden_size, hf.intermediate_size) == ("llama", 360, 64, 128)
    assert (hf.num_layers, hf.num_heads, hf.num_kv_heads, hf.head_dim) == (2, 4, 2, 16)
    assert (hf.max_position, hf.rope_theta, hf.tie_embeddings) == (256, 10000.0, False)
    # GGUF stores the epsilon as float32, so it reads back as 1e-5 rounded.
    assert gg.rms_eps == pytest.approx(hf.rms_eps, rel=1e-7)
    assert attrs.evolve(gg, rms_eps=hf.rms_eps) == hf


def test_hf_and_f32_gguf_have_the_original_weights(loaded, originals, tiny_checkpoints):
    hf, gg = loaded["hf"].weights, loaded["gguf_f32"].weights
    assert set(hf) == set(gg) == set(originals)
    for name, array in originals.items():
        want = torch.from_numpy(array)
        assert hf[name].dtype == gg[name].dtype == torch.float32, name
        assert torch.equal(hf[name], want), name
        assert torch.equal(gg[name], want), name
    # The file itself holds permuted Q/K rows, so the equality above is the
    # loader's un-permutation at work, not a no-op.
    reader = gguf.GGUFReader(tiny_checkpoints["gguf_f32"])
    raw = {t.name: np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    q, k = originals["model.layers.0.self_attn.q_proj.weight"], originals["model.layers.0.self_attn.k_proj.weight"]
    assert not np.array_equal(raw["blk.0.attn_q.weight"], q)
    assert np.array_equal(raw["blk.0.attn_q.weight"], permute_rows(q, 4))
    assert np.array_equal(raw["blk.0.attn_k.weight"], permute_rows(k, 2))


def test_hf_and_gguf_tokenizers_agree(loaded, tiny_checkpoints):
    hf, gg = loaded["hf"].tokenizer, loaded["gguf_f32"].tokenizer
    trained = tokenizers.Tokenizer.from_file(str(tiny_checkpoints["hf"] / "tokenizer.json"))
    texts = [PROMPT, "def add(a, b):\n    return a + b\n", "crème brûlée 2024 — 日本 🙂"]
    texts.append("<|im_start|>user\nhi<|im_end|>")  # special tokens as single ids
    for text in texts:
        ids = hf.encode(text)
        assert ids == gg.encode(text), text
        assert ids == trained.encode(text, add_special_tokens=False).ids, text
        assert hf.decode(ids, skip_special=False) == gg.decode(ids, skip_special=False) == text
    assert (hf.bos_id, hf.eos_id, hf.stop_ids) == (gg.bos_id, gg.eos_id, gg.stop_ids) == (BOS_ID, EOS_ID, {EOS_ID})
    assert hf.vocab_size == gg.vocab_size == 360
    assert hf.encode("<|im_start|>user")[0] == gg.encode("<|im_start|>user")[0] == BOS_ID


def test_hf_and_f32_gguf_give_the_same_logits(loaded):
    hf, gg = loaded["hf"], loaded["gguf_f32"]
    ids = gg.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * BLOCK_SIZE
    reference = last_logits(hf.config, hf.weights, ids)
    torch.testing.assert_close(last_logits(gg.config, gg.weights, ids), reference, atol=1e-5, rtol=0)
    assert reference.std() > 0.5  # far from uniform, so a wrong forward would show

    # What a loader that forgot to un-permute Q and K would produce: clearly off.
    permuted = dict(gg.weights)
    for i in range(gg.config.num_layers):
        for proj, heads in (("q", gg.config.num_heads), ("k", gg.config.num_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            permuted[name] = torch.from_numpy(permute_rows(permuted[name].numpy(), heads))
    assert (last_logits(gg.config, permuted, ids) - reference).abs().max() > 1e-2


def test_load_applies_the_dtype(tiny_checkpoints, originals):
    for kind in ("hf", "gguf_f32"):
        weights = load_checkpoint(tiny_checkpoints[kind], dtype=torch.bfloat16).weights
        for name, array in originals.items():
            assert weights[name].dtype == torch.bfloat16, (kind, name)
            assert torch.equal(weights[name], torch.from_numpy(array).to(torch.bfloat16)), (kind, name)


# -- quantized GGUFs -----------------------------------------------------------


def quant_error_bound(original: np.ndarray, kind: str) -> np.ndarray:
    """The largest error each 32-block of ``original`` may have after a round
    trip through ``kind`` ([rows, cols / 32]).

    Q8_0: d = absmax / 127 (stored fp16), q = round(x / d) in [-127, 127]:
        |x - q * d16| <= d / 2 + 127 * |d - d16| <= d * (1/2 + 127 * 2^-11).
    Q4_1: d = (max - min) / 15, q = round((x - min) / d) in [0, 15], d and min
        stored fp16: |err| <= d / 2 + 15 * |d - d16| + |min - min16|."""
    blocks = original.reshape(original.shape[0], -1, QK).astype(np.float64)
    if kind == "gguf_q8_0":
        d = np.abs(blocks).max(-1) / 127
        bound = d * (0.5 + 127 * FP16_REL)
    else:
        lo, hi = blocks.min(-1), blocks.max(-1)
        d = (hi - lo) / 15
        bound = d * (0.5 + 15 * FP16_REL) + np.abs(lo) * FP16_REL
    return bound * (1 + 1e-5) + 1e-7  # float32 arithmetic on top


@pytest.mark.parametrize("kind", ["gguf_q8_0", "gguf_q4_1"])
def test_quantized_weights_are_within_the_format_error(kind, loaded, originals):
    weights = loaded[kind].weights
    assert set(weights) == set(originals)
    worst = 0.0
    for name, original in originals.items():
        got = weights[name].numpy()
        assert got.shape == original.shape, name
        if original.ndim == 1:  # norms are written F32 and must come back exact
            assert np.array_equal(got, original), name
            continue
        error = np.abs(got.astype(np.float64) - original).reshape(original.shape[0], -1, QK).max(-1)
        bound = quant_error_bound(original, kind)
        bad = np.argwhere(error > bound)
        assert bad.size == 0, f"{name}: block {tuple(bad[0])} error {error[tuple(bad[0])]} > {bound[tuple(bad[0])]}"
        worst = max(worst, float((error / bound).max()))
    # The bound is not vacuous: some block comes close to it (and the matrices
    # really were quantized).
    assert worst > 0.5


@pytest.mark.parametrize(("kind", "limit"), [("gguf_q8_0", 0.05), ("gguf_q4_1", 0.4)])
def test_quantized_logits_stay_close_to_f32(kind, limit, loaded):
    """Relative L2 distance of the logits; measured ~0.011 (Q8_0) and ~0.18
    (Q4_1), while unrelated logits would be ~1.4 apart."""
    f32, quant = loaded["gguf_f32"], loaded[kind]
    assert quant.config == f32.config
    ids = f32.tokenizer.encode(PROMPT)
    assert quant.tokenizer.encode(PROMPT) == ids
    reference = last_logits(f32.config, f32.weights, ids)
    error = rel_error(last_logits(quant.config, quant.weights, ids), reference)
    assert 0 < error < limit


# -- tied embeddings, shards, progress ---------------------------------------


def test_tied_checkpoints_use_the_embedding_as_head(tiny_checkpoints_tied):
    hf = load_checkpoint(tiny_checkpoints_tied["hf"])
    gg = load_checkpoint(tiny_checkpoints_tied["gguf_f32"])
    for ckpt in (hf, gg):
        assert ckpt.config.tie_embeddings is True
        assert "lm_head.weight" not in ckpt.weights
        assert len(ckpt.weights) == N_TENSORS - 1
    assert attrs.evolve(gg.config, rms_eps=hf.config.rms_eps) == hf.config
    for name in hf.weights:
        assert torch.equal(hf.weights[name], gg.weights[name]), name

    ids = gg.tokenizer.encode(PROMPT)
    tied = last_logits(gg.config, gg.weights, ids)
    # The same model with an explicit head equal to the embedding: logits are
    # final_hidden @ embed.T in both.
    explicit = {**gg.weights, "lm_head.weight": gg.weights["model.embed_tokens.weight"].clone()}
    untied = last_logits(attrs.evolve(gg.config, tie_embeddings=False), explicit, ids)
    torch.testing.assert_close(tied, untied, atol=1e-6, rtol=0)
    torch.testing.assert_close(last_logits(hf.config, hf.weights, ids), tied, atol=1e-5, rtol=0)


def test_sharded_and_single_file_hf_dirs_load_the_same(tmp_path, tiny_checkpoints, originals):
    sharded = tiny_checkpoints["hf"]
    assert len(list(sharded.glob("*.safetensors"))) == 2 and (sharded / "model.safetensors.index.json").is_file()
    tok = tokenizers.Tokenizer.from_file(str(sharded / "tokenizer.json"))
    single = write_hf_dir(tmp_path / "single", originals, tok, shards=1)
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]
    assert not (single / "model.safetensors.index.json").exists()

    a, b = load_checkpoint(sharded), load_checkpoint(single)
    assert a.config == b.config
    assert set(a.weights) == set(b.weights) == set(originals)
    for name in originals:
        assert torch.equal(a.weights[name], b.weights[name]), name
    assert b.name == "single" and a.name == "hf"


@pytest.mark.parametrize("kind", ["hf", "gguf_f32", "gguf_q4_1"])
def test_progress_counts_every_tensor(kind, tiny_checkpoints):
    calls: list[tuple[int, int]] = []
    ckpt = load_checkpoint(tiny_checkpoints[kind], progress=lambda done, total: calls.append((done, total)))
    assert len(ckpt.weights) == N_TENSORS
    assert calls == [(i, N_TENSORS) for i in range(1, N_TENSORS + 1)]


# -- broken checkpoints ----------------------------------------------------------
# Each builder writes one broken checkpoint under tmp and returns
# (what to load, the path the error must name, a fragment of the problem).


def _gguf(tmp: Path, name: str, *, drop: str | None = None, replace: dict | None = None, **kw) -> Path:
    weights = tiny_weights(train_tiny_tokenizer().get_vocab_size())
    if drop:
        del weights[drop]
    weights.update(replace or {})
    return write_gguf(tmp / name, weights, train_tiny_tokenizer(), **kw)


def _copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return dst


def _tokenizer_meta(mp: pytest.MonkeyPatch, **changes) -> None:
    """Make write_gguf write tokenizer metadata with ``changes`` applied."""
    real = tiny_model.gguf_tokenizer_metadata
    mp.setattr(tiny_model, "gguf_tokenizer_metadata", lambda tok, **kw: {**real(tok, **kw), **changes})


def missing_path(tmp, ck, mp):
    return tmp / "absent.gguf", tmp / "absent.gguf", "no such file or directory"


def not_gguf(tmp, ck, mp):
    (tmp / "model.gguf").write_bytes(b"PK\x03\x04" + bytes(200))
    return tmp / "model.gguf", tmp / "model.gguf", "not a GGUF file (magic bytes b'PK\\x03\\x04', expected b'GGUF')"


def gguf_cut_in_header(tmp, ck, mp):
    (tmp / "cut.gguf").write_bytes(ck["gguf_f32"].read_bytes()[:100])
    return tmp / "cut.gguf", tmp / "cut.gguf", "truncated or corrupt GGUF file"


def gguf_cut_in_data(tmp, ck, mp):
    # The gguf reader itself notices the short last tensor, so this is the
    # reader-level message rather than the loader's per-tensor one.
    (tmp / "cut.gguf").write_bytes(ck["gguf_f32"].read_bytes()[:-1000])
    return tmp / "cut.gguf", tmp / "cut.gguf", "truncated"


def gguf_gpt2_architecture(tmp, ck, mp):
    path = _gguf(tmp, "gpt2.gguf", arch="gpt2")
    return path, path, "unsupported architecture 'gpt2' (supported: bert, gemma3, llama, mistral, phi3, qwen2, qwen3)"


def gguf_int32_tensor(tmp, ck, mp):
    path = _gguf(tmp, "i32.gguf", replace={"model.layers.0.mlp.up_proj.weight": np.zeros((128, 64), np.int32)})
    return path, path, "tensor 'blk.0.ffn_up.weight' uses quantization type I32, which trioserve cannot load"


def gguf_missing_tensor(tmp, ck, mp):
    path = _gguf(tmp, "missing.gguf", drop="model.layers.1.mlp.down_proj.weight")
    return path, path, "missing tensor 'blk.1.ffn_down.weight'"


def gguf_nan_tensor(tmp, ck, mp):
    v = tiny_weights(360)["model.layers.0.self_attn.v_proj.weight"].copy()
    v[3, 5] = np.nan
    path = _gguf(tmp, "nan.gguf", replace={"model.layers.0.self_attn.v_proj.weight": v})
    return path, path, "corrupt tensor 'blk.0.attn_v.weight': contains NaN or infinity"


def _poison_scale(path: Path, tensor: str, field: int, value: float) -> Path:
    """Set one float16 scale field (at byte ``field`` of block 1, row 1) of
    quantized ``tensor`` in the file to ``value``, as a bad write would."""
    t = next(t for t in open_reader(path).tensors if t.name == tensor)
    size = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
    at = t.data_offset + int(np.asarray(t.data).shape[1]) + size + field
    data = bytearray(path.read_bytes())
    data[at : at + 2] = np.array([value], np.float16).tobytes()
    path.write_bytes(bytes(data))
    return path


# A NaN or infinite block scale in each of the loader's quantized paths: the
# 4-bit codes (Q4_0), the up-to-6-bit codes (Q5_0), the 8-bit codes
# (Q8_0) and the head's (Q4_1's m). Found from the scale fields, never by
# dequantizing the tensor.
def gguf_nan_scale_q4_0(tmp, ck, mp):
    path = _poison_scale(_gguf(tmp, "q40.gguf", qtype=gguf.GGMLQuantizationType.Q4_0), "blk.1.ffn_down.weight", 0, np.nan)
    return path, path, "corrupt tensor 'blk.1.ffn_down.weight': contains NaN or infinity"


def gguf_inf_scale_q5_0(tmp, ck, mp):
    path = _poison_scale(_gguf(tmp, "q50.gguf", qtype=gguf.GGMLQuantizationType.Q5_0), "blk.0.attn_q.weight", 0, np.inf)
    return path, path, "corrupt tensor 'blk.0.attn_q.weight': contains NaN or infinity"


def gguf_inf_scale_q8_0(tmp, ck, mp):
    path = _poison_scale(_gguf(tmp, "q80.gguf", qtype=gguf.GGMLQuantizationType.Q8_0), "blk.1.ffn_gate.weight", 0, -np.inf)
    return path, path, "corrupt tensor 'blk.1.ffn_gate.weight': contains NaN or infinity"


def gguf_nan_head_q4_1(tmp, ck, mp):
    path = _poison_scale(_gguf(tmp, "q41.gguf", qtype=gguf.GGMLQuantizationType.Q4_1), "output.weight", 2, np.nan)
    return path, path, "corrupt tensor 'output.weight': contains NaN or infinity"


def gguf_t5_tokenizer(tmp, ck, mp):
    # "llama" (SentencePiece) loads now: tests/models/test_spm_tokenizer.py
    _tokenizer_meta(mp, **{"tokenizer.ggml.model": "t5"})
    path = _gguf(tmp, "t5.gguf")
    return path, path, "bad tokenizer metadata: tokenizer model 't5' is not supported"


def gguf_bad_merge(tmp, ck, mp):
    _tokenizer_meta(mp, **{"tokenizer.ggml.merges": ["T he", "zz9 qq8"]})
    path = _gguf(tmp, "merges.gguf")
    return path, path, "bad tokenizer metadata: merge 'zz9 qq8' does not name two tokens"


def hf_without_config(tmp, ck, mp):
    d = _copy(ck["hf"], tmp / "hf")
    (d / "config.json").unlink()
    return d, d / "config.json", "no such file"


def hf_gpt2_model_type(tmp, ck, mp):
    d = _copy(ck["hf"], tmp / "hf")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    return d, d / "config.json", "unsupported model_type 'gpt2' (supported: bert, gemma3_text, llama, mistral, phi3, qwen2, qwen3, roberta, xlm-roberta)"


def hf_garbage_shard(tmp, ck, mp):
    d = _copy(ck["hf"], tmp / "hf")
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(b"\xde\xad\xbe\xef" * 300)
    return d, shard, "truncated or corrupt safetensors file"


def hf_cut_shard(tmp, ck, mp):
    d = _copy(ck["hf"], tmp / "hf")
    shard = d / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    return d, shard, "truncated or corrupt safetensors file"


def hf_index_names_missing_shard(tmp, ck, mp):
    d = _copy(ck["hf"], tmp / "hf")
    (d / "model-00002-of-00002.safetensors").unlink()
    return d, d / "model-00002-of-00002.safetensors", "no such file (named by the index)"


def hf_missing_tensor(tmp, ck, mp):
    weights = tiny_weights(360)
    del weights["model.layers.1.mlp.down_proj.weight"]
    d = write_hf_dir(tmp / "hf", weights, train_tiny_tokenizer())
    return d, d, "missing tensor 'model.layers.1.mlp.down_proj.weight'"


def hf_without_tokenizer(tmp, ck, mp):
    d = _copy(ck["hf"], tmp / "hf")
    (d / "tokenizer.json").unlink()
    return d, d, "bad tokenizer: cannot read"


BAD = [
    missing_path,
    not_gguf,
    gguf_cut_in_header,
    gguf_cut_in_data,
    gguf_gpt2_architecture,
    gguf_int32_tensor,
    gguf_missing_tensor,
    gguf_nan_tensor,
    gguf_nan_scale_q4_0,
    gguf_inf_scale_q5_0,
    gguf_inf_scale_q8_0,
    gguf_nan_head_q4_1,
    gguf_t5_tokenizer,
    gguf_bad_merge,
    hf_without_config,
    hf_gpt2_model_type,
    hf_garbage_shard,
    hf_cut_shard,
    hf_index_names_missing_shard,
    hf_missing_tensor,
    hf_without_tokenizer,
]


@pytest.mark.parametrize("build", BAD, ids=[b.__name__ for b in BAD])
def test_bad_checkpoint_is_one_error_naming_the_file(build, tmp_path, tiny_checkpoints, monkeypatch):
    target, named, fragment = build(tmp_path, tiny_checkpoints, monkeypatch)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(target)
    err = info.value
    assert err.path == str(named)
    assert fragment in err.problem
    assert str(err) == f"{named}: {err.problem}"
    assert "\n" not in str(err)


# -- bugs: failures that escape as something other than CheckpointError ------------


def test_non_utf8_metadata_string_is_a_checkpoint_error(tmp_path, tiny_checkpoints):
    # GGUF strings are decoded lazily by the reader; a value that is not UTF-8
    # must still come out as a CheckpointError naming the file.
    path = tmp_path / "bad-utf8.gguf"
    data = tiny_checkpoints["gguf_f32"].read_bytes()
    assert data.count(b"smollm") == 1  # the tokenizer.ggml.pre value
    path.write_bytes(data.replace(b"smollm", b"smoll\xff"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.path == str(path)


def test_head_counts_that_do_not_divide_are_a_checkpoint_error(tmp_path, tiny_checkpoints):
    # ModelConfig refuses head counts that do not divide; from GGUF as from
    # config.json that must be a CheckpointError naming the file.
    path = _copy(tiny_checkpoints["gguf_f32"], tmp_path / "kv3.gguf")
    set_gguf_u32(path, "llama.attention.head_count_kv", 3)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.path == str(path)
    assert "4 query heads do not divide into 3 KV heads" in info.value.problem


def test_tensor_shapes_that_contradict_the_metadata_are_a_checkpoint_error(tmp_path, tiny_checkpoints):
    # With llama.attention.head_count = 8 but attn_q of 64 rows (4 heads x 16),
    # the load must fail on the shape, not later inside the forward pass.
    path = _copy(tiny_checkpoints["gguf_f32"], tmp_path / "h8.gguf")
    set_gguf_u32(path, "llama.attention.head_count", 8)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.path == str(path)
