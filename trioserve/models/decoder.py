"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged
KV cache. One `forward` call runs every sequence of a step together: prefill
chunks and decode tokens packed in one tensor, no Python loop over sequences
(attention runs decode rows and prompt chunks as two groups, see models/step.py).

Weights are fused at load time (Q, K and V in one matrix; gate and up in
another) so a layer is four matmuls."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from trioserve.kernels import memory, native, reference
from trioserve.kernels.factory import ProjectionFactory
from trioserve.kernels.int4 import Int4Parts
from trioserve.kernels.int6 import Int6Parts
from trioserve.kernels.int8w import Int8Parts
from trioserve.kernels.layer_runner import LayerRunner
from trioserve.kernels.ops import Kernels, select_kernels
from trioserve.kernels.projection import DenseLater, Int8Rows, Projection
from trioserve.kernels.tiled import float_logits_mm, tiled_head
from trioserve.kernels.w16 import W16Parts, pack_w16
from trioserve.models.checkpoint import Checkpoint
from trioserve.models.config import ModelConfig, RopeScaling
from trioserve.models.family import LayerSpec, family_of
from trioserve.models.lora_set import LoraSet
from trioserve.models.step import StepBatch

# The codes kernels compute outputs 16 at a time (kernels/csrc/cpu_kernels.c's tiles).
HEAD_OUTPUTS = 16

log = logging.getLogger(__name__)


@attrs.frozen
class KVCache:
    """K and V for every layer: [layers, KVH, num_blocks, block_size, D] each."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[3])


@attrs.frozen
class _Layer:
    """One layer's weights, as its LayerSpec asks for them."""

    attn_norm: torch.Tensor
    qkv: Projection
    o: Projection
    mlp_norm: torch.Tensor  # before the MLP: post_attention_layernorm, or pre_feedforward_layernorm (sandwich norms)
    gate_up: Projection
    down: Projection
    q_norm: torch.Tensor | None = None  # per head, before RoPE (qk_norm)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # on the attention's output (sandwich norms)
    post_mlp_norm: torch.Tensor | None = None  # on the MLP's output (sandwich norms)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, divisors: torch.Tensor | None) -> torch.Tensor:
    """Rotary frequencies [head_dim / 2] in fp64, after scaling."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "llama3":
        wavelen = 2 * math.pi / inv
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * inv / scaling.factor + smooth * inv
        inv = torch.where(wavelen > low_wavelen, inv / scaling.factor, torch.where(wavelen < high_wavelen, inv, blended))
    if divisors is not None:
        inv = inv / divisors.to(torch.float64)
    return inv


ROPE_SLICE = 1 << 14  # positions computed at a time: the float64 angles of a slice, never of the whole table


def rope_tables(inv: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, [positions, len(inv)] float32,
    each element computed in float64 and rounded once (the same bits
    whatever the slicing); a slice of positions at a time, so the float64
    temporaries stay a slice's."""
    cos = torch.empty((positions, inv.numel()), dtype=torch.float32)
    sin = torch.empty_like(cos)
    for start in range(0, positions, ROPE_SLICE):
        end = min(positions, start + ROPE_SLICE)
        angles = torch.outer(torch.arange(start, end, dtype=torch.float64), inv)
        cos[start:end] = angles.cos()
        sin[start:end] = angles.sin()
    return cos, sin


