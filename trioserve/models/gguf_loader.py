"""GGUF checkpoints: metadata, tokenizer and dequantized tensors, renamed to
Hugging Face names and with llama.cpp's Q/K row permutation undone."""

from __future__ import annotations

import functools
import mmap
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from trioserve.errors import CheckpointError, TokenizerError
from trioserve.kernels.int4 import INT4_TYPES, Int4Rows
from trioserve.kernels.int6 import INT6_TYPES, Int6Rows
from trioserve.kernels.int8w import Q8Rows
from trioserve.kernels.w16 import W16_TYPES, W16Rows, check_finite16
from trioserve.models.checkpoint import Checkpoint, LazyWeights, Progress, check_complete, check_layers, check_vocabulary, split_fused
from trioserve.models.config import ModelConfig, config_from_gguf
from trioserve.models.family import Family, family_for_gguf, family_of
from trioserve.models.gguf_file import metadata, open_reader
from trioserve.models.gguf_header import GGUFFile, GGUFTensor
from trioserve.models.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    | {Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M}
)

# GGUF tensor name -> HF tensor name; {n} is the layer index.
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _layer_names(family: Family | None) -> dict[str, str]:
    """GGUF per-layer name -> HF name: the common set, with the family's own
    names (models/family.Family.gguf_layer_tensors) added or overriding."""
    return {**_LAYER, **(family.gguf_layer_tensors if family is not None else {})}


