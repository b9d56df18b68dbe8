"""A step's decoder layers in one C call (`trioserve_run_layers` in
kernels/csrc/cpu_kernels.c).

models/decoder.py `_residual` runs a layer as about nine kernel calls (the
fused projections, RoPE with the K/V write, attention, the norms, SiLU),
each through a Python wrapper and ctypes: a few microseconds each, ~1.6 ms
of a ~10 ms one-sequence decode step of the default model on two cores
(bench/README.md, "One call a step"). Where every one of those calls would
be a C kernel, the model hands the whole loop to C instead: the same
kernels, in the same order, on buffers of the same dtypes, so every bit is
the same as the per-call forward (tests/kernels/test_layer_runner.py).

The weights' side (pointers into the projections' packed codes, the norm
weights, RoPE tables) is described once, when the model is built; a step
adds only its index tensors and the KV pool."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import attrs
import torch

from trioserve.kernels import int6, int8w, native_pack, w16
from trioserve.kernels.projection import Projection, StackedProjection

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
MAX_PARTS = 4  # TS_MAX_PARTS: the most types one fused projection mixes
# TsMat kinds.
INT4_Q8, INT6_Q8, INT6S_Q8, INT8_Q8, W16 = 1, 2, 3, 4, 5
# TsLayer activations (models/family.ACTIVATIONS).
ACTIVATION = {"silu": 0, "gelu_tanh": 1}
# Which kernel a nonzero return came from (its code plus 16 times this).
_FAILED = {1: "a projection", 2: "rope_write_kv", 3: "decode_attention"}


class _Mat(ctypes.Structure):
    _fields_ = [("kind", _i32), ("w_bf16", _i32), ("n", _i64), ("k", _i64), ("packed", _ptr), ("scales", _ptr)]


class _Proj(ctypes.Structure):
    _fields_ = [("part", _Mat * MAX_PARTS), ("parts", _i64), ("n", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _ptr), ("mlp_norm", _ptr), ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
        ("q_norm", _ptr), ("k_norm", _ptr), ("cos", _ptr), ("sin", _ptr), ("window", _i64), ("post_attn_norm", _ptr),
        ("post_mlp_norm", _ptr), ("activation", _i32),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(_Layer)), ("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
        ("dim", _i64), ("max_position", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("bf16", _i32), ("kv_bf16", _i32),
    ]  # fmt: skip


def runs_in_c(spec) -> bool:
    """Whether the C loop computes a layer of this description
    (models/family.LayerSpec): a Llama layer, with or without q/k norm
    (Qwen3), attending to the whole history or within a sliding window
    (Mistral, Phi-3), with or without sandwich norms, SwiGLU or GeGLU
    (Gemma 3), at any RoPE base and scaling (each layer's own tables). Any
    other field (any field a later LayerSpec adds, an activation the loop
    lacks) sends the model layer by layer through Python."""
    plain = type(spec)()  # the default description: a Llama layer
    known = ("mixer", "window", "rope_theta", "rope_scaled", "qk_norm", "sandwich_norms", "activation")
    return spec.activation in ACTIVATION and spec == attrs.evolve(plain, **{name: getattr(spec, name) for name in known})


class _Group(ctypes.Structure):
    _fields_ = [
        ("first", _i64), ("count", _i64), ("num_tables", _i64), ("max_blocks", _i64), ("tables", _ptr), ("lens", _ptr),
        ("row_seq", _ptr),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("k_pool", _ptr), ("v_pool", _ptr), ("num_blocks", _i64), ("block_size", _i64), ("positions", _ptr),
        ("slots", _ptr), ("rows", _i64), ("real", _i64), ("groups", ctypes.POINTER(_Group)), ("num_groups", _i64),
        ("threads", _i32),
    ]  # fmt: skip


def _mat(p: Projection, lib) -> _Mat | None:
    """The C description of one projection's held weight, or None where a
    row of it would not go through one of the codes (or 16-bit) kernels."""
    if not isinstance(p, Projection) or p.bias is not None or p._lib is not lib or not p.every_row_kernel or p.native is None:
        return None
    pack = p.native
    if isinstance(pack, w16.W16Pack):
        return _Mat(W16, int(pack.bf16), pack.n, pack.k, pack.packed.data_ptr(), None)
    if isinstance(pack, int6.Int6Pack):
        kind = INT6S_Q8 if pack.symmetric else INT6_Q8
    elif isinstance(pack, int8w.Int8CodesPack):
        kind = INT8_Q8
    elif isinstance(pack, native_pack.Int4Pack) and pack.q8:
        kind = INT4_Q8
    else:
        return None
    return _Mat(kind, 0, pack.n, pack.k, pack.packed.data_ptr(), pack.scales.data_ptr())


def _proj(p: Projection | StackedProjection, lib) -> _Proj | None:
    parts = p.parts if isinstance(p, StackedProjection) else [p]
    mats = [_mat(part, lib) for part in parts]
    if len(mats) > MAX_PARTS or any(m is None for m in mats):
        return None
    out = _Proj()
    for i, m in enumerate(mats):
        out.part[i] = m
    out.parts = len(mats)
    out.n = sum(m.n for m in mats)
    return out


class LayerRunner:
    """A model's layers, described for `trioserve_run_layers`. Holds
    pointers into the model's tensors: it lives as long as the model."""

    def __init__(self, lib, model: _Model, layers, keep: Sequence[torch.Tensor]):
        self._lib = lib
        self._model = model
        self._layers = layers  # the array `model.layers` points into
        self._keep = tuple(keep)
        self._fn = lib.trioserve_run_layers

    @classmethod
    def for_model(cls, model) -> LayerRunner | None:
        """The runner for a `DecoderModel` whose layers the C loop computes
        (`runs_in_c`) and whose every per-layer call would be a C kernel
        (its kernels the native set, attention read in place, every
        projection's rows through the codes or 16-bit kernels, no bias), or
        None (the model then runs layer by layer in Python)."""
        kernels = model.kernels
        if kernels.name != "native" or not kernels.reads_in_place or not model.layers:
            return None
        # The C loop runs the layers `runs_in_c` names; a model with any other runs layer by layer in Python.
        specs = list(getattr(model, "specs", ()))
        if len(specs) != len(model.layers) or not all(runs_in_c(spec) for spec in specs):
            return None
        ropes = list(getattr(model, "layer_rope", ())) or [(model.rope_cos, model.rope_sin)] * len(model.layers)
        if len(ropes) != len(model.layers) or any(cos.shape != model.rope_cos.shape or sin.shape != cos.shape for cos, sin in ropes):
            return None
        if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
            return None
        lib = kernels._lib
        if lib is None or not hasattr(lib, "trioserve_run_layers"):
            return None
        array = (_Layer * len(model.layers))()
        keep = []
        c = model.config
        for i, (layer, spec, (cos, sin)) in enumerate(zip(model.layers, specs, ropes)):
            projs = [_proj(p, lib) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in projs):
                return None
            qk = [getattr(layer, "q_norm", None), getattr(layer, "k_norm", None)] if spec.qk_norm else []
            if any(t is None or t.shape != (c.head_dim,) for t in qk):
                return None
            q_norm, k_norm = (qk[0].data_ptr(), qk[1].data_ptr()) if qk else (None, None)
            sandwich = [getattr(layer, "post_attn_norm", None), getattr(layer, "post_mlp_norm", None)] if spec.sandwich_norms else []
            if any(t is None or t.shape != (c.hidden_size,) for t in sandwich):
                return None
            post_attn, post_mlp = (sandwich[0].data_ptr(), sandwich[1].data_ptr()) if sandwich else (None, None)
            if spec.window is not None and spec.window < 1:
                return None
            array[i] = _Layer(
                layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr(), *projs, q_norm, k_norm, cos.data_ptr(), sin.data_ptr(), spec.window or 0,
                post_attn, post_mlp, ACTIVATION[spec.activation],
            )  # fmt: skip
            keep += [layer.attn_norm, layer.mlp_norm, cos, sin, *qk, *sandwich]
        for t in keep:
            if t.dtype != torch.float32 or not t.is_contiguous():
                return None
        description = _Model(
            ctypes.cast(array, ctypes.POINTER(_Layer)), len(model.layers), c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, model.rope_cos.shape[0],
            c.rms_eps, model.scale, int(model.dtype == torch.bfloat16), int(model.kv_dtype == torch.bfloat16),
        )  # fmt: skip
        fn = lib.trioserve_run_layers
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step), _ptr]
        return cls(lib, description, array, keep)

    def run(self, h: torch.Tensor, batch, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        """Every layer on the residual rows ``h`` ([T_padded, hidden] fp32,
        contiguous; updated in place to the stream after the last layer),
        the step's K/V written into the pool ([layers, KVH, NB, BS, D]
        each). The step's index tensors must be contiguous int64 (the
        model checks them)."""
        if not (k_pool.is_contiguous() and v_pool.is_contiguous() and h.is_contiguous()) or h.dtype != torch.float32:
            raise RuntimeError("run_layers takes contiguous fp32 rows and a contiguous pool")
        groups = (_Group * len(batch.groups))()
        for i, g in enumerate(batch.groups):
            lens, row_seq = (g.lengths, None) if g.decode else (g.row_lengths, g.row_seq)
            tables = g.block_tables
            groups[i] = _Group(
                g.first, g.count, tables.shape[0], tables.shape[1], tables.data_ptr(), lens.data_ptr(),
                None if row_seq is None else row_seq.data_ptr(),
            )  # fmt: skip
        step = _Step(
            k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[2], k_pool.shape[3], batch.positions.data_ptr(),
            batch.slot_mapping.data_ptr(), h.shape[0], batch.slot_mapping.shape[0], ctypes.cast(groups, ctypes.POINTER(_Group)),
            len(batch.groups),
            torch.get_num_threads(),
        )  # fmt: skip
        code = self._fn(ctypes.byref(self._model), ctypes.byref(step), h.data_ptr())
        if code == 64:
            raise RuntimeError("run_layers could not allocate its scratch memory")
        if code:
            raise RuntimeError(f"run_layers: {_FAILED.get(code // 16, 'a kernel')} failed with code {code % 16}{_why(code)}")


def _why(code: int) -> str:
    """The per-call wrappers' words for the failures a step could cause."""
    if code // 16 == 2 and code % 16 == 3:
        return ": a position or slot is out of range"
    if code // 16 == 3 and code % 16 == 3:
        return ": a length, table row or block id is outside the block tables or the pool"
    return ""
