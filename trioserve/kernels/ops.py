"""The seam between the model and the kernels: one object per model that
says how each operation of the forward pass runs on the model's device.

    reference   torch twins (kernels/reference.py): any device, the oracle
    native      the C kernels of kernels/native.py (CPU, where they build)
    triton      the Triton kernels of kernels/gpu (CUDA; on a CPU only under
                TRITON_INTERPRET=1, which the tests use)

`select_kernels` picks one from ``--kernels`` (auto, reference, triton) and
the device: auto is triton on CUDA, native on a CPU where the C kernels
build, reference elsewhere. models/decoder.py calls only these methods; it
imports no implementation itself. Every set has the same methods with the
same signatures and meanings (each method's docstring in `Kernels`); the
sets differ in speed and in rounding, never in what they compute."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from trioserve.config import check_choice
from trioserve.kernels import reference
from trioserve.kernels.int4 import Int4Parts, Int4Rows
from trioserve.kernels.projection import Projection


class Kernels:
    """The reference set: torch, on any device. The base of the others, which
    replace what they run faster and leave the rest to it."""

    name = "reference"
    # Attention reads the pool where it lies (no gathered copy of K and V),
    # for every group: the model then needs no gather buffers.
    reads_in_place = False
    # Attention takes a sliding window reading the pool in place too (else a
    # windowed layer's attention gathers K and V, and needs buffers for them).
    windows_in_place = False
    # Whether a step's bits are the same on any number of CPU threads (then
    # the worker may choose the count per step: kernels/cpu.py ThreadGovernor).
    thread_invariant = False

    def __init__(self, activations: str = "bf16") -> None:
        # How the 4-bit projections' rows take their inputs: "bf16" or "int8" (`--activations`).
        self.activations = activations

    def projection(self, weight: torch.Tensor, bias: torch.Tensor | None, int4: Int4Parts | None) -> Projection:
        """A projection y = x W^T (+ bias) whose generated tokens' rows use
        the 4-bit codes ``int4`` where given (kernels/projection.Projection):
        here torch's CPU int4 op (or, with int8 activations, the torch twin
        of the C kernel), on a CPU, for bf16 or float32 weights."""
        return Projection(weight, bias, int4, use_native=False, activations=self.activations)

    def rms_norm(self, h: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        """fp32 rows ``h`` [T, n] normed with the fp32 ``weight`` [n], cast to ``dtype``."""
        return reference.rms_norm(h, weight, eps).to(dtype)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        """``h += delta`` in place (the fp32 residual stream), then `rms_norm` of the new h."""
        h.add_(delta)
        return self.rms_norm(h, weight, eps, dtype)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of packed rows [T, 2F] (gate, then up): [T, F]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU: gelu(gate) (tanh approximation) * up of packed rows [T, 2F]
        (gate, then up), computed in fp32 and cast back: [T, F]."""
        gate, up = gate_up.float().chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        """RoPE on the queries and keys of packed rows qkv [T, (H + 2 KVH) D]
        (cos, sin [max_position, D/2] fp32 tables, read at ``positions``),
        and the rotated keys and the values of the first len(slots) rows
        stored into the paged caches [KVH, NB, BS, D] at ``slots`` (later
        rows are padding). Returns the rotated queries [T, H, D]."""
        dim = k_cache.shape[-1]
        n_q, n_kv = heads * dim, kv_heads * dim
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)
        q = reference.apply_rope(qkv[:, :n_q].view(-1, heads, dim), c, s)
        k = reference.apply_rope(qkv[:, n_q : n_q + n_kv].view(-1, kv_heads, dim), c, s)
        real = slots.shape[0]
        v = qkv[:real, n_q + n_kv :].reshape(-1, kv_heads, dim)
        reference.write_kv(k_cache, v_cache, slots, k[:real], v)
        return q

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group, scale: float, gather, window: int | None = None
    ) -> torch.Tensor:
        """The attention of one group's rows (models/step.AttentionGroup) to
        their cached keys: [R, H, D] in q's dtype. ``gather`` is the model's
        two scratch buffers for a set that copies K and V (not read by the
        sets that read in place). ``window``: a sliding-window layer's, a
        row at position p attending to keys p - window + 1 .. p only (here
        the group's mask cut to it, `reference.window_mask`)."""
        mask = group.mask if window is None else reference.window_mask(group.mask, window)
        return reference.paged_attention(
            q, k_cache, v_cache, group.block_tables, group.pad_index, mask, scale,
            flash=group.flash, fixed=group.fixed, gather_into=gather,
        )  # fmt: skip


