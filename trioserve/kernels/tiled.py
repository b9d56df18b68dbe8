"""Matrix products in calls of fixed shape, so that a row's bits do not
depend on how many rows share its call: one call of F.linear picks its
blocking by the row count, and a row then rounds differently beside more
or fewer rows (docs/determinism.md). The batch-invariant mode runs the
dense projections (`tiled_linear`) and the output head (`tiled_head`)
this way; `prompt_tiles_per_call` and `prompt_tail_rows` check, once per
shape, which bigger calls still round every row alike, and
`float_logits_mm` whether the head's sums can be kept in float32."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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
