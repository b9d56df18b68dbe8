"""A tiny random-weight Llama the tests write themselves, as GGUF (F32 and
quantized) and as a Hugging Face safetensors directory. Both describe the
same model: the GGUF copy carries llama.cpp's Q/K row permutation, as the
real converter writes it, and the loaders must undo it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file

from tests.tiny_tokenizer import gguf_tokenizer_metadata, train_tiny_tokenizer, write_hf_tokenizer

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
)


def tiny_weights(vocab_size: int, *, seed: int = 0, tie: bool = False, shape: dict | None = None) -> dict[str, np.ndarray]:
    """HF-named float32 weights (of TINY's shape, or ``shape``, with TINY's
    keys). Scaled so activations stay O(1) and the logits are far from
    uniform (a forward bug then shows)."""
    shape = shape or TINY
    rng = np.random.default_rng(seed)
    h, f = shape["hidden_size"], shape["intermediate_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab_size, h)).astype(np.float32), "model.norm.weight": norm(h)}
    if not tie:
        w["lm_head.weight"] = mat(vocab_size, h)
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(h, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, h)
        w[p + "mlp.gate_proj.weight"] = mat(f, h)
        w[p + "mlp.up_proj.weight"] = mat(f, h)
        w[p + "mlp.down_proj.weight"] = mat(h, f)
    return w


def hf_config(vocab_size: int, *, tie: bool) -> dict:
    return dict(TINY, model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab_size, tie_word_embeddings=tie)


def write_hf_dir(directory: Path, weights: dict[str, np.ndarray], tokenizer, *, tie: bool = False, shards: int = 2) -> Path:
    """config.json, tokenizer files and the weights split over ``shards``
    safetensors files with an index (one file without an index when 1)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = weights["model.embed_tokens.weight"].shape[0]
    (directory / "config.json").write_text(json.dumps(hf_config(vocab, tie=tie)))
    write_hf_tokenizer(tokenizer, directory)
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n] for n in names}, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in part}, str(directory / file))
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (written independently
    of the loader's inverse)."""
    out = np.empty_like(w)
    hd = w.shape[0] // n_heads
    for head in range(n_heads):
        block = w[head * hd : (head + 1) * hd]
        first, second = block[: hd // 2], block[hd // 2 :]
        # Interleave: row 2i <- first half row i, row 2i+1 <- second half row i.
        out[head * hd : (head + 1) * hd][0::2] = first
        out[head * hd : (head + 1) * hd][1::2] = second
    return out


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def _gguf_tensor_name(name: str) -> str:
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


def add_metadata(writer: gguf.GGUFWriter, meta: dict) -> None:
    """GGUF metadata as llama.cpp's converter types it: booleans, whole
    numbers as uint32, texts, and arrays (scores as floats)."""
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif key == "tokenizer.ggml.scores":
            writer.add_array(key, [float(v) for v in value])
        else:
            writer.add_array(key, list(value))


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    tokenizer,
    *,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    arch: str = "llama",
    chat_template: str | None = None,
    shape: dict | None = None,
    qtype_of=None,
) -> Path:
    """Write the model as llama.cpp would: GGUF names, permuted Q/K rows, 2-D
    matrices in ``qtype`` (norms stay F32), or in ``qtype_of(hf_name)`` where
    given (a mixed-type file, as llama-quantize's _M types write); Q4_K,
    Q5_K and Q6_K through tests/k_quants.py. ``shape``: TINY's keys, for weights of
    another shape (`tiny_weights(shape=...)`)."""
    from tests.k_quants import quantize_q4_k, quantize_q5_k, quantize_q6_k

    k_quants = {
        gguf.GGMLQuantizationType.Q4_K: quantize_q4_k,
        gguf.GGMLQuantizationType.Q5_K: quantize_q5_k,
        gguf.GGMLQuantizationType.Q6_K: quantize_q6_k,
    }
    shape = shape or TINY
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_context_length(shape["max_position_embeddings"])
    writer.add_embedding_length(shape["hidden_size"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["rms_norm_eps"])
    writer.add_rope_dimension_count(shape["hidden_size"] // heads)
    # ``tokenizer``: a `tokenizers` object, or the GGUF tokenizer keys themselves (a SentencePiece vocabulary's).
    meta = tokenizer if isinstance(tokenizer, dict) else gguf_tokenizer_metadata(tokenizer, chat_template=chat_template)
    add_metadata(writer, {**meta, **({"tokenizer.chat_template": chat_template} if chat_template is not None else {})})
    for name, array in weights.items():
        if name.endswith("q_proj.weight"):
            array = permute_rows(array, heads)  # heads of this shape
        elif name.endswith("k_proj.weight"):
            array = permute_rows(array, kv_heads)
        kind = qtype_of(name) if qtype_of is not None and array.ndim == 2 else qtype
        if array.ndim == 2 and kind in k_quants:
            writer.add_tensor(_gguf_tensor_name(name), k_quants[kind](array), raw_dtype=kind)
        elif array.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_tensor_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_tensor_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build_tiny_checkpoints(root: Path, *, tie: bool = False, seed: int = 0) -> dict[str, Path]:
    """Write every variant under ``root``; returns their paths by kind."""
    tokenizer = train_tiny_tokenizer()
    weights = tiny_weights(tokenizer.get_vocab_size(), seed=seed, tie=tie)
    Q = gguf.GGMLQuantizationType
    return {
        "hf": write_hf_dir(root / "hf", weights, tokenizer, tie=tie),
        "gguf_f32": write_gguf(root / "tiny-f32.gguf", weights, tokenizer),
        "gguf_q8_0": write_gguf(root / "tiny-q8_0.gguf", weights, tokenizer, qtype=Q.Q8_0),
        "gguf_q4_1": write_gguf(root / "tiny-q4_1.gguf", weights, tokenizer, qtype=Q.Q4_1),
    }


def set_gguf_u32(path: Path, key: str, value: int) -> Path:
    """Overwrite, in place, the uint32 value of GGUF metadata ``key``: a way
    to make a file whose metadata contradicts its tensors."""
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key)
    assert struct.unpack_from("<I", data, at)[0] == gguf.GGUFValueType.UINT32
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(data)
    return path
