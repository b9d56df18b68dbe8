"""How a model's weight matrices are held and multiplied: `Projection`
(a dense weight and, where the file gives them, its codes: 4-, 6- or
8-bit, or 16-bit floats, each on its C kernel or torch twin),
`StackedProjection` (parts of one fused matrix held in different types)
and `Int8Rows` (an output head requantized to 8 bits).

A decode step is bound by reading weights, and 4-bit weights are a quarter
of bf16's bytes, so generated (decode) tokens use them; prompt tokens, many
at a time, use the bf16 copy, which is faster for many rows. The choice
depends only on what a token is, never on what else shares its step. In
the default batch-invariant mode the bf16 rows go in fixed-size tiles
(`Projection.fixed`, kernels/tiled.py, docs/determinism.md)."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from trioserve.kernels import int6, int8w, native, native_build, native_pack, reference, w16
from trioserve.kernels.int4 import GROUP, Int4Parts, Int4Rows
from trioserve.kernels.int6 import Int6Parts, Int6Rows
from trioserve.kernels.int8w import Int8Parts, Q8Rows
from trioserve.kernels.layout import BlockRows
from trioserve.kernels.tiled import PROMPT_TILE, prompt_tail_rows, prompt_tiles_per_call, tiled_linear

# The codes that run only with int8 activations: their type -> (whether the C
# kernel takes the shape, its packing, the C kernel, the torch twin).
_CODES_Q8 = {
    Int6Parts: (native.int6_q8_supported, int6.pack_int6_q8, native.int6_q8_matmul, int6.int6_q8_matmul),
    Int6Rows: (native.int6_q8_supported, int6.pack_int6_q8, native.int6_q8_matmul, int6.int6_q8_matmul),
    Int8Parts: (native.int8_q8_supported, int8w.pack_int8_q8, native.int8_q8_matmul, int8w.int8_q8_matmul),
    Q8Rows: (native.int8_q8_supported, int8w.pack_int8_q8, native.int8_q8_matmul, int8w.int8_q8_matmul),
}


@attrs.frozen
class DenseLater:
    """A dense weight not made yet: its shape, dtype and device, and how to
    make it. A `Projection` whose rows all run on codes never reads the
    dense values, so they are made only where a path does (bf16 prompt rows,
    a shape no kernel takes): a model's build then never holds a float copy
    of its biggest matrix beside the codes."""

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device
    make: Callable[[], torch.Tensor]


class Projection:
    """y = x @ W.T, with W held in the model dtype and, when given, also as
    packed int4 used for the leading ``int4_rows`` rows of a call.

    The int4 kernel takes bf16 activations and is fast only with them, so
    with float32 weights (the default on CPUs without native bf16,
    kernels/cpu.py) the int4 rows are cast to bf16 and back: the same
    arithmetic a bf16 model's generated tokens get."""

    def __init__(
        self,
        weight: torch.Tensor | DenseLater,
        bias: torch.Tensor | None = None,
        int4: Int4Parts | None = None,
        *,
        use_native: bool = True,
        activations: str = "bf16",
    ):
        """``use_native``: the C kernel where it takes the shape (else, and
        when false, torch's CPU int4 op). ``activations``: "bf16", or "int8"
        for the 4-bit rows' inputs rounded to 8 bits per block of 32
        (`native.int4_q8_matmul`, or its torch twin where the C kernel does
        not run or ``use_native`` is false)."""
        if activations not in ("bf16", "int8"):
            raise ValueError(f"activations must be bf16 or int8, got {activations!r}")
        self._setup(weight, bias, int4, use_native, activations)
        if isinstance(int4, BlockRows):  # packed or unpacked by now: the file's pages can go
            int4.release()
        if isinstance(self.weight, DenseLater):  # a path below reads the dense values: make them now
            self.weight = self.weight.make()

    def _setup(self, weight: torch.Tensor | DenseLater, bias: torch.Tensor | None, int4, use_native: bool, activations: str) -> None:
        self.weight = weight
        self.bias = bias
        self.packed = None
        self.native = None
        # The library the codes were packed for, pinned (kernels/native.py `_lib`).
        self._lib = native_build.library() if use_native and weight.device.type == "cpu" else None
        self.activations = activations
        self.q8_twin = None
        if int4 is None or weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu":
            return
        if isinstance(int4, (w16.W16Parts, w16.W16Rows)):
            # The file's 16-bit floats (kernels/w16.py): every row through their kernel,
            # whatever the activations; dense where it does not run.
            if use_native and native.w16_supported(*weight.shape):
                self.native = w16.pack_w16(int4)
                self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
            return
        if type(int4) in _CODES_Q8:
            # Codes of up to 6 bits (kernels/int6.py) or signed 8-bit ones (kernels/int8w.py):
            # int8 activations only (DecoderModel passes them then).
            if activations != "int8":
                raise ValueError("6- and 8-bit codes take int8 activations")
            supported, pack, self._codes_kernel, self._codes_twin = _CODES_Q8[type(int4)]
            if use_native and supported(*weight.shape):
                self.native = pack(int4)
                self.packed = self.native.packed
            else:
                self.q8_twin = int4.parts() if isinstance(int4, BlockRows) else int4
            self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
            return
        if activations == "int8":
            if use_native and native.int4_q8_supported(*int4.shape):
                self.native = native_pack.pack_int4_q8_rows(int4) if isinstance(int4, Int4Rows) else native_pack.pack_int4_q8(int4)
                self.packed = self.native.packed
            else:
                d = int4.scale.float()
                self.q8_twin = (int4.q, d, (int4.zero.float() - 8 * d).half().float())
            # Every row takes the codes, so the dense weight is never read:
            # keep only its shape and dtype (a meta tensor), not its bytes.
            self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
        elif use_native and native.int4_supported(*int4.q.shape):
            # The C kernel (kernels/native.py): faster, and exact products
            # of the bf16 inputs with the 4-bit codes, where torch's op
            # rounds the scale and zero to bf16.
            self.native = native_pack.pack_int4(int4)
            self.packed = self.native.packed
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(int4.q.to(torch.int32), 1)
            # [K/32, N, 2] as the kernel wants it.
            self.scales_zeros = torch.stack([int4.scale, int4.zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    @property
    def quantized(self) -> bool:
        """Whether the projection holds 4-bit codes (in a kernel's layout or for the int8 twin)."""
        return self.packed is not None or self.q8_twin is not None

    @property
    def every_row_8bit(self) -> bool:
        """With int8 activations every row takes the 4-bit codes, prompt rows
        too, as llama.cpp computes them: the 8-bit kernel is ~1.5x faster
        than the bf16 weights' matmul at 128-512 rows (bench/README.md), and
        computes each row on its own, so it needs no tiles."""
        return self.activations == "int8" and (self.native is not None or self.q8_twin is not None)

    @property
    def kind(self) -> str:
        """How the weight is held and run, in a word: "4-bit", "6-bit" or
        "8-bit" (codes), "16-bit" (an F16/BF16 file's bits) or "dense"."""
        if isinstance(self.native, w16.W16Pack):
            return "16-bit"
        if isinstance(self.native, int6.Int6Pack) or isinstance(self.q8_twin, Int6Parts):
            return "6-bit"
        if isinstance(self.native, int8w.Int8CodesPack) or isinstance(self.q8_twin, Int8Parts):
            return "8-bit"
        return "4-bit" if self.quantized else "dense"

    @property
    def every_row_kernel(self) -> bool:
        """Every row goes through the kernel on the held weight: the 8-bit
        activations' codes (`every_row_8bit`), or 16-bit float weights
        (kernels/w16.py), which hold no other copy."""
        return self.every_row_8bit or isinstance(self.native, w16.W16Pack)

    def __call__(self, x: torch.Tensor, int4_rows: int = 0) -> torch.Tensor:
        if self.every_row_kernel:
            return self._int4(x)
        if self.packed is None or int4_rows == 0:
            return F.linear(x, self.weight, self.bias)
        if int4_rows >= x.shape[0]:
            return self._int4(x)
        return torch.cat([self._int4(x[:int4_rows]), F.linear(x[int4_rows:], self.weight, self.bias)])

    def fixed(self, x: torch.Tensor, decode_rows: int) -> torch.Tensor:
        """Batch-invariant: the leading ``decode_rows`` (generated tokens)
        through the int4 kernel when there is one (it computes each row on
        its own: the same bits for 1 to 512 rows, measured), else in
        ROW_TILE tiles; the prompt rows after them in PROMPT_TILE tiles of
        the bf16 weights (the last one cut to a multiple of ROW_TILE rows
        where `prompt_tail_rows` allows). Running prompts through the int4 kernel too would
        give prompt and generated tokens one path, but it changes greedy
        answers (SmolLM2 no longer names Paris), so each kind keeps its own
        fixed path, and KV written by generated tokens is never shared
        (docs/determinism.md). With int8 activations every row goes
        through the 8-bit kernel (`every_row_8bit`), and with 16-bit float
        weights through theirs (`every_row_kernel`)."""
        if self.every_row_kernel:
            return self._int4(x)
        decode, prompt = x[:decode_rows], x[decode_rows:]
        parts = []
        if decode_rows:
            parts.append(self._int4(decode) if self.packed is not None else tiled_linear(decode, self.weight, self.bias))
        if prompt.shape[0]:
            n, k = self.weight.shape
            shape = (n, k, self.weight.dtype, self.bias is not None, torch.get_num_threads(), str(self.weight.device))
            joined, tail = prompt_tiles_per_call(*shape), prompt_tail_rows(*shape)
            parts.append(tiled_linear(prompt, self.weight, self.bias, PROMPT_TILE, joined, tail))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """An output head's logits: every row through the held codes (or
        16-bit weights), into float32 whatever x's dtype, each row from that
        row alone (`every_row_kernel` must hold)."""
        if not self.every_row_kernel:
            raise RuntimeError("Projection.logits needs a weight that every row takes through its kernel")
        return self._int4(x, torch.float32)

    def _int4(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        if isinstance(self.native, w16.W16Pack):
            y = native.w16_matmul(self.native, x.contiguous(), checked=False, lib=self._lib, out_dtype=out_dtype)
        elif isinstance(self.native, (int6.Int6Pack, int8w.Int8CodesPack)):
            y = self._codes_kernel(self.native, x.contiguous(), checked=False, lib=self._lib, out_dtype=out_dtype)
        elif self.native is not None and self.native.q8:
            y = native.int4_q8_matmul(self.native, x.contiguous(), checked=False, lib=self._lib, out_dtype=out_dtype)
        elif self.native is not None:
            y = native.int4_matmul(self.native, x.contiguous(), checked=False, lib=self._lib).to(out_dtype)
        elif isinstance(self.q8_twin, (Int6Parts, Int8Parts)):
            y = self._codes_twin(self.q8_twin, x).to(out_dtype)
        elif self.q8_twin is not None:
            y = reference.int4_q8_matmul(*self.q8_twin, x).to(out_dtype)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed, GROUP, self.scales_zeros)
            y = y.to(out_dtype)
        return y if self.bias is None else y + self.bias


class StackedProjection:
    """Projections side by side, one output: a fused matrix whose parts the
    file stores in different types (a Q4_K_M file's q and k in Q4_K and v in
    Q6_K), each part run its own way; a row's result is its parts' results,
    each computed from that row alone."""

    def __init__(self, parts: list[Projection]):
        self.parts = parts

    @property
    def quantized(self) -> bool:
        return any(p.quantized for p in self.parts)

    def __call__(self, x: torch.Tensor, int4_rows: int = 0) -> torch.Tensor:
        return torch.cat([p(x, int4_rows) for p in self.parts], dim=-1)

    def fixed(self, x: torch.Tensor, decode_rows: int) -> torch.Tensor:
        return torch.cat([p.fixed(x, decode_rows) for p in self.parts], dim=-1)


HEAD_SLICE_ROWS = 4096  # rows quantized at a time by Int8Rows


class Int8Rows:
    """A [N, K] weight as int8 with one scale per row (symmetric, round to
    nearest), multiplied with bf16 activations by the C kernel where it runs
    (`native.int8_matmul`), else by torch's CPU weight-only int8 kernel:
    y = x @ W.T in fp32. Both compute each row on its own.

    The output head of a float32 model on a CPU without native bf16
    (kernels/cpu.py). There a float32 head reads 113 MB a step (13.8 ms for
    one row here) and the int8 one a quarter of it (4.7 ms); the GGUF's own
    embedding is 8-bit (Q8_0) already. The kernel computes each row on its
    own: a row's logits are the same bits beside 0 or 31 other rows
    (tests/kernels/test_int4.py), so it serves the batch-invariant mode as
    it is."""

    def __init__(self, weight: torch.Tensor):
        self._build(lambda start, end: weight[start:end], *weight.shape, weight.device)

    @classmethod
    def from_rows(cls, fetch: Callable[[int, int], torch.Tensor], n: int, k: int) -> Int8Rows:
        """The 8-bit head of an [n, k] weight on the CPU whose rows [start,
        end) ``fetch(start, end)`` makes (the file's, Checkpoint.rows): no
        dense copy of the whole exists at any time."""
        head = cls.__new__(cls)
        head._build(fetch, n, k, torch.device("cpu"))
        return head

    def _build(self, fetch: Callable[[int, int], torch.Tensor], n: int, k: int, device: torch.device) -> None:
        # The kernel takes bf16 scales: round each up past bf16's rounding
        # (relative 2**-8) first, then quantize with the rounded scale, so a
        # weight is off by at most half a step and none needs clamping.
        # Row by row in slices, so a big head's float temporaries stay small;
        # where the C kernel runs, each slice goes straight into its layout
        # (whole panels of 32 rows pack alone), so the codes exist once.
        packs = device.type == "cpu" and native.int8_supported(n, k)
        codes = torch.empty(n * k if packs else (n, k), dtype=torch.int8, device=device)
        scales = []
        for start in range(0, n, HEAD_SLICE_ROWS):
            end = min(n, start + HEAD_SLICE_ROWS)
            w = fetch(start, end).float()
            scale = (w.abs().amax(dim=1).clamp_min(1e-30) / 127 * (1 + 2**-7)).to(torch.bfloat16)
            q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
            if packs:
                codes[start * k : end * k] = native_pack.pack_int8_codes(q)
            else:
                codes[start:end] = q
            scales.append(scale)
        self.scale = torch.cat(scales) if scales else torch.empty(0, dtype=torch.bfloat16)
        # The C kernel where it runs (kernels/native.py): 2-3x faster for
        # 8-32 rows, and exact products of the bf16 inputs with the codes,
        # summed in fp32 before the scale (torch's op rounds on the way).
        self.native = native_pack.Int8Pack(codes, self.scale.float().contiguous(), n, k) if packs else None
        self._q = None if packs else codes
        self._lib = native_build.library() if self.native is not None else None  # pinned (kernels/native.py `_lib`)

    @property
    def q(self) -> torch.Tensor:
        """The codes [N, K] int8 (made from the kernel's layout where it holds them)."""
        return self._q if self._q is not None else native_pack.unpack_int8_codes(self.native)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return native.int8_matmul(self.native, x, lib=self._lib)
        return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q, self.scale).float()