def hf_name(gguf_name: str, family: Family | None = None) -> str | None:
    """The HF name for a GGUF tensor name, or None for tensors we do not use."""
    top = {**_TOP, **(family.gguf_top_tensors if family is not None else {})}
    if gguf_name in top:
        return top[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    layer = _layer_names(family)
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"
    return None


def gguf_name(name: str, family: Family | None = None) -> str:
    """The inverse of `hf_name`, for messages about missing tensors."""
    for g, h in {**_TOP, **(family.gguf_top_tensors if family is not None else {})}.items():
        if h == name:
            return g
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        for g, h in _layer_names(family).items():
            if h == m.group(2):
                return f"blk.{m.group(1)}.{g}"
    return name


def _spelled(name: str, *, family: Family | None, config: ModelConfig) -> str:
    """A tensor's GGUF name for a message: a part of a matrix the file holds
    fused (Phi-3's q of attn_qkv) is named by the fused one."""
    if family is not None:
        m = re.fullmatch(r"(model\.layers\.\d+\.)(.+)", name)
        for fused, parts in family.split_layer_tensors(config).items():
            if m and any(part == m.group(2) for part, _ in parts):
                return gguf_name(m.group(1) + fused, family)
    return gguf_name(name, family)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of Q/K rows: GGUF stores each head's
    rows as pairs (2i, 2i+1) for interleaved RoPE; we use rotate-half."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, *, dtype: torch.dtype, progress: Progress | None = None) -> Checkpoint:
    reader = open_reader(path)
    meta = metadata(reader, path)
    reader.metadata = {}  # the closures below keep the reader for the model's life; the tokenizer is made from ``meta``
    tensors = {}
    family = family_for_gguf(meta.get("general.architecture"))  # None: config_from_gguf below says so
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise CheckpointError(path, f"tensor {t.name!r} uses quantization type {t.tensor_type.name}, which trioserve cannot load")
        name = hf_name(t.name, family)
        if name is not None:
            tensors[name] = t
    if "model.embed_tokens.weight" not in tensors:
        raise CheckpointError(path, "missing tensor 'token_embd.weight'")
    vocab = int(tensors["model.embed_tokens.weight"].shape[-1])
    config = config_from_gguf(meta, path, vocab_size=vocab, tie_embeddings="lm_head.weight" not in tensors)
    if family_of(config.architecture).kind == "encoder":
        dtype = torch.float32  # an encoder computes in float32 (models/bert.py): its weights are not rounded on the way
    for unsupported in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if any(t.name == unsupported for t in reader.tensors):
            raise CheckpointError(path, f"tensor {unsupported!r}: LongRoPE frequency factors are not supported")
    tensors = split_fused(path, config, tensors, lambda t: int(t.shape[-1]), _row_slice, spelled=functools.partial(gguf_name, family=family))
    check_layers(path, config, tensors, key=f"{config.architecture}.block_count")
    shapes = {name: tuple(reversed([int(d) for d in t.shape])) for name, t in tensors.items()}
    check_complete(path, config, shapes, spelled=functools.partial(_spelled, family=family, config=config))
    _check_rope_freqs_shape(path, config, shapes.get("rope_freqs"))
    tokenizer = _tokenizer(meta, path)
    check_vocabulary(path, config, tokenizer, tokens="tokenizer.ggml.tokens", rows="token_embd.weight")
    rank_head = next((t for t in reader.tensors if t.name == "cls.output.weight"), None)
    if rank_head is not None and config.tie_embeddings:
        _check_rank_head(path, rank_head, tensors["model.embed_tokens.weight"], tokenizer)

    # The matrix that gives the logits: its own, or the embedding where the two are tied.
    head_name = "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
    held: dict[str, torch.Tensor] = {}
    made: dict[str, Callable[[], torch.Tensor]] = {}
    int4: dict[str, Callable[[], Int4Rows]] = {}
    rows: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    int6: dict[str, Callable[[], Int6Rows]] = {}
    int8: dict[str, Callable[[], Q8Rows]] = {}
    w16: dict[str, Callable[[], W16Rows]] = {}
    for done, (name, t) in enumerate(tensors.items(), start=1):
        heads = _permuted_heads(config, name)
        if t.tensor_type.name in INT4_TYPES and name.startswith("model.layers.") and len(t.shape) == 2:
            # Made from the mapped file when asked for, as codes or dense (LazyWeights).
            int4[name] = functools.partial(_parts, t, heads, reader)
            _check_finite(path, t, reader)
            made[name] = functools.partial(_dense, path, t, heads, dtype, reader)
        elif t.tensor_type.name in INT6_TYPES and name.startswith("model.layers.") and len(t.shape) == 2 and t.shape[0] % 32 == 0:
            # Codes of up to 6 bits in groups of 16 for the int8-activation kernel; dense when asked for.
            int6[name] = functools.partial(_parts6, t, heads, reader)
            _check_finite(path, t, reader)
            made[name] = functools.partial(_dense, path, t, heads, dtype, reader)
        elif t.tensor_type == Q.Q8_0 and name.startswith("model.layers.") and len(t.shape) == 2:
            # Signed 8-bit codes and the file's block scales for the int8-activation kernel; dense when asked for.
            int8[name] = functools.partial(_parts8, t, heads, reader)
            _check_finite(path, t, reader)
            made[name] = functools.partial(_dense, path, t, heads, dtype, reader)
        elif t.tensor_type.name in W16_TYPES and len(t.shape) == 2 and (
            name.startswith("model.layers.") or name in ("lm_head.weight", "model.embed_tokens.weight")
        ):
            # The file's 16-bit floats as they are, for the 16-bit weight kernel; float32 or bf16 when asked for.
            w16[name] = functools.partial(_parts16, path, t, heads, reader)
            _check_finite16(path, t, reader)  # checked once, here
            made[name] = functools.partial(_dense, path, t, heads, dtype, reader)
            if name == "model.embed_tokens.weight":  # looked up a few rows a step, from the file
                rows[name] = functools.partial(_rows, t, dtype)
        elif name in ("lm_head.weight", "model.embed_tokens.weight") and t.tensor_type not in DENSE_TYPES and len(t.shape) == 2:
            # The head is read whole every step: on a CPU with int8 activations, as the file's
            # codes where the type has a kernel (4-, up to 6- and 8-bit, as the layers'); else as
            # the model's own 8-bit copy (Int8Rows), made slice by slice from the file's rows. The
            # embedding is read a few rows a step, from the file's rows (DecoderModel keeps no dense
            # copy where no dense head reads it). Dense only when asked for. Checked once, here
            # (_check_finite).
            _check_finite(path, t, reader)
            made[name] = functools.partial(_dense, path, t, heads, dtype, reader)
            rows[name] = functools.partial(_rows, t, dtype)
            if name == head_name and t.tensor_type.name in INT4_TYPES:
                int4[name] = functools.partial(_parts, t, heads, reader)
            elif name == head_name and t.tensor_type.name in INT6_TYPES and t.shape[0] % 32 == 0:
                int6[name] = functools.partial(_parts6, t, heads, reader)
            elif name == head_name and t.tensor_type == Q.Q8_0:
                int8[name] = functools.partial(_parts8, t, heads, reader)
        else:
            held[name] = _dense(path, t, heads, dtype, reader)
        if progress is not None:
            progress(done, len(tensors))
    if "rope_freqs" in held and not bool((held["rope_freqs"] > 0).all()):
        raise CheckpointError(path, "corrupt tensor 'rope_freqs.weight': its frequency divisors must be greater than 0")
    weights = LazyWeights(held, made, list(tensors), dtype)
    codes = LazyWeights({}, int4, list(int4))
    codes6 = LazyWeights({}, int6, list(int6))
    codes8 = LazyWeights({}, int8, list(int8))
    bits16 = LazyWeights({}, w16, list(w16))
    return Checkpoint(
        path=path, config=config, tokenizer=tokenizer, weights=weights, int4=codes, int6=codes6, int8=codes8, w16=bits16, rows=rows,
        drop_file_pages=functools.partial(_drop_pages, reader),
    )


def _check_rank_head(path: Path, head: GGUFTensor, embedding: GGUFTensor, tokenizer: Tokenizer) -> None:
    """A reranker GGUF (llama.cpp's converter writes Qwen3-Reranker's "yes"
    and "no" rows of the output head as 'cls.output.weight') with no
    'output.weight': the head is the embedding only where the model ties
    them; for a model that does not (Qwen3-Reranker-4B and 8B), the
    converter left the rest of the head out, and trioserve, which reads the
    answers' probabilities from the whole head, refuses the file. Told apart
    by whether the two rows are the embedding's rows of "yes" and "no"."""
    ids = [tokenizer.encode(word, add_bos=False, special=False) for word in ("yes", "no")]
    rows = np.asarray(tensor_array(head), dtype=np.float64)
    if all(len(i) == 1 for i in ids) and rows.shape[0] == 2:
        picked = np.asarray(embedding.data)[[ids[0][0], ids[1][0]]]
        embedded = np.asarray(gguf.quants.dequantize(picked, embedding.tensor_type), dtype=np.float64).reshape(2, -1)
        norms = np.linalg.norm(rows, axis=1) * np.linalg.norm(embedded, axis=1)
        if rows.shape == embedded.shape and bool((norms > 0).all()) and bool(((rows * embedded).sum(1) / norms > 0.99).all()):
            return
    raise CheckpointError(
        path,
        "a reranker whose output head llama.cpp's converter left out: 'cls.output.weight' holds only its \"yes\" and \"no\" rows, "
        "which are not the embedding's; serve the model's Hugging Face directory instead",
    )


def _row_slice(t: GGUFTensor, start: int, end: int) -> GGUFTensor:
    """Rows start..end of 2-D tensor ``t`` as a tensor of their own (a part
    of a fused matrix): a view of the same mapped bytes."""
    rows = int(t.shape[-1])
    row_bytes = t.n_bytes // rows
    return t._replace(
        name=f"{t.name}[rows {start}:{end}]", shape=(*t.shape[:-1], end - start), n_bytes=(end - start) * row_bytes,
        data_offset=t.data_offset + start * row_bytes, data=t.data[start:end],
    )  # fmt: skip


def _drop_pages(reader: GGUFFile, t: GGUFTensor | None = None) -> None:
    """Let the kernel drop the mapped file's pages (tensor ``t``'s, or all)
    from this process's resident memory: they are clean, read again from
    the file (the page cache) if touched. So the file does not sit in
    resident memory beside what was made of it."""
    region = reader.mapping
    if region is None or not hasattr(region, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    if t is None:
        region.madvise(mmap.MADV_DONTNEED)
        return
    start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(len(region), t.data_offset + t.n_bytes)
    if end > start:
        region.madvise(mmap.MADV_DONTNEED, start, end - start)


DENSE_TYPES = (Q.F32, Q.F16, Q.BF16)


def _rows(t: GGUFTensor, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the quantized 2-D tensor ``t``, dequantized as the
    whole tensor is (a row's blocks are its own), in ``dtype``: [len(ids), columns]."""
    data = np.asarray(t.data)[ids.reshape(-1).cpu().numpy()]
    array = gguf.quants.dequantize(data, t.tensor_type).reshape(len(data), -1)
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(dtype).reshape(*ids.shape, -1)


def _parts6(t: GGUFTensor, heads: int, reader: GGUFFile) -> Int6Rows:
    """Tensor ``t``'s rows of up to 6-bit codes, still in the file's blocks
    (as `_parts`), rows unpermuted for ``heads`` heads."""
    rows = Int6Rows.of(t.data, t.tensor_type.name, functools.partial(_drop_pages, reader, t))
    return rows.take_rows(unpermute_rows(np.arange(rows.shape[0]), heads)) if heads else rows


def _parts16(path: Path, t: GGUFTensor, heads: int, reader: GGUFFile) -> W16Rows:
    """Tensor ``t``'s 16-bit floats (F16 or BF16), still in the file (as
    `_parts`), rows unpermuted for ``heads`` heads."""
    raw = np.asarray(t.data)
    rows = W16Rows.of(raw.view(np.uint8).reshape(raw.shape[0], -1), t.tensor_type.name, functools.partial(_drop_pages, reader, t))
    return rows.take_rows(unpermute_rows(np.arange(rows.shape[0]), heads)) if heads else rows


def _check_finite16(path: Path, t: GGUFTensor, reader: GGUFFile) -> None:
    """CheckpointError unless F16/BF16 tensor ``t`` is finite (read a slice
    at a time; its pages let go after)."""
    try:
        check_finite16(t.data, t.tensor_type.name)
    except ValueError as e:
        raise CheckpointError(path, f"corrupt tensor {t.name!r}: {e}") from None
    finally:
        _drop_pages(reader, t)


def _parts8(t: GGUFTensor, heads: int, reader: GGUFFile) -> Q8Rows:
    """Tensor ``t``'s Q8_0 rows, still in the file's blocks (as `_parts`),
    rows unpermuted for ``heads`` heads."""
    rows = Q8Rows.of(t.data, "Q8_0", functools.partial(_drop_pages, reader, t))
    return rows.take_rows(unpermute_rows(np.arange(rows.shape[0]), heads)) if heads else rows


def _parts(t: GGUFTensor, heads: int, reader: GGUFFile) -> Int4Rows:
    """Tensor ``t``'s 4-bit rows, still in the file's blocks (unpacked or
    laid out for a kernel when the model is built, which lets the file's
    pages go then), rows unpermuted for ``heads`` heads."""
    rows = Int4Rows.of(t.data, t.tensor_type.name, functools.partial(_drop_pages, reader, t))
    return rows.take_rows(unpermute_rows(np.arange(rows.shape[0]), heads)) if heads else rows


def _dense(path: Path, t: GGUFTensor, heads: int, dtype: torch.dtype, reader: GGUFFile | None = None) -> torch.Tensor:
    """Tensor ``t`` dequantized as the gguf package does it, rows unpermuted
    for ``heads`` heads, in ``dtype``; CheckpointError if not finite. The
    file's pages it read are let go after (``reader``'s mapping)."""
    array = tensor_array(t)
    if reader is not None:
        _drop_pages(reader, t)
    if heads:
        array = unpermute_rows(array, heads)
    if not np.isfinite(array).all():
        raise CheckpointError(path, f"corrupt tensor {t.name!r}: contains NaN or infinity")
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"])).to(dtype)  # copied only if read-only (the mapped file) or strided


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes, without its tensors."""
    return _tokenizer(metadata(open_reader(path), path), path)


def _tokenizer(meta: dict, path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_metadata(meta)
    except TokenizerError as exc:
        raise CheckpointError(path, f"bad tokenizer metadata: {exc}") from None
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # Values of the wrong type (numbers where texts belong, ...).
        raise CheckpointError(path, f"bad tokenizer metadata: {type(exc).__name__}: {exc}") from None


def _check_rope_freqs_shape(path: Path, config: ModelConfig, shape: tuple[int, ...] | None) -> None:
    """Llama 3's per-frequency divisors, where the file has them: one per rotary pair."""
    if shape is not None and shape != (config.head_dim // 2,):
        raise CheckpointError(
            path, f"tensor 'rope_freqs.weight' has shape {shape}, but the model's settings imply {(config.head_dim // 2,)}"
        )


DEQUANTIZE_SLICE_ROWS = 2048  # rows dequantized at a time: the gguf package's temporaries are several times a slice


# Byte offsets, within one block, of the float16 scale fields (d, and dmin
# or m where the type has one) of the block types whose every value is
# those fields times small integers (and a sum of such): each field reaches
# every value of its block, so a block dequantizes to finite numbers exactly
# when its fields are finite (an infinite field times a zero code is NaN).
SCALE_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}


def scales_finite(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether raw blocks ``data`` (any shape, whole blocks) of a type in
    SCALE_FIELDS dequantize to finite numbers, read from their scale
    fields alone (2 or 4 bytes a block, where dequantizing writes 32 or
    256 floats): a float16 is NaN or infinite when its 5 exponent bits are all set."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = np.asarray(data).reshape(-1, size)
    for offset in SCALE_FIELDS[qtype]:
        bits = np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.uint16)
        if ((bits & 0x7C00) == 0x7C00).any():
            return False
    return True


def _check_finite(path: Path, t: GGUFTensor, reader: GGUFFile) -> None:
    """CheckpointError unless quantized 2-D tensor ``t`` dequantizes to finite
    numbers: from its blocks' scale fields where the type allows
    (SCALE_FIELDS), else dequantized a slice of rows at a time, so no dense
    copy of the whole exists. The kernels' codes are made later, once, by
    the model's build; this only reads."""
    data = np.asarray(t.data)
    if t.tensor_type in SCALE_FIELDS:
        finite = scales_finite(data, t.tensor_type)
    else:
        finite = all(
            np.isfinite(gguf.quants.dequantize(data[start : start + DEQUANTIZE_SLICE_ROWS], t.tensor_type)).all()
            for start in range(0, data.shape[0], DEQUANTIZE_SLICE_ROWS)
        )
    _drop_pages(reader, t)
    if not finite:
        raise CheckpointError(path, f"corrupt tensor {t.name!r}: contains NaN or infinity")


def tensor_array(t: GGUFTensor) -> np.ndarray:
    """A GGUF tensor dequantized to float32, in numpy/torch axis order; a
    quantized matrix slice by slice of rows (the same values: a row's blocks
    are its own), so that a big one's temporaries stay small."""
    shape = tuple(int(d) for d in reversed(t.shape))
    data = np.asarray(t.data)
    if t.tensor_type in DENSE_TYPES or data.ndim != 2 or data.shape[0] <= DEQUANTIZE_SLICE_ROWS:
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    out = np.empty((data.shape[0], shape[-1]), dtype=np.float32)
    for start in range(0, data.shape[0], DEQUANTIZE_SLICE_ROWS):
        part = data[start : start + DEQUANTIZE_SLICE_ROWS]
        out[start : start + len(part)] = gguf.quants.dequantize(part, t.tensor_type).reshape(len(part), -1)
    return out.reshape(shape)


def _permuted_heads(config: ModelConfig, name: str) -> int:
    """How many heads the converter interleaved in this tensor's rows (0: none)."""
    if not family_of(config.architecture).permuted_qk:
        return 0
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return config.num_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.num_kv_heads
    return 0
