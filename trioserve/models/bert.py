"""BERT-family encoders (bge, e5, all-MiniLM and the like) for embeddings:
bidirectional attention over the whole input, learned absolute positions
and the first token-type row added to the token embedding, LayerNorm after
each residual add (post-norm), a GELU (erf) MLP, biases everywhere, no
output head. GGUF `bert` files (llama.cpp's converter) and HF `bert`
directories (BertModel's tensor names, with or without a task model's
"bert." prefix).

An encoder has no KV cache to speak of: each input runs whole, in one step
(the engine schedules it so: core/engine_core.CoreSettings.whole_prompts),
and only its pooled final hidden states leave the model. The engine serves
such a model on the embedding routes alone."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import attrs
import torch
import torch.nn.functional as F

from trioserve.models.checkpoint import Checkpoint
from trioserve.models.config import BadSetting, ModelConfig
from trioserve.models.family import Family, LayerSpec, register
from trioserve.models.step import StepBatch

_HF_TOP = {
    "embeddings.word_embeddings.weight": "model.embed_tokens.weight",
    "embeddings.position_embeddings.weight": "model.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "model.token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "model.embeddings_norm.weight",
    "embeddings.LayerNorm.bias": "model.embeddings_norm.bias",
}
_HF_LAYER = {
    "attention.self.query": "self_attn.q_proj",
    "attention.self.key": "self_attn.k_proj",
    "attention.self.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.o_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "mlp.up_proj",
    "output.dense": "mlp.down_proj",
    "output.LayerNorm": "mlp_norm",
}
_HF_LAYER_NAME = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")


# A sequence-classification head (a cross-encoder): BERT's pooler then classifier,
# RoBERTa's classifier.dense then classifier.out_proj; the same two steps.
_HF_HEAD = {
    "pooler.dense.weight": "model.pooler.weight", "pooler.dense.bias": "model.pooler.bias",
    "classifier.dense.weight": "model.pooler.weight", "classifier.dense.bias": "model.pooler.bias",
    "classifier.weight": "model.classifier.weight", "classifier.bias": "model.classifier.bias",
    "classifier.out_proj.weight": "model.classifier.weight", "classifier.out_proj.bias": "model.classifier.bias",
}  # fmt: skip


def _hf_names(name: str) -> str | None:
    """BertModel's (or a RoBERTa's, or a sequence classifier's) tensor name
    -> ours; None for what is not used (an embedding model's pooler, masked
    LM heads)."""
    name = name.removeprefix("bert.").removeprefix("roberta.")
    if name in _HF_HEAD:
        return _HF_HEAD[name]
    if name in _HF_TOP:
        return _HF_TOP[name]
    m = _HF_LAYER_NAME.fullmatch(name)
    if m and m.group(2) in _HF_LAYER:
        return f"model.layers.{m.group(1)}.{_HF_LAYER[m.group(2)]}.{m.group(3)}"
    return None


def _shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, f = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.position_embeddings.weight": (c.max_position + c.position_offset, h),
        "model.embeddings_norm.weight": (h,),
        "model.embeddings_norm.bias": (h,),
    }
    if c.num_labels:
        shapes.update({"model.pooler.weight": (h, h), "model.pooler.bias": (h,)})
        shapes.update({"model.classifier.weight": (c.num_labels, h), "model.classifier.bias": (c.num_labels,)})
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for x in "qkvo":
            shapes[p + f"self_attn.{x}_proj.weight"] = (h, h)
            shapes[p + f"self_attn.{x}_proj.bias"] = (h,)
        for norm in ("attn_norm", "mlp_norm"):
            shapes[p + f"{norm}.weight"] = (h,)
            shapes[p + f"{norm}.bias"] = (h,)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.bias"] = (f,)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
        shapes[p + "mlp.down_proj.bias"] = (h,)
    return shapes


def _gguf_settings(read) -> dict:
    p = read.prefix
    return {"rms_eps": read.number(p + "attention.layer_norm_epsilon", 1e-12), "attention_bias": True}


def _hf_settings(read) -> dict:
    kind = read.raw("position_embedding_type")
    if kind not in (None, "absolute"):
        raise BadSetting("position_embedding_type", f"is {kind!r}: this family runs learned absolute positions")
    act = read.raw("hidden_act")
    if act not in (None, "gelu"):
        raise BadSetting("hidden_act", f"is {act!r}: this family runs gelu (erf)")
    out = {"rms_eps": read.number("layer_norm_eps", 1e-12), "attention_bias": True, "tie_embeddings": False}
    architectures = read.raw("architectures") or []
    if isinstance(architectures, list) and any(str(a).endswith("ForSequenceClassification") for a in architectures):
        labels = read.raw("id2label")
        count = len(labels) if isinstance(labels, dict) else read.whole("num_labels", 2)
        if count != 1:
            raise BadSetting("id2label", f"has {count} labels: a cross-encoder with one relevance output is served, not a {count}-way classifier")
        out["num_labels"] = 1
    return out


def _roberta_settings(read) -> dict:
    """XLM-RoBERTa (bge-reranker, multilingual e5): BERT's layers; position
    ids start after the padding id (pad_token_id + 1), so the context is
    that much shorter than the position table."""
    out = _hf_settings(read)
    offset = read.whole("pad_token_id", 1) + 1
    out["position_offset"] = offset
    out["max_position"] = read.whole("max_position_embeddings") - offset
    return out


BERT = register(
    Family(
        name="bert",
        gguf_architectures=("bert",),
        hf_model_types=("bert",),
        layers=lambda c: [LayerSpec()] * c.num_layers,  # not a decoder's layers: EncoderModel runs its own
        gguf_settings=_gguf_settings,
        hf_settings=_hf_settings,
        gguf_top_tensors={
            "position_embd.weight": "model.position_embeddings.weight",
            "token_types.weight": "model.token_type_embeddings.weight",
            "token_embd_norm.weight": "model.embeddings_norm.weight",
            "token_embd_norm.bias": "model.embeddings_norm.bias",
        },
        gguf_layer_tensors={
            "attn_output.bias": "self_attn.o_proj.bias",
            "attn_output_norm.weight": "attn_norm.weight",
            "attn_output_norm.bias": "attn_norm.bias",
            "ffn_up.bias": "mlp.up_proj.bias",
            "ffn_down.bias": "mlp.down_proj.bias",
            "layer_output_norm.weight": "mlp_norm.weight",
            "layer_output_norm.bias": "mlp_norm.bias",
        },
        kind="encoder",
        hf_names=_hf_names,
        all_shapes=_shapes,
        attention_bias=True,
    )
)


XLM_ROBERTA = register(
    attrs.evolve(BERT, name="xlm-roberta", gguf_architectures=(), hf_model_types=("xlm-roberta", "roberta"), hf_settings=_roberta_settings)
)


@attrs.frozen
class NoCache:
    """An encoder's KV "pool": nothing is kept between steps. The engine's
    block accounting still runs (each input's blocks come and go with it)."""

    num_blocks: int
    block_size: int


@attrs.frozen
class _Block:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    o_w: torch.Tensor
    o_b: torch.Tensor
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    up_w: torch.Tensor
    up_b: torch.Tensor
    down_w: torch.Tensor
    down_b: torch.Tensor
    mlp_norm: tuple[torch.Tensor, torch.Tensor]


class _NoAdapters:
    """An encoder takes no LoRA adapters (the engine asks for none: `capacity` 0)."""

    capacity = 0

    def __len__(self) -> int:
        return 0


class _Kernels:
    """What the engine reads of a model's kernel set: an encoder runs torch's
    own operations, float32, with no 8-bit activations."""

    name = "reference"
    activations = "bf16"
    reads_in_place = False
    thread_invariant = False


class EncoderModel:
    """A BERT encoder's forward, float32, on one device. `forward_hidden`
    is what the step runner calls for embedding rows; each sequence of a
    step is a whole input (its chunk starts at 0 and ends at its end) and
    attends to itself alone, all positions both ways."""

    is_encoder = True

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], *, device: str | torch.device = "cpu", batch_invariant: bool = False) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.kv_dtype = torch.float32
        self.batch_invariant = batch_invariant
        self.kernels = _Kernels()
        self.lora = _NoAdapters()
        self.runner = None

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=torch.float32).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.positions = w("model.position_embeddings.weight")
        # Every input is one segment: token type 0's row (where the file has the table).
        self.type_row = w("model.token_type_embeddings.weight")[0] if "model.token_type_embeddings.weight" in weights else None
        self.embed_norm = (w("model.embeddings_norm.weight"), w("model.embeddings_norm.bias"))
        # A cross-encoder's head: dense + tanh on the first token, then its relevance output.
        self.head = None
        if config.num_labels:
            self.head = (w("model.pooler.weight"), w("model.pooler.bias"), w("model.classifier.weight"), w("model.classifier.bias"))
        # The second segment's row ([SEP] ... after a pair's first [SEP]), where the table has one.
        table = weights.get("model.token_type_embeddings.weight")
        self.second_type = w("model.token_type_embeddings.weight")[1] if table is not None and table.shape[0] > 1 else None
        self.sep_id: int | None = None  # set by the engine from the tokenizer (pairs are told apart by it)
        self.blocks = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.blocks.append(
                _Block(
                    qkv_w=torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                    qkv_b=torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"]),
                    o_w=w(p + "self_attn.o_proj.weight"),
                    o_b=w(p + "self_attn.o_proj.bias"),
                    attn_norm=(w(p + "attn_norm.weight"), w(p + "attn_norm.bias")),
                    up_w=w(p + "mlp.up_proj.weight"),
                    up_b=w(p + "mlp.up_proj.bias"),
                    down_w=w(p + "mlp.down_proj.weight"),
                    down_b=w(p + "mlp.down_proj.bias"),
                    mlp_norm=(w(p + "mlp_norm.weight"), w(p + "mlp_norm.bias")),
                )
            )

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, *, device: str | torch.device = "cpu", batch_invariant: bool = False, **_: object) -> EncoderModel:
        model = cls(checkpoint.config, checkpoint.weights, device=device, batch_invariant=batch_invariant)
        checkpoint.drop_file_pages()
        return model

    @property
    def max_positions(self) -> int:
        return self.config.max_position

    def kv_bytes_per_token(self) -> int:
        return 1  # nothing is kept: a nominal byte, so block accounting has a size

    def new_kv_cache(self, num_blocks: int, block_size: int, *, huge_pages: bool = False) -> NoCache:
        return NoCache(num_blocks, block_size)

    def forward(self, batch: StepBatch, cache) -> torch.Tensor:
        raise ValueError("an encoder has no output head: it gives embeddings, not logits")

    @torch.inference_mode()
    def forward_hidden(self, batch: StepBatch, cache, logit_rows: torch.Tensor, hidden_rows: torch.Tensor) -> tuple[None, torch.Tensor]:
        """No logits (``logit_rows`` must be empty), and the final hidden
        states of the packed tokens ``hidden_rows`` ([P, hidden] fp32); a
        cross-encoder's head outputs of them instead ([P, num_labels]: its
        rows are each input's first token, pooling "score")."""
        if logit_rows.numel():
            raise ValueError("an encoder has no output head: it gives embeddings, not logits")
        out = torch.empty((batch.positions.shape[0], self.config.hidden_size), dtype=torch.float32, device=self.device)
        at = 0
        for chunk in batch.chunks:
            n = len(chunk.token_ids)
            if chunk.start != 0:
                raise ValueError("an encoder's input must come whole in one step (its chunk started at a later position)")
            out[at : at + n] = self._sequence(batch.token_ids[at : at + n], batch.positions[at : at + n])
            at += n
        picked = out.index_select(0, hidden_rows)
        if self.head is None:
            return None, picked
        pool_w, pool_b, cls_w, cls_b = self.head
        return None, F.linear(torch.tanh(F.linear(picked, pool_w, pool_b)), cls_w, cls_b)

    def _sequence(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One whole input's final hidden states [n, hidden]: computed from
        its own tokens alone, whatever shares the step."""
        c = self.config
        heads, dim = c.num_heads, c.head_dim
        eps = c.rms_eps
        x = self.embed[ids] + self.positions[positions + c.position_offset]
        if self.type_row is not None:
            x = x + self.type_row
        if self.second_type is not None and self.sep_id is not None:
            # A pair ([CLS] a [SEP] b [SEP]): the tokens after the first [SEP] are the second segment.
            seps = (ids == self.sep_id).long().cumsum(0)
            after = (seps - (ids == self.sep_id).long()) > 0
            x = x + after[:, None].float() * (self.second_type - self.type_row)
        x = F.layer_norm(x, (c.hidden_size,), *self.embed_norm, eps)
        n = ids.shape[0]
        for b in self.blocks:
            q, k, v = F.linear(x, b.qkv_w, b.qkv_b).view(n, 3, heads, dim).unbind(1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
            x = F.layer_norm(x + F.linear(attn, b.o_w, b.o_b), (c.hidden_size,), *b.attn_norm, eps)
            up = F.gelu(F.linear(x, b.up_w, b.up_b))
            x = F.layer_norm(x + F.linear(up, b.down_w, b.down_b), (c.hidden_size,), *b.mlp_norm, eps)
        return x
