"""Triton twin of kernels/native.py's `decode_attention`: paged attention of
query rows over the KV block pool, decode rows and prompt rows.

Layouts (as native.py): q [R, H, D]; k_cache, v_cache [KVH, NB, BS, D]
(contiguous, q's dtype: float32, float16 or bfloat16); block_tables
[S, MB] and lengths [R] integers; row_seq [R] or None. The result is
[R, H, D] float32 on q's device.

Two paths, each giving a row the same bits whatever shares the call
(batch invariance, docs/determinism.md):

- Decode rows (``row_seq`` None; row r reads table row r): split-K. One
  program takes one (row, KV head, split) -- the query heads sharing that
  KV head as rows of one dot -- over a split of SPLIT_BLOCKS KV blocks, and
  writes the split's maximum, exp-sum and weighted values. A second kernel
  merges a row's splits one after another, split 0 first. A row's split
  count is its own length over the split size, so neither the other rows,
  their number nor the table's padded width changes what it computes;
  programs of splits past a row's length exit at once.
- Prompt rows (``row_seq`` given; row r attends to keys 0..lengths[r]-1
  of table row row_seq[r]): one program takes a tile of consecutive rows
  of one sequence at consecutive positions inside one aligned window of
  ROWS positions (`_prompt_tile`), for one KV head, and walks the keys from
  0 in chunks of PROMPT_KEYS with an online softmax up to the tile's
  longest row. A row sits at slot ``position % ROWS`` of its tile's dot,
  whichever other rows are present, so its place in every matrix product
  is its own (a BLAS under the interpreter rounds rows by place). ROWS
  divides PROMPT_KEYS, so every row of a tile runs the same chunks; keys
  past a row's length are masked to probability 0. So a row's bits do not
  depend on how its prompt was chunked or what else is in the call.

Scores and probabilities are fp32; dots take fp32 operands at IEEE
precision (no TF32) and half-precision operands with fp32 accumulation, the
probabilities rounded to the values' dtype for the second dot (as the torch
twin rounds them to q's dtype). The wrapper checks shapes, dtypes, devices
and every index against the pool before launching (one host sync), and
raises RuntimeError naming the problem; the kernels trust what they get."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# KV blocks per decode split. Part of a row's arithmetic: changing it
# changes bits (never between rows of one server).
SPLIT_BLOCKS = 4
# Keys per step of the prompt path's loop, and query rows x heads per
# prompt program (rows per tile = this over the padded group).
PROMPT_KEYS = 64
PROMPT_QUERIES = 64
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


def _split_keys(block_size: int) -> int:
    return triton.next_power_of_2(SPLIT_BLOCKS * block_size)


def _prompt_tile(group: int) -> tuple[int, int]:
    """(ROWS, the positions of a prompt tile's window; the padded group):
    their product is the program's dot height, at least 16 (the smallest
    dot Triton takes). ROWS divides PROMPT_KEYS."""
    padded = triton.next_power_of_2(group)
    rows = max(1, PROMPT_QUERIES // padded)
    assert PROMPT_KEYS % rows == 0 and rows * padded >= 16
    return rows, padded


@triton.jit
def _gather_keys(cache_ptr, table_ptr, head_off, keys, kmask, dims, dmask, BS: tl.constexpr, D: tl.constexpr):
    """[len(keys), DP] rows of one KV head's cache for key positions
    ``keys`` of one sequence (its table row at table_ptr); masked keys and
    dims read as 0. The cache is contiguous [KVH, NB, BS, D]."""
    block = tl.load(table_ptr + keys // BS, mask=kmask, other=0).to(tl.int64)
    slot = block * BS + (keys % BS).to(tl.int64)
    ptrs = cache_ptr + head_off + slot[:, None] * D + dims[None, :]
    return tl.load(ptrs, mask=kmask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr,
    heads, group, num_blocks, max_blocks, num_splits, scale_log2e,
    BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, GP: tl.constexpr, KEYS: tl.constexpr,
):  # fmt: skip
    """Program (row, KV head, split): the split's keys [split * KEYS, ...)
    below the row's length, for the row's heads kv * group .. + group - 1.
    Writes per head the split's max score m, sum of exp2(score - m) l, and
    the exp-weighted values acc, to [R, H, num_splits] (acc: [..., D])."""
    row = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    length = tl.load(lens_ptr + row)
    start = split * KEYS
    if start < length:
        dims = tl.arange(0, DP)
        dmask = dims < D
        g = tl.arange(0, GP)
        gmask = g < group
        head = kv * group + g
        q = tl.load(q_ptr + (row * heads + head)[:, None] * D + dims[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        keys = start + tl.arange(0, KEYS)
        kmask = keys < length
        head_off = kv * num_blocks * BS * D
        table = tables_ptr + row * max_blocks
        k = _gather_keys(k_ptr, table, head_off, keys, kmask, dims, dmask, BS, D)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e
        scores = tl.where(kmask[None, :], scores, float("-inf"))
        m = tl.max(scores, axis=1)
        p = tl.exp2(scores - m[:, None])
        v = _gather_keys(v_ptr, table, head_off, keys, kmask, dims, dmask, BS, D)
        acc = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        part = (row * heads + head) * num_splits + split
        tl.store(m_ptr + part, m, mask=gmask)
        tl.store(l_ptr + part, tl.sum(p, axis=1), mask=gmask)
        tl.store(acc_ptr + part[:, None] * D + dims[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _decode_merge_kernel(
    m_ptr, l_ptr, acc_ptr, lens_ptr, out_ptr, heads, group, num_splits,
    D: tl.constexpr, DP: tl.constexpr, GP: tl.constexpr, KEYS: tl.constexpr,
):  # fmt: skip
    """Program (row, KV head): the row's splits merged in order 0, 1, ...
    (as many as its own length makes), then out = acc / l, fp32."""
    row = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1).to(tl.int64)
    length = tl.load(lens_ptr + row)
    dims = tl.arange(0, DP)
    dmask = dims < D
    g = tl.arange(0, GP)
    gmask = g < group
    head = kv * group + g
    base = (row * heads + head) * num_splits
    m_run = tl.full([GP], float("-inf"), tl.float32)
    l_run = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for split in range(0, tl.cdiv(length, KEYS)):
        m = tl.load(m_ptr + base + split, mask=gmask, other=0.0)
        m_new = tl.maximum(m_run, m)
        old = tl.exp2(m_run - m_new)
        new = tl.exp2(m - m_new)
        l_run = l_run * old + tl.load(l_ptr + base + split, mask=gmask, other=1.0) * new
        part = tl.load(acc_ptr + (base + split)[:, None] * D + dims[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        acc = acc * old[:, None] + part * new[:, None]
        m_run = m_new
    out = acc / l_run[:, None]
    tl.store(out_ptr + (row * heads + head)[:, None] * D + dims[None, :], out, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _prompt_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, seq_ptr, tile_first_ptr, tile_rows_ptr, out_ptr,
    heads, group, num_blocks, max_blocks, scale_log2e,
    BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
):  # fmt: skip
    """Program (tile, KV head): ``count`` consecutive query rows of one
    sequence from row ``first``, at consecutive positions in one window of
    ROWS, each with the group's heads, as ROWS * GP rows of the dots: dot
    row slot * GP + j is the row at position slot (mod ROWS), head
    kv * group + j. Keys from 0 in chunks of KEYS, an online softmax;
    out [R, H, D] fp32."""
    tile = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    first = tl.load(tile_first_ptr + tile)
    count = tl.load(tile_rows_ptr + tile)
    first_slot = (tl.load(lens_ptr + first) - 1) % ROWS
    i = tl.arange(0, ROWS * GP)
    slot = i // GP
    rmask = (slot >= first_slot) & (slot < first_slot + count)
    g = i % GP
    qmask = rmask & (g < group)
    rows = first + (slot - first_slot).to(tl.int64)
    head = kv * group + g
    dims = tl.arange(0, DP)
    dmask = dims < D
    lens = tl.load(lens_ptr + rows, mask=rmask, other=1)
    longest = tl.max(lens, axis=0)
    seq = tl.load(seq_ptr + first)
    table = tables_ptr + seq * max_blocks
    head_off = kv * num_blocks * BS * D
    q = tl.load(q_ptr + (rows * heads + head)[:, None] * D + dims[None, :], mask=qmask[:, None] & dmask[None, :], other=0.0)
    m_run = tl.full([ROWS * GP], float("-inf"), tl.float32)
    l_run = tl.zeros([ROWS * GP], tl.float32)
    acc = tl.zeros([ROWS * GP, DP], tl.float32)
    for start in range(0, longest, KEYS):
        keys = start + tl.arange(0, KEYS)
        kmask = keys < longest
        k = _gather_keys(k_ptr, table, head_off, keys, kmask, dims, dmask, BS, D)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e
        scores = tl.where(keys[None, :] < lens[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(scores, axis=1))
        old = tl.exp2(m_run - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_run = l_run * old + tl.sum(p, axis=1)
        v = _gather_keys(v_ptr, table, head_off, keys, kmask, dims, dmask, BS, D)
        acc = acc * old[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_run = m_new
    out = acc / l_run[:, None]
    tl.store(out_ptr + (rows * heads + head)[:, None] * D + dims[None, :], out, mask=qmask[:, None] & dmask[None, :])


def _check_shapes(q, k_cache, v_cache, block_tables, lengths, row_seq) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise RuntimeError(
            f"decode_attention takes q [R, H, D] and caches [KVH, NB, BS, D] alike, "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    if k_cache.shape[3] != dim or dim < 1 or dim > MAX_HEAD_DIM or kv_heads < 1 or heads % kv_heads:
        raise RuntimeError(
            f"decode_attention does not take head dim {dim} with {heads} heads over {kv_heads} KV heads "
            f"of dim {k_cache.shape[3]} (heads must be a multiple of KV heads, dims alike, at most {MAX_HEAD_DIM})"
        )
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise RuntimeError(f"decode_attention takes float32, float16 or bfloat16 alike, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise RuntimeError("decode_attention takes contiguous K and V caches")
    ints = [block_tables, lengths] + ([] if row_seq is None else [row_seq])
    if any(t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool for t in ints):
        raise RuntimeError("decode_attention takes integer block tables, lengths and row_seq")
    if block_tables.dim() != 2:
        raise RuntimeError(f"decode_attention takes block tables [S, MB], got {tuple(block_tables.shape)}")
    if lengths.shape != (rows,) or (row_seq is not None and row_seq.shape != (rows,)):
        raise RuntimeError(f"decode_attention: {rows} query rows need {rows} lengths (and table rows), got {tuple(lengths.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, *ints)}
    if len(devices) != 1:
        raise RuntimeError(f"decode_attention takes tensors on one device, got {sorted(map(str, devices))}")


def _check_ranges(lens, seq, tables, num_blocks: int, block_size: int, decode: bool, extra=None):
    """Every row's length within its table and its blocks within the pool,
    checked on the tensors' device; ``extra`` (a bool vector) rides along on
    the one transfer to the host and is returned there."""
    rows = lens.shape[0]
    num_tables, max_blocks = tables.shape
    bad_len = (lens < 1) | (lens > max_blocks * block_size)
    bad_seq = (seq < 0) | (seq >= num_tables)
    table = tables[seq.clamp(0, max(num_tables - 1, 0))] if num_tables else tables.new_zeros(rows, max_blocks)
    used = torch.arange(max_blocks, device=lens.device)[None, :] * block_size < lens[:, None]
    bad_block = (((table < 0) | (table >= num_blocks)) & used).any(dim=1)
    flags = torch.stack([bad_len, bad_seq, bad_block]).any(dim=1)
    host = torch.cat([flags, extra if extra is not None else flags[:0]]).cpu()
    if host[:3].any():
        name = "row" if decode else "prompt row"
        if host[0]:
            r = int(bad_len.nonzero()[0])
            raise RuntimeError(
                f"decode_attention: {name} {r} has length {int(lens[r])}, outside 1..{max_blocks * block_size} "
                f"(its table's {max_blocks} blocks of {block_size})"
            )
        if host[1]:
            r = int(bad_seq.nonzero()[0])
            what = f"table row {r}" if decode else f"table row {int(seq[r])}"
            raise RuntimeError(f"decode_attention: {name} {r} reads {what}, but the block tables have {num_tables} rows")
        r = int(bad_block.nonzero()[0])
        b = int((((table[r] < 0) | (table[r] >= num_blocks)) & used[r]).nonzero()[0])
        raise RuntimeError(
            f"decode_attention: {name} {r} reads block id {int(table[r, b])} (its block {b}), "
            f"outside the pool of {num_blocks} blocks"
        )
    return host[3:]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query rows to their first ``lengths[r]`` cached keys,
    read through ``block_tables`` where they lie: row r reads table row r
    (decode rows, split-K), or table row ``row_seq[r]`` when given (prompt
    rows, tiles of one sequence's rows). Shapes in the module docstring.
    Returns a new [R, H, D] float32 tensor on q's device; a row's bits
    depend only on its own query, keys and values. Raises RuntimeError for
    shapes, dtypes or devices it does not take, and for a length beyond
    its table or a block id outside the pool (checked before launching)."""
    _check_shapes(q, k_cache, v_cache, block_tables, lengths, row_seq)
    rows, heads, dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty(rows, heads, dim, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = lengths.to(torch.int64).contiguous()
    max_blocks = tables.shape[1]
    padded_dim = max(16, triton.next_power_of_2(dim))
    scale_log2e = float(scale) * LOG2E
    if row_seq is None:
        seq = torch.arange(rows, device=q.device)
        _check_ranges(lens, seq, tables, num_blocks, block_size, decode=True)
        keys = _split_keys(block_size)
        num_splits = max(1, math.ceil(max_blocks * block_size / keys))
        padded_group = max(16, triton.next_power_of_2(group))
        m = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)  # noqa: E741
        acc = torch.empty(rows, heads, num_splits, dim, dtype=torch.float32, device=q.device)
        meta = dict(D=dim, DP=padded_dim, GP=padded_group, KEYS=keys, num_warps=4)
        _decode_split_kernel[(rows, kv_heads, num_splits)](
            q, k_cache, v_cache, tables, lens, m, l, acc,
            heads, group, num_blocks, max_blocks, num_splits, scale_log2e, BS=block_size, **meta,
        )  # fmt: skip
        _decode_merge_kernel[(rows, kv_heads)](m, l, acc, lens, out, heads, group, num_splits, **meta)
        return out
    seq = row_seq.to(torch.int64).contiguous()
    tile_rows, padded_group = _prompt_tile(group)
    # A tile starts where the sequence changes, where positions stop running
    # on, and at every window of tile_rows positions.
    position = lens - 1
    starts_tile = torch.ones(rows, dtype=torch.bool, device=q.device)
    starts_tile[1:] = (seq[1:] != seq[:-1]) | (position[1:] != position[:-1] + 1) | (position[1:] % tile_rows == 0)
    starts_tile = _check_ranges(lens, seq, tables, num_blocks, block_size, decode=False, extra=starts_tile)
    first = starts_tile.nonzero().flatten()
    bounds = torch.cat([first, torch.tensor([rows])])
    tile_first = first.to(q.device)
    tile_count = (bounds[1:] - bounds[:-1]).to(q.device)
    _prompt_kernel[(first.shape[0], kv_heads)](
        q, k_cache, v_cache, tables, lens, seq, tile_first, tile_count, out,
        heads, group, num_blocks, max_blocks, scale_log2e,
        BS=block_size, D=dim, DP=padded_dim, GP=padded_group, ROWS=tile_rows, KEYS=PROMPT_KEYS, num_warps=4,
    )  # fmt: skip
    return out
