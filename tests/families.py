"""Tiny random models of each family, made by transformers' own config and
model classes (the reference forward), saved as an HF directory and written
as GGUF the way llama.cpp's converter names and transforms the tensors
(written here independently of trioserve's loader)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from tests.k_quants import quantize_q4_k
from tests.tiny_model import add_metadata
from tests.tiny_tokenizer import gguf_tokenizer_metadata, train_tiny_tokenizer, write_hf_tokenizer

Q = gguf.GGMLQuantizationType

# Each family's tiny shape: head widths not hidden / heads where the family allows it,
# and (Gemma 3) enough layers for both kinds, a window shorter than the test prompts.
SHAPES = {
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0),
    "gemma3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=8, query_pre_attn_scalar=32),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=8),
}  # fmt: skip


def hf_model(family: str, vocab: int, *, tie: bool, seed: int = 0):
    """A random transformers model of ``family``, float32, in eval mode;
    weights wider than transformers' default so greedy text varies."""
    import transformers

    shape = dict(SHAPES[family])
    if family == "qwen3":
        config = transformers.Qwen3Config(vocab_size=vocab, tie_word_embeddings=tie, **shape)
    elif family == "gemma3":
        config = transformers.Gemma3TextConfig(
            vocab_size=vocab, tie_word_embeddings=tie, rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            }, pad_token_id=0, bos_token_id=1, eos_token_id=2, **shape,
        )  # fmt: skip
    elif family == "phi3":
        shape.pop("head_dim")  # hidden / heads
        config = transformers.Phi3Config(
            vocab_size=vocab, tie_word_embeddings=tie, original_max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **shape,
        )  # fmt: skip
    else:
        raise ValueError(family)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma computes with 1 + w (w near 0); the others with w (near 1).
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


# GGUF per-layer names (llama.cpp's tensor names), by HF name after "model.layers.<i>.".
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_BY_FAMILY = {
    "qwen3": {"post_attention_layernorm.weight": "ffn_norm.weight"},
    "phi3": {
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.qkv_proj.weight": "attn_qkv.weight",
        "mlp.gate_up_proj.weight": "ffn_up.weight",
    },
    "gemma3": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_tensor_name(family: str, name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{({**_LAYER, **_LAYER_BY_FAMILY[family]})[rest]}"


def write_family_gguf(
    path: Path, family: str, model, tokenizer, *, qtype: Q = Q.F32, extra: dict | None = None, tensors: dict | None = None,
    omit: frozenset[str] = frozenset(),
) -> Path:  # fmt: skip
    """``model``'s weights as a GGUF of ``family``'s architecture (and the
    metadata ``extra``: ints as uint32, texts as strings), as
    llama.cpp's converter writes them (no Q/K interleave for these
    families; Gemma's norms stored as 1 + w), matrices in ``qtype``.
    ``omit``: GGUF tensor names and "sliding_window" left out (a broken file)."""
    shape = SHAPES[family]
    c = model.config
    writer = gguf.GGUFWriter(str(path), family)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(10000.0 if family == "phi3" else 1000000.0)
    if family in ("gemma3", "phi3") and "sliding_window" not in omit:
        writer.add_sliding_window(shape["sliding_window"])
    add_metadata(writer, {**gguf_tokenizer_metadata(tokenizer), **(extra or {})})
    for name, tensor in model.state_dict().items():
        if (name == "lm_head.weight" and c.tie_word_embeddings) or gguf_tensor_name(family, name) in omit:
            continue
        array = tensor.detach().float().numpy().copy()
        if family == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0
        if array.ndim == 2 and qtype == Q.Q4_K:
            writer.add_tensor(gguf_tensor_name(family, name), quantize_q4_k(array), raw_dtype=qtype)
        elif array.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(gguf_tensor_name(family, name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name(family, name), array.astype(np.float32))
    for name, array in (tensors or {}).items():  # GGUF-named extras, as they are (float32)
        writer.add_tensor(name, np.asarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build_family(root: Path, family: str, *, tie: bool = False, seed: int = 0) -> dict:
    """The reference model and its files: {"model", "tokenizer", "hf", "gguf_f32", "gguf_q8_0"}."""
    tokenizer = train_tiny_tokenizer()
    model = hf_model(family, tokenizer.get_vocab_size(), tie=tie, seed=seed)
    hf = root / f"{family}-hf"
    model.save_pretrained(hf)
    write_hf_tokenizer(tokenizer, hf)
    return {
        "model": model,
        "tokenizer": tokenizer,
        "hf": hf,
        "gguf_f32": write_family_gguf(root / f"{family}-f32.gguf", family, model, tokenizer),
        "gguf_q8_0": write_family_gguf(root / f"{family}-q8_0.gguf", family, model, tokenizer, qtype=Q.Q8_0),
    }


# -- encoders -------------------------------------------------------------------------------------------------------


def train_wordpiece():
    """A tiny BERT-style WordPiece tokenizer (lower-casing normalizer, BERT
    pre-tokenizer, [CLS] text [SEP] post-processor), trained on the tiny corpus."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    from tests.tiny_tokenizer import CORPUS

    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS * 3, trainer=trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def _randomize_encoder(model) -> None:
    """An encoder's weights wide enough that its outputs tell inputs apart
    (LayerNorm gains near 1, small biases); eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.08)
    model.eval()


def build_bert(root: Path, *, pooling: str | None = "cls", seed: int = 0) -> dict:
    """A random BertModel (transformers) saved as an HF directory with its
    WordPiece tokenizer, and, where ``pooling`` is given, a
    sentence-transformers pooling module that says so."""
    import json

    import transformers

    tokenizer = train_wordpiece()
    config = transformers.BertConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.BertModel(config, add_pooling_layer=False)
    _randomize_encoder(model)
    directory = root / "bert-hf"
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]"}))
    if pooling is not None:
        (directory / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                                                             {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))  # fmt: skip
        (directory / "1_Pooling").mkdir()
        flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}
        (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, flags[pooling]: True}))
    return {"model": model, "tokenizer": tokenizer, "hf": directory}


def build_cross_encoder(root: Path, kind: str = "bert", *, seed: int = 0) -> dict:
    """A random one-output sequence classifier (a cross-encoder reranker) of
    ``kind`` ("bert": BertForSequenceClassification, as ms-marco MiniLM;
    "xlm-roberta": XLMRobertaForSequenceClassification, as bge-reranker),
    saved as an HF directory with the tiny WordPiece tokenizer."""
    import json

    import transformers

    tokenizer = train_wordpiece()
    shape = dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=1)
    if kind == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(max_position_embeddings=128, **shape))
    else:
        config = transformers.XLMRobertaConfig(max_position_embeddings=130, type_vocab_size=1, pad_token_id=0, **shape)
        model = transformers.XLMRobertaForSequenceClassification(config)
    torch.manual_seed(seed)
    _randomize_encoder(model)
    directory = root / f"{kind}-cross-encoder"
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]"}))
    return {"model": model, "tokenizer": tokenizer, "hf": directory}