class DecoderModel:
    """Owns the weights on one device. Not thread-safe: one step at a time."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        int4: Mapping[str, Int4Parts] | None = None,
        device: str | torch.device = "cpu",
        batch_invariant: bool = False,
        kernels: str = "auto",
        activations: str = "auto",
        rows: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
        int6: Mapping[str, Int6Parts] | None = None,
        int8: Mapping[str, Int8Parts] | None = None,
        w16: Mapping[str, W16Parts] | None = None,
        kv_dtype: torch.dtype | None = None,
        progress: Callable[[int, int], None] | None = None,
        max_model_len: int | None = None,
    ):
        """``int4``: 4-bit codes of some projections (Checkpoint.int4); used for
        generated tokens when the weights are bf16 on CPU.

        ``batch_invariant``: every row's arithmetic is fixed, whatever else
        shares its step and however its prompt was chunked
        (docs/determinism.md): projections by `Projection.fixed`, the output
        head in row tiles, attention by `fixed_order_attention`. Steps must
        then be built with ``build_step(..., fixed=True)``.

        ``kernels``: which implementation runs each operation (auto,
        reference or triton: kernels/ops.py). ``activations``: how the 4-bit
        rows take their inputs (auto, bf16 or int8: `select_kernels`; a model
        without 4-bit codes has no such rows, and runs bf16, with a warning
        when int8 was asked for). ``rows``: Checkpoint.rows (the embedding
        made row by row where it can be). ``int6``: Checkpoint.int6, codes of
        up to 6 bits, and ``int8``: Checkpoint.int8, signed 8-bit codes (Q8_0),
        run with int8 activations (else those weights run dense). ``w16``:
        Checkpoint.w16, F16/BF16 matrices kept in the file's 16 bits (on a CPU).
        ``kv_dtype``: the KV pool's dtype (default: the weights'); a float32
        model on a CPU may keep a bfloat16 pool: half the memory and half
        the bytes attention reads, K and V rounded to bf16 as they are
        stored (what a bf16 model's pool holds). ``progress(done, total)``:
        called as each layer is built (packing a big model's codes takes a
        while: ~50 s for an 8B file on two cores). ``max_model_len``: the
        longest sequence served (--max-model-len): the RoPE tables hold
        min(it, the file's context length) positions, so their memory
        follows what is served, not what a file declares."""
        self.config = config
        self.batch_invariant = batch_invariant
        self.device = torch.device(device)
        self.dtype = getattr(weights, "dtype", None) or weights["model.embed_tokens.weight"].dtype
        self.kv_dtype = kv_dtype or self.dtype
        if self.kv_dtype != self.dtype and not (
            self.dtype == torch.float32 and self.kv_dtype == torch.bfloat16 and self.device.type == "cpu" and kernels != "triton"
        ):
            raise ValueError(
                f"--kv-cache-dtype {str(self.kv_dtype).removeprefix('torch.')}: the weights are {str(self.dtype).removeprefix('torch.')} "
                f"on {self.device.type}; only float32 weights on a CPU may keep a pool of another dtype (bfloat16). "
                "Use --kv-cache-dtype auto"
            )
        int4 = int4 or {}
        if not int4 and not int6 and not int8 and activations != "bf16":
            # No 4-bit (or 5-6-bit) codes, so no row would take int8 inputs; a trace, /metrics and
            # the sharing of generated K/V must not say otherwise.
            if activations == "int8":
                log.warning("--activations int8: this model has no 4-bit weights to take 8-bit inputs; it runs bf16")
            activations = "bf16"
        # Every operation runs through this seam: on CPU the C kernels where
        # they build (attention row by row, reading the pool in place, for
        # the head shapes they take), on CUDA the Triton ones.
        self.kernels: Kernels = select_kernels(
            kernels, self.device, self.dtype, config.num_heads, config.num_kv_heads, config.head_dim, activations
        )

        make = ProjectionFactory(weights, self.kernels, self.device, self.dtype, int4=int4, int6=int6, int8=int8, w16=w16)
        w = make.tensor
        codes_q8, int4, int6, int8, w16 = make.codes_q8, make.int4, make.int6, make.int8, make.w16
        # What each layer computes: the family's description (models/family.py).
        self.family = family_of(config.architecture)
        self.specs: list[LayerSpec] = list(self.family.layers(config))
        if len(self.specs) != config.num_layers:
            raise ValueError(f"the {self.family.name} family described {len(self.specs)} layers of {config.num_layers}")

        def norm(name: str) -> torch.Tensor:  # norm weights are kept in fp32, in which norms compute anyway
            return w(name).float()

        self.norm = norm("model.norm.weight")
        self.layers = []
        if progress is not None:
            progress(0, config.num_layers)
        for i, spec in enumerate(self.specs):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(
                _Layer(
                    attn_norm=norm(p + "input_layernorm.weight"),
                    qkv=make([a + f"{x}_proj.weight" for x in "qkv"], [a + f"{x}_proj.bias" for x in "qkv"] if config.attention_bias else None),
                    o=make([a + "o_proj.weight"]),
                    mlp_norm=norm(p + ("pre_feedforward_layernorm.weight" if spec.sandwich_norms else "post_attention_layernorm.weight")),
                    gate_up=make([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    down=make([p + "mlp.down_proj.weight"]),
                    q_norm=norm(a + "q_norm.weight") if spec.qk_norm else None,
                    k_norm=norm(a + "k_norm.weight") if spec.qk_norm else None,
                    post_attn_norm=norm(p + "post_attention_layernorm.weight") if spec.sandwich_norms else None,
                    post_mlp_norm=norm(p + "post_feedforward_layernorm.weight") if spec.sandwich_norms else None,
                )
            )
            if progress is not None:
                progress(i + 1, config.num_layers)
        # A model served with 4-bit projections (on CPU, bf16 or float32)
        # gets an 8-bit output head too, one scale per row: the GGUF's
        # embedding is 8-bit (Q8_0) already, the head is read whole every
        # step, and the int8 kernel computes each row on its own, so it is
        # batch-invariant as it is (bench/README.md, "Performance").
        # On a GPU the dense head (cuBLAS) serves instead.
        quantized = bool(self.layers) and any(p.quantized for p in (self.layers[0].qkv, self.layers[0].gate_up))
        # The embedding is read a few rows a step. Where the file holds it
        # quantized and no dense head reads it, only those rows are made, from
        # the file, each step (Checkpoint.rows): no dense copy of 4 or 2 bytes a
        # weight. The head and the embedding are made after the layers, one at
        # a time, so that at most one dense copy exists while the model is built.
        embed_name = "model.embed_tokens.weight"
        head_name = embed_name if config.tie_embeddings else "lm_head.weight"
        # A 16-bit float head (an F16 or BF16 file's, kernels/w16.py) of a model whose layers
        # take no 8-bit codes runs on the file's bits, per row, into float32 logits.
        self.head_w16 = None
        self.head_int8 = None
        self.head_codes = None
        head_rows = (rows or {}).get(head_name)
        head_shape = (config.vocab_size, config.hidden_size)
        # With int8 activations the head stays in its file type where that has a kernel (a Q8_0,
        # Q6_K, Q4_K... head on the layers' codes kernels, inputs in 8-bit blocks as theirs), as
        # llama.cpp computes it: fewer bytes read a step than an 8-bit copy for the 4- to 6-bit
        # types, and no copy made. Where the C kernel does not take the shape (a vocabulary not a
        # multiple of 16) the 8-bit copy below serves instead of the slow torch twin.
        head_parts = next((table[head_name] for table in (int4, int6, int8) if head_name in table), None) if quantized and codes_q8 else None
        if head_parts is not None:
            # The kernels take outputs 16 at a time: a vocabulary of another size is padded with
            # copies of row 0, whose logits `_head` cuts off.
            padded = -(-head_shape[0] // HEAD_OUTPUTS) * HEAD_OUTPUTS
            order = np.concatenate([np.arange(head_shape[0]), np.zeros(padded - head_shape[0], dtype=np.int64)])
            if padded != head_shape[0]:
                head_parts = head_parts.take_rows(order)
            later = DenseLater((padded, head_shape[1]), self.dtype, self.device, lambda: w(head_name)[torch.from_numpy(order)])
            head = self.kernels.projection(later, None, head_parts)
            if head.every_row_kernel and (head.native is not None or self.kernels.name == "reference"):
                self.head_codes = head
            del head, head_parts
        if self.head_codes is not None:
            self.lm_head = torch.empty(head_shape, dtype=self.dtype, device="meta")
        elif not quantized and head_name in w16 and native.w16_supported(*head_shape):
            self.head_w16 = pack_w16(w16[head_name])
            self.lm_head = torch.empty(head_shape, dtype=self.dtype, device="meta")
        elif quantized and self.device.type == "cpu" and head_rows is not None:
            # The 8-bit copy made slice by slice from the file's rows: no dense head at any time.
            self.head_int8 = Int8Rows.from_rows(lambda start, end: head_rows(torch.arange(start, end)), *head_shape)
            self.lm_head = torch.empty(head_shape, dtype=self.dtype, device="meta")
        else:
            self.lm_head = w(head_name)
            self.head_int8 = Int8Rows(self.lm_head) if quantized and self.device.type == "cpu" else None
            if self.head_int8 is not None and not config.tie_embeddings:
                self.lm_head = torch.empty(self.lm_head.shape, dtype=self.lm_head.dtype, device="meta")  # the 8-bit copy serves
        self.embed_rows = None
        source = (rows or {}).get(embed_name)
        if source is not None and self.device.type == "cpu" and (
            self.head_int8 is not None or self.head_w16 is not None or self.head_codes is not None or not config.tie_embeddings
        ):
            self.embed_rows = source
            self.embed = torch.empty((config.vocab_size, config.hidden_size), dtype=self.dtype, device="meta")
            if config.tie_embeddings:
                self.lm_head = self.embed  # the codes, 8-bit or 16-bit head serves: head_codes, head_int8, head_w16
        else:
            self.embed = self.lm_head if config.tie_embeddings else w(embed_name)
        # A dense 16-bit head on a GPU sums into float32 logits and keeps them.
        self.head_out_dtype = torch.float32 if self.head_int8 is None and self.device.type != "cpu" and float_logits_mm(self.lm_head) else None
        divisors = weights.get("rope_freqs")
        positions = config.max_position if max_model_len is None else max(1, min(config.max_position, max_model_len))
        # One pair of RoPE tables per (base, scaled) the layers use: Gemma 3's local layers have their own.
        tables: dict[tuple[float, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self.layer_rope: list[tuple[torch.Tensor, torch.Tensor]] = []
        for spec in self.specs or [LayerSpec(rope_theta=config.rope_theta)]:
            key = (spec.rope_theta, spec.rope_scaled)
            if key not in tables:
                scaling = config.rope_scaling if spec.rope_scaled else RopeScaling()
                inv = rope_inv_freq(config.head_dim, spec.rope_theta, scaling, divisors if spec.rope_scaled else None)
                cos, sin = rope_tables(inv, positions)
                tables[key] = (cos.to(self.device), sin.to(self.device))
            self.layer_rope.append(tables[key])
        self.rope_cos, self.rope_sin = self.layer_rope[0]
        self.scale = config.attention_scale
        # Sliding-window layers attend through the torch twin with a windowed mask (kernels/reference.py).
        self.windows = sorted({spec.window for spec in self.specs if spec.window is not None})
        self._scratch: torch.Tensor | None = None  # [2, n]: gathered K and V (see _gather_buffers)
        self._window_scratch: torch.Tensor | None = None  # the same for sliding-window layers (_window_buffers)
        # Where every per-layer call would be a C kernel, the layers run in one C call a step
        # (kernels/layer_runner.py): the same kernels and bits, without ~9 Python calls a layer.
        # None: layer by layer in Python (setting it to None runs a model that way).
        self.runner: LayerRunner | None = LayerRunner.for_model(self)
        # LoRA adapters resident for this model; none until the engine allows some (--max-loras).
        self.lora = LoraSet(config, self.dtype, capacity=0, device=self.device)

    @property
    def max_positions(self) -> int:
        """How many positions the model serves: its RoPE tables' length."""
        return int(self.rope_cos.shape[0])

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        *,
        use_int4: bool = True,
        device: str | torch.device = "cpu",
        batch_invariant: bool = False,
        kernels: str = "auto",
        activations: str = "auto",
        kv_dtype: torch.dtype | None = None,
        progress: Callable[[int, int], None] | None = None,
        max_model_len: int | None = None,
    ) -> DecoderModel:
        int4 = checkpoint.int4 if use_int4 else None
        model = cls(
            checkpoint.config, checkpoint.weights, int4=int4, device=device, batch_invariant=batch_invariant, kernels=kernels,
            activations=activations, rows=checkpoint.rows, int6=checkpoint.int6 if use_int4 else None,
            int8=checkpoint.int8 if use_int4 else None, w16=checkpoint.w16 if use_int4 else None, kv_dtype=kv_dtype,
            progress=progress, max_model_len=max_model_len,
        )  # fmt: skip
        checkpoint.drop_file_pages()
        return model

    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token_element * self.kv_dtype.itemsize

    def new_kv_cache(self, num_blocks: int, block_size: int, *, huge_pages: bool = False) -> KVCache:
        """The block pool, resident only where written; ``huge_pages``: on 2 MiB
        pages (a sequence's blocks lie scattered over the pool; kernels/memory.py)."""
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, num_blocks, block_size, c.head_dim)
        return KVCache(
            k=memory.zeros(shape, dtype=self.kv_dtype, device=self.device, huge_pages=huge_pages),
            v=memory.zeros(shape, dtype=self.kv_dtype, device=self.device, huge_pages=huge_pages),
        )

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        """Run one step: write the new tokens' K/V into ``cache`` and return
        the logits of each sequence's last new token, [S, vocab] in fp32."""
        h = self._residual(batch, cache)
        return self._head(self._rms_norm(h.index_select(0, batch.last_index), self.norm))

    @torch.inference_mode()
    def forward_hidden(
        self, batch: StepBatch, cache: KVCache, logit_rows: torch.Tensor, hidden_rows: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run one step like `forward`, and return the logits of the packed
        tokens ``logit_rows`` ([K, vocab] fp32; None when K is 0) and the
        final hidden states of the packed tokens ``hidden_rows``, after the
        last RMSNorm, uncast ([P, hidden] fp32). Every row of either is
        computed from that row alone (the norm and the head are per row)."""
        return self.forward_parts(batch, cache, logit_rows, hidden_rows=hidden_rows)  # type: ignore[return-value]

    @torch.inference_mode()
    def forward_parts(
        self,
        batch: StepBatch,
        cache: KVCache,
        logit_rows: torch.Tensor,
        *,
        hidden_rows: torch.Tensor | None = None,
        scored_rows: torch.Tensor | None = None,
        scored: Callable[[torch.Tensor], None] | None = None,
        slice_rows: int = 128,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one step like `forward`; return the logits of the packed
        tokens ``logit_rows`` ([K, vocab] fp32; None when K is 0) and, with
        ``hidden_rows``, those tokens' final hidden states as
        `forward_hidden` gives them. With ``scored_rows``, the logits of those
        packed tokens go to ``scored``, ``slice_rows`` rows at a time (never
        [T, vocab] floats at once). Each row is computed from itself alone:
        the same bits through either path, whatever shares its step."""
        h = self._residual(batch, cache)
        logits = None
        if logit_rows.numel():
            logits = self._head(self._rms_norm(h.index_select(0, logit_rows), self.norm))
        if scored_rows is not None and scored is not None:
            for part in scored_rows.split(slice_rows):
                scored(self._head(self._rms_norm(h.index_select(0, part), self.norm)))
        hidden = None
        if hidden_rows is not None:
            picked = h.index_select(0, hidden_rows).contiguous()
            hidden = self.kernels.rms_norm(picked, self.norm, self.config.rms_eps, torch.float32)
        return logits, hidden

    def _residual(self, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        """The step's layers: K/V written into ``cache``, and the fp32
        residual stream after the last layer, [T_padded, hidden]."""
        c = self.config
        if int(batch.positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(batch.positions.max())} is past the model's {self.max_positions}")
        if batch.fixed != self.batch_invariant:
            raise ValueError(f"a step built with fixed={batch.fixed} for a model with batch_invariant={self.batch_invariant}")
        if self.kernels.name != "reference":  # what the kernels are then called with, unchecked, on every layer
            for t in (batch.positions, batch.slot_mapping, *(g.block_tables for g in batch.groups), *(g.lengths for g in batch.groups)):
                if t.dtype != torch.int64 or not t.is_contiguous():
                    raise ValueError("a step's index tensors must be contiguous int64")
        n_q = c.num_heads * c.head_dim
        kernels = self.kernels
        # The residual stream stays fp32 whatever the weights' dtype: SmolLM2
        # and others grow "attention sink" activations (~25000) whose bf16
        # rounding (±128) swamps the per-layer updates and derails greedy
        # decoding. Norm outputs are cast back to the weights' dtype for matmuls.
        h = (self.embed_rows(batch.token_ids) if self.embed_rows is not None else F.embedding(batch.token_ids, self.embed)).float()
        if c.embed_scale != 1.0:
            h.mul_(c.embed_scale)
        if self.runner is not None and not batch.lora_rows:  # the loop below, in one C call (the same bits)
            h = h.contiguous()
            self.runner.run(h, batch, cache.k, cache.v)
            return h
        gather = self._gather_buffers(batch, cache)
        d = batch.num_decode  # leading decode tokens: 4-bit weights where the model has them

        def project(p: Projection, x: torch.Tensor, layer: int, name: str) -> torch.Tensor:
            y = p.fixed(x, d) if self.batch_invariant else p(x, d)
            return self.lora.apply(layer, name, x, y, batch.lora_rows, self.batch_invariant) if batch.lora_rows else y

        windowed = self._window_masks(batch) if self.windows and not kernels.windows_in_place else {}  # the torch twin's masks
        x = self._rms_norm(h, self.layers[0].attn_norm) if self.layers else None
        for i, (layer, spec) in enumerate(zip(self.layers, self.specs)):
            qkv = project(layer.qkv, x, i, "qkv")
            if layer.q_norm is not None:
                qkv = self._qk_norm(qkv, layer)
            cos, sin = self.layer_rope[i]
            # Pad rows (after batch.num_tokens) are rotated but never stored or read back.
            q = kernels.rope_write_kv(qkv, batch.positions, cos, sin, cache.k[i], cache.v[i], batch.slot_mapping, c.num_heads, c.num_kv_heads)
            if spec.window is not None and not kernels.windows_in_place:
                attn = self._window_attention(q, cache.k[i], cache.v[i], batch, windowed[spec.window], gather)
            else:  # the C kernel takes the window, reading the pool in place
                attn = self._attention(q, cache.k[i], cache.v[i], batch, gather, spec.window)
            o = project(layer.o, attn.reshape(-1, n_q), i, "o")
            if layer.post_attn_norm is not None:
                o = self.kernels.rms_norm(o.float().contiguous(), layer.post_attn_norm, c.rms_eps, torch.float32)
            x = self._add_rms_norm(h, o, layer.mlp_norm)
            gate_up = project(layer.gate_up, x, i, "gate_up")
            act = kernels.silu_mul(gate_up) if spec.activation == "silu" else kernels.gelu_tanh_mul(gate_up)
            down = project(layer.down, act, i, "down")
            if layer.post_mlp_norm is not None:
                down = self.kernels.rms_norm(down.float().contiguous(), layer.post_mlp_norm, c.rms_eps, torch.float32)
            if i + 1 < len(self.layers):
                x = self._add_rms_norm(h, down, self.layers[i + 1].attn_norm)
            else:
                h.add_(down)
        return h

    def _qk_norm(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """``qkv`` with each query and key head RMS-normed on its own (q_norm,
        k_norm weights over the head's width), in fp32, cast back."""
        c = self.config
        rows, d = qkv.shape[0], c.head_dim
        q_end, k_end = c.num_heads * d, (c.num_heads + c.num_kv_heads) * d
        out = qkv.clone()
        for start, end, weight in ((0, q_end, layer.q_norm), (q_end, k_end, layer.k_norm)):
            heads = qkv[:, start:end].float().reshape(-1, d).contiguous()
            out[:, start:end] = self.kernels.rms_norm(heads, weight, c.rms_eps, torch.float32).reshape(rows, end - start).to(qkv.dtype)
        return out

    def _window_masks(self, batch: StepBatch) -> dict[int, list[torch.Tensor]]:
        """For each sliding window the layers use, each attention group's mask
        cut to the window (`reference.window_mask`): a query at position p
        attends to keys p - window + 1 .. p. Empty where the kernels take
        the window themselves (`windows_in_place`: the C attention)."""
        if self.kernels.windows_in_place:
            return {}
        return {window: [reference.window_mask(g.mask, window) for g in batch.groups] for window in self.windows}

    def _window_attention(self, q: torch.Tensor, k_cache, v_cache, batch: StepBatch, masks: list[torch.Tensor], gather) -> torch.Tensor:
        """Attention of a sliding-window layer where the kernels do not take
        the window in place: the torch twin (kernels/reference.py) under each
        group's windowed mask, the same per-row arithmetic as a full layer's
        torch path (fixed order when batch-invariant)."""
        out = q.new_zeros(q.shape)
        k_buf, v_buf = self._window_buffers(batch, k_cache)
        for g, mask in zip(batch.groups, masks):
            end = g.first + g.count
            out[g.first : end] = reference.paged_attention(
                q[g.first : end], k_cache, v_cache, g.block_tables, g.pad_index, mask, self.scale,
                flash=g.flash, fixed=g.fixed, gather_into=(k_buf, v_buf),
            ).to(q.dtype)  # fmt: skip
        return out

    def _window_buffers(self, batch: StepBatch, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for the sliding-window layers' gathered keys and values
        (`_gather_buffers`, sized for every group whatever the kernel set)."""
        c = self.config
        need = max(g.block_tables.numel() for g in batch.groups) * c.num_kv_heads * k_cache.shape[2] * c.head_dim
        old = self._window_scratch
        if old is None or old.dtype != k_cache.dtype or old.device != k_cache.device or old.shape[1] < need:
            size = max(need, 2 * old.shape[1]) if old is not None and old.dtype == k_cache.dtype else need
            self._window_scratch = torch.empty(2, size, dtype=k_cache.dtype, device=k_cache.device)
        return self._window_scratch[0], self._window_scratch[1]

    def _add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``h += delta`` (the fp32 residual stream, in place), then h normed
        and cast to the weights' dtype."""
        return self.kernels.add_rms_norm(h, delta, weight, self.config.rms_eps, self.dtype)

    def _rms_norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The fp32 residual rows ``h`` normed and cast to the weights' dtype."""
        return self.kernels.rms_norm(h, weight, self.config.rms_eps, self.dtype)

    def _head(self, last: torch.Tensor) -> torch.Tensor:
        """Logits [S, vocab] fp32 of the final-normed rows ``last``, soft-capped
        where the family caps them."""
        logits = self._head_logits(last)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap).mul_(cap)

    def _head_logits(self, last: torch.Tensor) -> torch.Tensor:
        if self.head_codes is not None:  # per row too
            logits = self.head_codes.logits(last)
            vocab = self.config.vocab_size
            return logits if logits.shape[1] == vocab else logits[:, :vocab].contiguous()
        if self.head_int8 is not None:  # per-row arithmetic in either mode
            return self.head_int8(last)
        if self.head_w16 is not None:  # per row too
            return native.w16_matmul(self.head_w16, last.contiguous(), checked=False, out_dtype=torch.float32)
        if self.batch_invariant:
            return tiled_head(last, self.lm_head, out_dtype=self.head_out_dtype).float()
        if self.head_out_dtype is not None:
            return torch.mm(last, self.lm_head.t(), out_dtype=self.head_out_dtype)
        return F.linear(last, self.lm_head).float()

    def _attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch, gather, window: int | None = None
    ) -> torch.Tensor:
        """[T_padded, H, D]: each group's rows attended on their own (one
        group at a time, so they share the gather buffers); pad tokens'
        rows are zeros. ``window``: a sliding-window layer's, for kernels
        that take it in place (`Kernels.windows_in_place`)."""
        if len(batch.groups) == 1 and batch.groups[0].count == q.shape[0]:
            return self._group_attention(q, k_cache, v_cache, batch.groups[0], gather, window)
        out = q.new_empty(q.shape)
        end = 0
        for g in batch.groups:
            end = g.first + g.count
            out[g.first : end] = self._group_attention(q[g.first : end], k_cache, v_cache, g, gather, window)
        out[end:].zero_()
        return out

    def _group_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g, gather, window: int | None = None) -> torch.Tensor:
        if window is None:
            return self.kernels.attention(q, k_cache, v_cache, g, self.scale, gather)
        return self.kernels.attention(q, k_cache, v_cache, g, self.scale, gather, window=window)

    def _gather_buffers(self, batch: StepBatch, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat scratch buffers that any group's gathered keys and values
        fit in. They grow (at least doubling) when a step needs more and are
        kept, so steps stop allocating them at all."""
        c = self.config
        per_block = c.num_kv_heads * cache.block_size * c.head_dim
        # Rows through a kernel that reads the pool in place need no buffer.
        torch_groups = [] if self.kernels.reads_in_place else list(batch.groups)
        need = max((g.block_tables.numel() for g in torch_groups), default=0) * per_block
        old = self._scratch
        if old is None or old.dtype != cache.k.dtype or old.device != cache.k.device:
            old = None
        if old is None or old.shape[1] < need:
            size = max(need, 2 * old.shape[1]) if old is not None else need
            self._scratch = torch.empty(2, size, dtype=cache.k.dtype, device=cache.k.device)
        return self._scratch[0], self._scratch[1]
