"""4-bit weights kept as 4-bit: GGUF Q4_0/Q4_1 blocks mapped onto torch's CPU
int4 matmul without requantizing.

torch's format stores, per group of 32 inputs, a bf16 scale and zero with
    w = (q - 8) * scale + zero,   q in 0..15.
Q4_1 stores w = q * d + m, so scale = d and zero = m + 8d; Q4_0 stores
w = (q - 8) * d, so zero = 0. The only loss is rounding d and m from f16 to
bf16, the same order as rounding the dequantized weights to bf16.

A decode step is bound by reading weights, and 4-bit weights are a quarter
of bf16's bytes, so generated (decode) tokens use them; prompt tokens, many
at a time, use the bf16 copy, which is faster for many rows. The choice
depends only on what a token is, never on what else shares its step. In
the default batch-invariant mode the bf16 rows go in fixed-size tiles
(`Projection.fixed`, docs/determinism.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from trioserve.kernels import int6, int8w, native, reference, w16
from trioserve.kernels.int6 import Int6Parts, Int6Rows
from trioserve.kernels.int8w import Int8Parts, Q8Rows
from trioserve.kernels.layout import BlockRows

# The codes that run only with int8 activations: their type -> (whether the C
# kernel takes the shape, its packing, the C kernel, the torch twin).
_CODES_Q8 = {
    Int6Parts: (native.int6_q8_supported, int6.pack_int6_q8, native.int6_q8_matmul, int6.int6_q8_matmul),
    Int6Rows: (native.int6_q8_supported, int6.pack_int6_q8, native.int6_q8_matmul, int6.int6_q8_matmul),
    Int8Parts: (native.int8_q8_supported, int8w.pack_int8_q8, native.int8_q8_matmul, int8w.int8_q8_matmul),
    Q8Rows: (native.int8_q8_supported, int8w.pack_int8_q8, native.int8_q8_matmul, int8w.int8_q8_matmul),
}

GROUP = 32


@attrs.frozen
class Int4Parts:
    """Unpacked 4-bit weight: q [N, K] uint8 in 0..15; scale, zero [N, K/32] fp32."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def take_rows(self, order: np.ndarray) -> Int4Parts:
        index = torch.from_numpy(np.ascontiguousarray(order))
        return Int4Parts(self.q[index], self.scale[index], self.zero[index])

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = (self.q.float().view(n, k // GROUP, GROUP) - 8) * self.scale[..., None] + self.zero[..., None]
        return w.view(n, k)


# The GGUF types whose codes are 4 bits in groups of 32, and so run on the 4-bit kernels.
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
Q4_K_BLOCK_BYTES = 144  # f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles


def parts_from_gguf(raw: np.ndarray, qtype_name: str) -> Int4Parts:
    """Split raw GGUF rows ([N, blocks * bytes_per_block] uint8) of a Q4_0,
    Q4_1 or Q4_K tensor into 4-bit codes and per-group scale and zero."""
    if qtype_name == "Q4_K":
        return _parts_from_q4_k(np.asarray(raw))
    rows = raw.shape[0]
    header = {"Q4_0": 2, "Q4_1": 4}[qtype_name]
    blocks = np.asarray(raw).reshape(rows, -1, header + GROUP // 2)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype_name == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    # Low nibbles are a block's first 16 values, high nibbles the last 16.
    q = native.unpack_nibbles(raw, header + GROUP // 2, header, GROUP // 2)
    if q is None:
        packed = blocks[:, :, header:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return Int4Parts(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


def _parts_from_q4_k(raw: np.ndarray) -> Int4Parts:
    """Q4_K rows as groups of 32: each super-block of 256 weights holds f16
    d and dmin, and for each of its 8 groups a 6-bit scale s and min m, so
    w = d s q - dmin m. A group's scale d s and offset -dmin m are rounded
    to f16 here (what the 4-bit kernels take: each is off by at most 2^-11
    of itself, far inside the 4-bit codes' own error); the codes are the
    file's. Group j's codes are the low nibbles of the super-block's bytes
    32 (j // 2) .. 32 (j // 2) + 31 for even j, the high ones for odd j."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q4_K_BLOCK_BYTES)
    made = native.q4_k_scales(raw)  # the C library's, in one pass; else numpy's
    if made is not None:
        group_d, zero = made
    else:
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        sc = blocks[..., 4:16].astype(np.int32)  # [rows, supers, 12]
        # Groups 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups
        # 4-7: the low nibble (scale) and high nibble (min) of bytes 8-11, over
        # the top 2 bits of bytes 0-3 (scale) and 4-7 (min).
        scale = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], axis=-1)
        mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1)
        group_d = (d[..., None] * scale).astype(np.float16).astype(np.float32)  # [rows, supers, 8]
        group_m = (-dmin[..., None] * mins).astype(np.float16).astype(np.float32)
        zero = group_m + 8 * group_d
    q = native.unpack_nibbles(raw, Q4_K_BLOCK_BYTES, 16, 32)  # the C library's, in one pass; else numpy's
    if q is None:
        packed = blocks[..., 16:].reshape(rows, -1, 4, 32)  # [rows, supers, chunk, byte]
        q = np.empty((*packed.shape[:3], 2, 32), dtype=np.uint8)  # chunk, (low, high), byte
        np.bitwise_and(packed, 0x0F, out=q[:, :, :, 0])
        np.right_shift(packed, 4, out=q[:, :, :, 1])
        q = q.reshape(rows, -1)
    return Int4Parts(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(group_d.reshape(rows, -1)), torch.from_numpy(zero.reshape(rows, -1)))


class Int4Rows(BlockRows):
    """A 4-bit weight still in its GGUF blocks (`layout.BlockRows`): laid
    out for the int8-activation kernel straight from them
    (`native.pack_int4_q8_rows`; for an 8B model, unpacking the codes one a
    byte, grouping them and joining the fused projections' parts had been
    most of the build); read as `Int4Parts` (``q``, ``scale``, ``zero``,
    unpacked once when first asked for: the same values) everywhere else."""

    TYPES = {"Q4_0": (18, GROUP), "Q4_1": (20, GROUP), "Q4_K": (Q4_K_BLOCK_BYTES, 256)}
    _unpack = staticmethod(lambda raw, qtype: parts_from_gguf(raw, qtype))
    _cat = staticmethod(lambda parts: _cat_parts(parts))
    q = property(lambda self: self.parts().q)
    scale = property(lambda self: self.parts().scale)
    zero = property(lambda self: self.parts().zero)


def _cat_parts(parts: list[Int4Parts]) -> Int4Parts:
    return Int4Parts(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts]))


def concat_rows(parts: list[Int4Parts | Int4Rows]) -> Int4Parts | Int4Rows:
    """One weight of ``parts``' rows, one after the other (`BlockRows.concat`)."""
    return Int4Rows.concat(parts)


# Rows per call of `tiled_linear` in batch-invariant mode: generated tokens
# (few per step) and the output head use small tiles, which cost a 1-row
# call's time (both read the whole weight); prompt tokens use large ones,
# which keep prefill near one call's speed (docs/determinism.md).
ROW_TILE = 16
PROMPT_TILE = 128


def tiled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: int = ROW_TILE,
    tiles_per_call: int = 1,
    tail: int | None = None,
) -> torch.Tensor:
    """F.linear whose every row gets the same arithmetic whatever the other
    rows: the rows are padded to a multiple of ``tile`` and multiplied
    ``tile`` at a time. One call of F.linear picks its blocking by the row
    count, and a row then rounds differently beside more or fewer rows
    (docs/determinism.md); a call of fixed shape always runs the same
    kernel, and a row's place inside the tile was measured not to matter.
    ``tiles_per_call`` > 1 joins up to that many tiles in one call, and
    ``tail`` < ``tile`` pads the last, partial tile only to a multiple of
    ``tail`` rows, for callers that checked those calls round every row as
    single tiles do (`prompt_tiles_per_call`, `prompt_tail_rows`)."""
    rows = x.shape[0]
    if rows == 0:
        return F.linear(x, weight, bias)
    whole = rows // tile * tile  # rows in whole tiles
    rest = -(-(rows - whole) // (tail or tile)) * (tail or tile)  # the last tile's rows, padded
    if rest == tile:
        whole, rest = whole + tile, 0
    if whole + rest != rows:
        x = torch.cat([x, x.new_zeros(whole + rest - rows, x.shape[1])])
    step = tile * max(1, tiles_per_call)
    calls = [(s, min(s + step, whole)) for s in range(0, whole, step)]
    if rest:
        calls.append((whole, whole + rest))
    if len(calls) == 1:
        return F.linear(x, weight, bias)[:rows]
    return torch.cat([F.linear(x[a:b], weight, bias) for a, b in calls])[:rows]


# Most PROMPT_TILE tiles `prompt_tiles_per_call` tries to join in one call.
MOST_TILES_PER_CALL = 4


@functools.cache
def prompt_tiles_per_call(n: int, k: int, dtype: torch.dtype, with_bias: bool, threads: int, device: str = "cpu") -> int:
    """How many PROMPT_TILE-row tiles one F.linear call of an [n, k] weight
    may take and still round every row as single-tile calls do, on this
    machine's ``device`` (a GPU's matmuls are checked on the GPU) with this
    many threads: 1 to MOST_TILES_PER_CALL, checked once on random values (a call of 2, 3 or 4 tiles against the tiles one at a
    time, every output compared). On torch 2.13's CPU kernels with bf16 all
    of 128-640 rows agree for SmolLM2's four shapes, and one call of 512
    rows is ~20% faster than four of 128 (bench/README.md); where they do
    not agree, tiles stay single."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
    bias = (torch.randn(n, generator=gen) * 0.05).to(device, dtype) if with_bias else None
    x = torch.randn(MOST_TILES_PER_CALL * PROMPT_TILE, k, generator=gen).to(device, dtype)
    single = torch.cat([F.linear(x[s : s + PROMPT_TILE], weight, bias) for s in range(0, x.shape[0], PROMPT_TILE)])
    agreed = 1
    for count in range(2, MOST_TILES_PER_CALL + 1):
        rows = count * PROMPT_TILE
        if not torch.equal(F.linear(x[:rows], weight, bias), single[:rows]):
            break
        agreed = count
    return agreed


@functools.cache
def prompt_tail_rows(n: int, k: int, dtype: torch.dtype, with_bias: bool, threads: int, device: str = "cpu") -> int:
    """The row multiple a step's last, partial tile of prompt rows is
    padded to: ROW_TILE where one F.linear call of 16, 32, ..., 112 rows
    of an [n, k] weight rounds every row as a PROMPT_TILE-row call does,
    else PROMPT_TILE. Checked once per shape, dtype, thread count and
    device, like `prompt_tiles_per_call`: every output of each call against
    a 128-row call, on random values. With torch 2.13 on this machine kind
    every row count of 2-640 agrees (bf16 and fp32, SmolLM2's four shapes),
    so a 107-token prompt is computed as 112 rows, not 128, and a 20-token
    turn after a cached prefix as 32 (bench/README.md, "The fourth
    round")."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
    bias = (torch.randn(n, generator=gen) * 0.05).to(device, dtype) if with_bias else None
    x = torch.randn(PROMPT_TILE, k, generator=gen).to(device, dtype)
    single = F.linear(x, weight, bias)
    for rows in range(ROW_TILE, PROMPT_TILE, ROW_TILE):
        if not torch.equal(F.linear(x[:rows], weight, bias), single[:rows]):
            return PROMPT_TILE
    return ROW_TILE


def tiled_head(x: torch.Tensor, weight: torch.Tensor, tile: int = ROW_TILE, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T`` for a wide output head ([vocab, hidden] weight), as
    ``weight @ x.T`` in fixed ``tile``-column calls: the same fixed-shape
    rule as `tiled_linear`, in the orientation that is cheaper for few rows
    (16 columns cost 4.4 ms here against 5.7 ms for 16 rows, and 2.3 times
    a single row's 1.9 ms rather than 3 times; bench/README.md).

    ``out_dtype`` (float32 from bf16 weights, where the device offers it:
    `float_logits_mm`) keeps the product's float32 sums instead of rounding
    them to the weights' dtype."""
    rows = x.shape[0]
    padded = -(-rows // tile) * tile
    cols = torch.zeros(x.shape[1], padded, dtype=x.dtype, device=x.device)
    cols[:, :rows] = x.t()

    def mm(c: torch.Tensor) -> torch.Tensor:
        return torch.mm(weight, c) if out_dtype is None else torch.mm(weight, c, out_dtype=out_dtype)

    if padded == tile:
        return mm(cols)[:, :rows].t()
    out = torch.cat([mm(cols[:, s : s + tile].contiguous()) for s in range(0, padded, tile)], dim=1)
    return out[:, :rows].t()


def float_logits_mm(weight: torch.Tensor) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` runs for this 16-bit
    weight's device (CUDA has it; torch's CPU backend does not). A 16-bit
    head whose logits are rounded to bf16 has steps of 0.125 at logit 16-32,
    so two tokens often tie exactly; float32 logits do not (docs/kernels.md,
    "The GPU check")."""
    if weight.dtype not in (torch.bfloat16, torch.float16) or weight.device.type == "meta":
        return False
    probe = torch.ones(2, 2, dtype=weight.dtype, device=weight.device)
    try:
        return torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (NotImplementedError, RuntimeError, TypeError):
        return False


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
        self._lib = native.library() if use_native and weight.device.type == "cpu" else None
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
            # int8 activations only (LlamaModel passes them then).
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
                self.native = native.pack_int4_q8_rows(int4) if isinstance(int4, Int4Rows) else native.pack_int4_q8(int4)
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
            self.native = native.pack_int4(int4)
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
                codes[start * k : end * k] = native.pack_int8_codes(q)
            else:
                codes[start:end] = q
            scales.append(scale)
        self.scale = torch.cat(scales) if scales else torch.empty(0, dtype=torch.bfloat16)
        # The C kernel where it runs (kernels/native.py): 2-3x faster for
        # 8-32 rows, and exact products of the bf16 inputs with the codes,
        # summed in fp32 before the scale (torch's op rounds on the way).
        self.native = native.Int8Pack(codes, self.scale.float().contiguous(), n, k) if packs else None
        self._q = None if packs else codes
        self._lib = native.library() if self.native is not None else None  # pinned (kernels/native.py `_lib`)

    @property
    def q(self) -> torch.Tensor:
        """The codes [N, K] int8 (made from the kernel's layout where it holds them)."""
        return self._q if self._q is not None else native.unpack_int8_codes(self.native)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return native.int8_matmul(self.native, x, lib=self._lib)
        return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q, self.scale).float()