class NativeKernels(Kernels):
    """The C kernels (kernels/native.py), called unchecked: the model hands
    them contiguous tensors of the dtypes they take, and checks the step's
    index tensors once a step. Attention goes through C only for the head
    shapes it takes (`native.supports`); other shapes use the torch twin."""

    name = "native"

    def __init__(self, attention_in_c: bool, activations: str = "bf16") -> None:
        from trioserve.kernels import native, native_build

        super().__init__(activations)
        self._native = native
        self._lib = native_build.library()  # pinned: the hot path does not read the environment
        self.reads_in_place = attention_in_c
        self.windows_in_place = attention_in_c  # `native.decode_attention` takes the window

    @property
    def thread_invariant(self) -> bool:
        """With int8 activations every projection, the head, attention and
        the elementwise work run in C kernels that give each row the same
        bits on any number of threads (each tested so); bf16 prompt rows
        go through torch's matmuls, which promise no such thing."""
        return self.activations == "int8" and self.reads_in_place

    def projection(self, weight, bias, int4):
        # The C 4-bit kernel for the activations where it takes the shape.
        return Projection(weight, bias, int4, activations=self.activations)

    def rms_norm(self, h, weight, eps, dtype):
        return self._native.rms_norm(h.contiguous(), weight, eps, dtype, checked=False, lib=self._lib)

    def add_rms_norm(self, h, delta, weight, eps, dtype):
        return self._native.add_rms_norm(h, delta.contiguous(), weight, eps, dtype, checked=False, lib=self._lib)

    def silu_mul(self, gate_up):
        return self._native.silu_mul(gate_up.contiguous(), checked=False, lib=self._lib)

    def gelu_tanh_mul(self, gate_up):
        return self._native.gelu_tanh_mul(gate_up.contiguous(), checked=False, lib=self._lib)

    def rope_write_kv(self, qkv, positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads):
        return self._native.rope_write_kv(qkv.contiguous(), positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads, checked=False, lib=self._lib)

    def attention(self, q, k_cache, v_cache, group, scale, gather, window=None):
        if not self.reads_in_place:
            return super().attention(q, k_cache, v_cache, group, scale, gather, window)
        return _row_attention(self._native.decode_attention, q, k_cache, v_cache, group, scale, window=window, checked=False, lib=self._lib)


class TritonKernels(Kernels):
    """The Triton kernels (kernels/gpu): every op of the forward pass on a
    CUDA device, or on CPU tensors under TRITON_INTERPRET=1 (tests only:
    hundreds of times slower than torch)."""

    name = "triton"
    reads_in_place = True

    def __init__(self) -> None:
        from trioserve.kernels.gpu import attention, elementwise

        super().__init__("bf16")  # the Triton 4-bit kernel takes bf16 inputs
        self._elementwise = elementwise
        self._attention = attention

    def projection(self, weight, bias, int4):
        return TritonProjection(weight, bias, int4)

    def rms_norm(self, h, weight, eps, dtype):
        return self._elementwise.rms_norm(h, weight, eps, dtype)

    def add_rms_norm(self, h, delta, weight, eps, dtype):
        return self._elementwise.add_rms_norm(h, delta, weight, eps, dtype)

    def silu_mul(self, gate_up):
        return self._elementwise.silu_mul(gate_up)

    def rope_write_kv(self, qkv, positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads):
        return self._elementwise.rope_write_kv(qkv.contiguous(), positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads)

    def attention(self, q, k_cache, v_cache, group, scale, gather, window=None):
        if window is not None:  # the Triton kernel has no window: the torch twin under the windowed mask (gather buffers needed)
            return super().attention(q, k_cache, v_cache, group, scale, gather, window)
        return _row_attention(self._attention.decode_attention, q, k_cache, v_cache, group, scale)


class TritonProjection(Projection):
    """A projection whose generated tokens' rows multiply the 4-bit codes
    by the Triton weight-only kernel (kernels/gpu/quant_matmul.py) on the
    weight's device; prompt rows, and everything without codes, go through
    the dense weight (cuBLAS on a GPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, int4: Int4Parts | None) -> None:
        super().__init__(weight, bias, None)
        if int4 is not None:
            from trioserve.kernels.gpu import quant_matmul

            self._matmul = quant_matmul.matmul
            self.packed = quant_matmul.pack_int4_parts(int4).to(weight.device)
            if isinstance(int4, Int4Rows):  # unpacked by now: the file's pages can go
                int4.release()

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(self.packed, x).to(x.dtype)
        return y if self.bias is None else y + self.bias


def _row_attention(kernel, q, k_cache, v_cache, group, scale, **options) -> torch.Tensor:
    """A group through a kernel that reads the pool in place, row by row:
    decode rows by their own table row, prompt rows by their sequence's
    (`row_seq`), each to its own length. The kernels return fp32."""
    if group.decode:
        out = kernel(q.contiguous(), k_cache, v_cache, group.block_tables, group.lengths, scale, **options)
    else:
        out = kernel(q.contiguous(), k_cache, v_cache, group.block_tables, group.row_lengths, scale, row_seq=group.row_seq, **options)
    return out.to(q.dtype)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def select_kernels(
    choice: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, activations: str = "auto"
) -> Kernels:
    """The kernel set ``choice`` (auto, reference or triton) means for a
    model of ``dtype`` on ``device``, with generated tokens' 4-bit rows
    taking ``activations`` (auto, bf16 or int8; the set holds what auto
    resolved to: int8 where the C kernel for it runs, else bf16).
    ValueError, saying why, for triton where it cannot run, and for int8
    activations where neither the C kernel for them runs nor the reference
    set (their torch twin, the oracle: too slow to serve) was asked for."""
    check_choice("engine.kernels", choice)  # the settings' own check (trioserve/options.py), for callers without an EngineConfig
    check_choice("engine.activations", activations)
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        if device.type != "cuda" and not _interpreted():
            raise ValueError(f"--kernels triton needs a CUDA device (this model is on {device.type}); TRITON_INTERPRET=1 runs them on a CPU, very slowly, for tests")
        if activations == "int8":
            raise ValueError("--activations int8 runs on a CPU (the C kernel or its torch twin); the Triton kernels take bf16 activations")
        return TritonKernels()
    from trioserve.kernels import native, native_build

    if choice == "reference":
        return Kernels("bf16" if activations == "auto" else activations)
    native_here = device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and native_build.library() is not None
    int8_here = native_here and native.int4_q8_supported(16, 32)
    if activations == "auto":
        activations = "int8" if int8_here else "bf16"
    if activations == "int8" and not int8_here:
        raise ValueError(
            "--activations int8 needs the C kernels, which run bfloat16 or float32 models on the CPU at every instruction-set level "
            f"(here: {'no int8 path in the built kernels' if native_here else 'no C kernels for this ' + device.type + ' model'}); use --activations bf16"
        )
    if native_here:
        return NativeKernels(attention_in_c=native.supports(heads, kv_heads, head_dim), activations=activations)
    return Kernels()  # bf16: int8 without the C kernel was refused above
