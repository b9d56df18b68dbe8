"""The C decode-attention kernel (kernels/native.py) against its torch twin
(kernels/reference.paged_attention) on odd shapes, its batch invariance,
its refusals, and the fallback when it cannot be built; the norms, RoPE
with the K/V store and SiLU against theirs.

The kernel-against-twin tests run at every instruction-set level this CPU
executes (tests/kernels/levels.py): an AVX-512 machine builds and checks
the AVX2 and plain C kernels as well as its own, and skips, saying why, a
level it lacks."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from tests.kernels.rope_case import BLOCK_SIZE, MAX_POS, rope_case
from tests.kernels.levels import at_levels, use_level
from trioserve.kernels import native, native_build, reference
from trioserve.models.step import SeqChunk, build_step

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _kernels_built(request) -> None:
    """Every test here runs the C kernels, except those marked as testing
    what happens without them: where no C compiler works (or
    TRIOSERVE_NATIVE_KERNELS=0) they skip, saying so."""
    if request.node.get_closest_marker("without_kernels") is None and native_build.library() is None:
        pytest.skip("no C kernels here: no working C compiler ($CC), or TRIOSERVE_NATIVE_KERNELS=0")  # the twin rounds scores and probabilities to bf16


@pytest.fixture
def level(request, monkeypatch) -> str:
    """The C kernels of the level `at_levels` gives, or a skip saying why this CPU cannot run it."""
    use_level(request.param, monkeypatch)
    return request.param


def _case(gen, *, seqs, heads, kv_heads, dim, block_size, dtype, extra=0):
    """A pool, a decode step of ``seqs`` sequences with ragged lengths (not
    multiples of the block size, one of a single key) and scattered blocks."""
    lengths = [1 + (17 * s + 5 + extra) % (5 * block_size) for s in range(seqs)]
    lengths[0] = 1
    if seqs > 1:
        lengths[1] = 3 * block_size  # exactly full blocks
    num_blocks = sum(-(-n // block_size) for n in lengths) + 7
    order = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, used = [], 0
    for n in lengths:
        nb = -(-n // block_size)
        chunks.append(SeqChunk([1], n - 1, order[used : used + nb], decode=True))
        used += nb
    k = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    return q, k, v, chunks


# (dtype, seqs, heads, kv_heads, dim, block_size): each head layout and
# head size at 1, 3, 7 and 33 sequences in both dtypes; 129 (an odd count
# split over threads) on few: the bf16 twin's cost grows with sequences
# times KV heads, and takes seconds there on a CPU without native bf16, so
# its 129-sequence case has one KV head (eight queries on it).
DECODE_CASES = [
    *(
        (dtype, seqs, h, kvh, d, bs)
        for d, bs in ((64, 16), (128, 32))
        for h, kvh in ((4, 4), (9, 3), (8, 2))
        for seqs in (1, 3, 7, 33)
        for dtype in (torch.float32, torch.bfloat16)
    ),
    (torch.float32, 129, 9, 3, 64, 16),
    (torch.float32, 129, 8, 2, 128, 32),
    (torch.float32, 129, 8, 1, 64, 16),
    (torch.bfloat16, 129, 8, 1, 64, 16),
]


@functools.lru_cache(maxsize=2)
def _decode_twin(dtype, seqs, heads, kv_heads, dim, block_size):
    """A decode case and the twin's answer to it, made once for all levels
    (the twin does not depend on the level)."""
    gen = torch.Generator().manual_seed(seqs * 1000 + heads * 10 + dim)
    q, k, v, chunks = _case(gen, seqs=seqs, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, dtype=dtype)
    g = build_step(chunks, block_size).groups[0]
    want = reference.paged_attention(q, k, v, g.block_tables, g.pad_index, g.mask, dim**-0.5).float()
    return q, k, v, g, want


@at_levels()
@pytest.mark.parametrize(("dtype", "seqs", "heads", "kv_heads", "dim", "block_size"), DECODE_CASES, ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_matches_the_torch_twin(level, dtype, seqs, heads, kv_heads, dim, block_size):
    q, k, v, g, want = _decode_twin(dtype, seqs, heads, kv_heads, dim, block_size)
    assert g.decode
    got = native.decode_attention(q, k, v, g.block_tables, g.lengths, dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == (seqs, heads, dim)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@at_levels()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_is_the_same_bits_in_any_company_padding_or_thread_split(level, dtype):
    gen = torch.Generator().manual_seed(7)
    q, k, v, chunks = _case(gen, seqs=32, heads=9, kv_heads=3, dim=64, block_size=16, dtype=dtype, extra=200)
    crowd = build_step(chunks, 16, fixed=True).groups[0]  # tables padded to whole KV tiles
    together = native.decode_attention(q, k, v, crowd.block_tables, crowd.lengths, 0.125, threads=2)
    single = native.decode_attention(q, k, v, crowd.block_tables, crowd.lengths, 0.125, threads=1)
    assert torch.equal(together, single)
    for s in (0, 1, 5, 31):
        alone = build_step([chunks[s]], 16, buckets=False).groups[0]  # unpadded table
        out = native.decode_attention(q[s : s + 1], k, v, alone.block_tables, alone.lengths, 0.125)
        assert torch.equal(out[0], together[s]), s
    # A few others, in another order.
    picked = [9, 2, 30]
    some = build_step([chunks[s] for s in picked], 16).groups[0]
    out = native.decode_attention(q[picked], k, v, some.block_tables, some.lengths, 0.125)
    assert torch.equal(out, together[picked])


def scattered_prompt_chunks(gen, specs, block_size: int, spare: int) -> tuple[list[SeqChunk], int]:
    """Prompt chunks of (start, tokens) ``specs`` over blocks taken in a
    random order from a pool with ``spare`` blocks more than they need:
    (the chunks, the pool's size)."""
    num_blocks = sum(-(-(start + n) // block_size) for start, n in specs) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, used = [], 0
    for start, n in specs:
        nb = -(-(start + n) // block_size)
        chunks.append(SeqChunk(list(range(1, n + 1)), start, order[used : used + nb]))
        used += nb
    return chunks, num_blocks


def _laid_out(keys, values, block_size, gen):
    """Each sequence's keys and values [KVH, n, D] placed in a pool of
    ``block_size`` blocks, scattered; returns (k, v, decode chunks)."""
    kv_heads, dim = keys[0].shape[0], keys[0].shape[2]
    need = [-(-kk.shape[1] // block_size) for kk in keys]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k = torch.zeros(kv_heads, num_blocks, block_size, dim, dtype=keys[0].dtype)
    v = torch.zeros_like(k)
    chunks, used = [], 0
    for kk, vv, nb in zip(keys, values, need):
        table = order[used : used + nb]
        used += nb
        for t in range(kk.shape[1]):
            k[:, table[t // block_size], t % block_size] = kk[:, t]
            v[:, table[t // block_size], t % block_size] = vv[:, t]
        chunks.append(SeqChunk([1], kk.shape[1] - 1, table, decode=True))
    return k, v, chunks


@functools.lru_cache(maxsize=1)
def _block_size_layouts(dtype):
    """The same keys and values laid out in blocks of 16, 8, 24 and 5, with
    the twin's answer for each: {block size: (k, v, group, want)}, and the
    queries; made once for all levels."""
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 16, 23, 64, 97, 130]
    keys = [torch.randn(3, n, 64, generator=gen).to(dtype) for n in lengths]
    values = [torch.randn(3, n, 64, generator=gen).to(dtype) for n in lengths]
    q = torch.randn(len(lengths), 9, 64, generator=gen).to(dtype)
    layouts = {}
    for bs in (16, 8, 24, 5):
        k, v, chunks = _laid_out(keys, values, bs, gen)
        g = build_step(chunks, bs, buckets=False).groups[0]
        layouts[bs] = k, v, g, reference.paged_attention(q, k, v, g.block_tables, g.pad_index, g.mask, 0.125).float()
    return q, layouts


@at_levels()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_is_the_same_bits_whatever_the_block_size(level, dtype):
    """Where a sequence's keys lie is addressing only: the same keys in
    blocks of 16, 8, 24 or 5 (blocks that a group of 16 keys crosses) give
    the same bits, and the twin's answer."""
    q, layouts = _block_size_layouts(dtype)
    results = {}
    for bs, (k, v, g, want) in layouts.items():
        results[bs] = native.decode_attention(q, k, v, g.block_tables, g.lengths, 0.125)
        torch.testing.assert_close(results[bs], want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    for bs in (8, 24, 5):
        assert torch.equal(results[bs], results[16]), bs


# Prompt chunks as (start, tokens) for a block size: three chunks (one from
# position 0, one after a cached prefix, as a prefix-cache hit, one of a
# single token), or a long one after a prefix beside a short one from 0.
PROMPTS = {
    "37-21-1": lambda bs: [(0, 37), (2 * bs + 3, 21), (50, 1)],
    "129-7": lambda bs: [(bs + 5, 129), (0, 7)],
}


def _prompt_case(gen, *, heads, kv_heads, dim, block_size, dtype, prompt="37-21-1"):
    """The chunks of ``PROMPTS[prompt]`` over scattered blocks, with random
    queries, keys and values."""
    specs = PROMPTS[prompt](block_size)
    chunks, num_blocks = scattered_prompt_chunks(gen, specs, block_size, spare=5)
    rows = sum(n for _, n in specs)
    k = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    return q, k, v, chunks


@functools.lru_cache(maxsize=1)
def _prompt_twin(prompt, dtype, heads, kv_heads, dim, block_size):
    """A prompt case, its step's group and the twin's answer, made once for all levels."""
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    q, k, v, chunks = _prompt_case(gen, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, dtype=dtype, prompt=prompt)
    g = build_step(chunks, block_size, buckets=False).groups[0]
    return q, k, v, chunks, g, reference.paged_attention(q, k, v, g.block_tables, g.pad_index, g.mask, dim**-0.5).float()


@at_levels()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (4, 4, 64, 32), (8, 2, 128, 16)])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_prompt_rows_match_the_torch_twin_and_each_row_is_its_own(level, prompt, dtype, heads, kv_heads, dim, block_size):
    """Prompt chunks read row by row (row_seq): the torch twin's causal
    attention over a cached prefix; and a row's bits do not depend on how
    its prompt was chunked or what else is in the call."""
    q, k, v, chunks, g, want = _prompt_twin(prompt, dtype, heads, kv_heads, dim, block_size)
    specs = PROMPTS[prompt](block_size)
    assert not g.decode and g.row_seq.tolist() == [i for i, (_, n) in enumerate(specs) for _ in range(n)]
    assert g.row_lengths.tolist() == [start + t + 1 for start, n in specs for t in range(n)]
    scale = dim**-0.5
    got = native.decode_attention(q, k, v, g.block_tables, g.row_lengths, scale, row_seq=g.row_seq)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # The first chunk cut in two (the second part after the first's KV), and alone.
    first, (start, n) = chunks[0], specs[0]
    cut = 13  # mid-block at block sizes 16 and 32, and inside either prompt's first chunk
    head = SeqChunk(first.token_ids[:cut], start, first.block_table)
    tail = SeqChunk(first.token_ids[cut:], start + cut, first.block_table)
    for part, rows in ((head, slice(0, cut)), (tail, slice(cut, n))):
        alone = build_step([part], block_size, buckets=False).groups[0]
        out = native.decode_attention(q[rows], k, v, alone.block_tables, alone.row_lengths, scale, row_seq=alone.row_seq)
        assert torch.equal(out, got[rows])
    assert torch.equal(got, native.decode_attention(q, k, v, g.block_tables, g.row_lengths, scale, row_seq=g.row_seq, threads=1))


def test_refuses_reads_outside_the_pool_and_shapes_it_does_not_take():
    gen = torch.Generator().manual_seed(3)
    q, k, v, chunks = _case(gen, seqs=2, heads=4, kv_heads=2, dim=64, block_size=16, dtype=torch.float32)
    g = build_step(chunks, 16, buckets=False).groups[0]
    too_long = g.lengths.clone()
    too_long[1] = g.block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="outside the block tables or the pool"):
        native.decode_attention(q, k, v, g.block_tables, too_long, 0.125)
    bad_block = g.block_tables.clone()
    bad_block[0, 0] = k.shape[1]
    with pytest.raises(RuntimeError, match="outside the block tables or the pool"):
        native.decode_attention(q, k, v, bad_block, g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="take bfloat16 or float32 alike"):
        native.decode_attention(q.half(), k.half(), v.half(), g.block_tables, g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="a length, table row or block id is outside"):
        native.decode_attention(q, k, v, g.block_tables, g.lengths, 0.125, row_seq=torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="2 query rows need 2 lengths"):
        native.decode_attention(q, k, v, g.block_tables, g.lengths[:1], 0.125)
    assert not native.supports(4, 2, 72) and not native.supports(34, 2, 64) and native.supports(9, 3, 64)
    odd = torch.randn(2, 4, 72)
    with pytest.raises(RuntimeError, match="head dim 72"):
        native.decode_attention(odd, torch.randn(2, 8, 16, 72), torch.randn(2, 8, 16, 72), g.block_tables, g.lengths, 0.1)


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """library() rebuilt for one test in an empty cache, then as it was."""
    monkeypatch.setenv("TRIOSERVE_CACHE_DIR", str(tmp_path))
    native_build.library_at.cache_clear()
    yield
    native_build.library_at.cache_clear()


@pytest.mark.without_kernels
def test_disabled_or_unbuildable_falls_back_with_a_warning(fresh_library, monkeypatch, caplog):
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    assert native_build.library() is None
    with pytest.raises(RuntimeError, match="not available"):
        native.decode_attention(torch.randn(1, 1, 16), torch.randn(1, 1, 16, 16), torch.randn(1, 1, 16, 16), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 0.25)
    native_build.library_at.cache_clear()
    monkeypatch.delenv(native_build.DISABLE_ENV)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="trioserve.kernels.native_build"):
        assert native_build.library() is None
    assert "native kernels not built" in caplog.text and "/nonexistent/cc" in caplog.text


def test_builds_once_into_the_cache_by_a_key_of_source_and_cpu(fresh_library, tmp_path):
    first = native_build.build(out_dir=tmp_path)
    assert first.parent == tmp_path and first.name.startswith("cpu_kernels-") and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert native_build.build(out_dir=tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left
    assert native_build.library() is not None


@at_levels()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "n"), [(1, 576), (3, 64), (33, 100), (7, 17), (129, 72)])
def test_rms_norm_matches_the_torch_twin_row_by_row(level, dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=gen) * 30
    x[0, 0] = 2.5e4  # an "attention sink" sized value
    weight = torch.rand(n, generator=gen) + 0.5
    got = native.rms_norm(x, weight, 1e-5, dtype)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = reference.rms_norm(x, weight, 1e-5).to(dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    for r in range(rows):  # a row alone is the same bits
        assert torch.equal(native.rms_norm(x[r : r + 1], weight, 1e-5, dtype)[0], got[r])
    with pytest.raises(RuntimeError, match="fp32 rows"):
        native.rms_norm(x.to(torch.bfloat16), weight, 1e-5, dtype)


@at_levels()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 16)])
@pytest.mark.parametrize(("rows", "real"), [(1, 1), (5, 3), (7, 7), (33, 33), (129, 120)])
def test_rope_and_kv_write_are_bit_identical_to_the_torch_twin(level, dtype, heads, kv_heads, dim, rows, real):
    num_blocks = 9
    case = rope_case(rows, real, heads, kv_heads, dim, dtype, dtype, num_blocks)
    qkv, positions, cos, sin, slots = case.qkv, case.positions, case.cos, case.sin, case.slots
    got_k, got_v = case.caches
    q = native.rope_write_kv(qkv, positions, cos, sin, got_k, got_v, slots, heads, kv_heads)
    assert q.dtype == dtype and q.shape == (rows, heads, dim)
    assert torch.equal(q, case.want_q)
    assert torch.equal(got_k, case.want_k) and torch.equal(got_v, case.want_v)  # pad rows stored nothing
    with pytest.raises(RuntimeError, match="out of range"):
        native.rope_write_kv(qkv, positions + MAX_POS, cos, sin, got_k, got_v, slots, heads, kv_heads)
    with pytest.raises(RuntimeError, match="out of range"):
        native.rope_write_kv(qkv, positions, cos, sin, got_k, got_v, slots + num_blocks * BLOCK_SIZE, heads, kv_heads)
    with pytest.raises(RuntimeError, match="does not hold"):
        native.rope_write_kv(qkv, positions, cos, sin, got_k, got_v, slots, heads + 1, kv_heads)


# The largest logit difference between the C kernels and the torch path, as
# a share of the largest logit. With int8 activations a bf16 model's small
# upstream differences (the bf16 row's 0.5%) move some inputs across an
# 8-bit rounding step (1/127 of their block's largest), so its bound is
# wider; a float32 model's two paths agree to the last bits there: the
# layers give the same bits, and the head (on the file's codes) differs only
# where its C kernel fuses a multiply-add that the twin rounds twice (a few
# units in the last place of the largest logit).
AGREE = {("bf16", torch.float32): 0.02, ("bf16", torch.bfloat16): 0.02, ("int8", torch.float32): 2**-20, ("int8", torch.bfloat16): 0.05}


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_the_model_runs_the_native_kernels_and_agrees_with_the_torch_path(tiny_checkpoints, activations):
    """The tiny model's forward with the C kernels against the same model
    with them switched off: close logits, the same greedy picks. With int8
    activations the generated tokens' 4-bit rows go through the C VNNI
    kernel in one and its torch twin in the other."""
    from trioserve.models.checkpoint import load_checkpoint
    from trioserve.models.decoder import DecoderModel

    if activations == "int8" and not native.int4_q8_supported(16, 32):
        pytest.skip("no int8-activation C kernel here: no C compiler (the twin alone is tested in test_native_q8.py)")
    for dtype in (torch.float32, torch.bfloat16):
        ckpt = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=dtype)
        fast = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, activations=activations)
        slow = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, kernels="reference", activations=activations)
        assert fast.kernels.name == "native" and fast.kernels.reads_in_place
        assert slow.kernels.name == "reference"
        assert fast.kernels.activations == slow.kernels.activations == activations
        qkv = fast.layers[0].qkv
        if activations == "int8":
            assert qkv.native.q8
        else:  # the bf16 4-bit kernel is AVX-512 BF16's; elsewhere torch's int4 op runs
            assert (qkv.native is not None) == native.int4_supported(*qkv.weight.shape)
            assert qkv.native is None or not qkv.native.q8
        assert (slow.layers[0].qkv.q8_twin is not None) == (activations == "int8")
        if activations == "int8":  # the file's Q4_1 head on the 4-bit codes, as the layers
            assert fast.head_codes.native.q8 and slow.head_codes.q8_twin is not None and fast.head_int8 is None
        else:  # both count as 4-bit models: an 8-bit copy of the head
            assert fast.head_int8 is not None and slow.head_int8 is not None
        prompt = build_step([SeqChunk([5, 9, 33, 7, 2, 8], 0, [0, 1])], 4, fixed=True)
        decode = build_step([SeqChunk([3], 6, [0, 1], decode=True)], 4, fixed=True)
        caches = {m: m.new_kv_cache(4, 4) for m in (fast, slow)}
        for step in (prompt, decode):
            a, b = fast.forward(step, caches[fast]), slow.forward(step, caches[slow])
            bound = AGREE[activations, dtype] * b.abs().max()
            assert (a - b).abs().max() <= bound, dtype
            # The same greedy picks, but at a near tie (the top two within twice the bound: the
            # bf16 model with int8 activations, whose head rounds its inputs to 8 bits as well).
            top = b.topk(2, dim=-1).values
            clear = (top[:, 0] - top[:, 1]) > 2 * bound
            assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear]), dtype
            if (activations, dtype) == ("int8", torch.float32):  # agreeing to the last bits: every pick compared
                assert bool(clear.all())


@pytest.mark.without_kernels
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_bad_native_kernels_value_is_one_error_line_and_exit_2(command, tiny_checkpoints):
    """TRIOSERVE_NATIVE_KERNELS=sometimes: one line naming the variable and
    the value, exit 2, nothing loaded; the hypercorn path refuses it too."""
    from tests.test_cli import run_cli
    from trioserve.config import native_kernels_setting, settings_from_env

    args = ["--model", str(tiny_checkpoints["gguf_f32"])]
    args += ["--port", "0"] if command == "serve" else ["--prompt", "hi", "--max-tokens", "2"]
    proc = run_cli(command, *args, env={"TRIOSERVE_NATIVE_KERNELS": "sometimes"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines() == ["trioserve: error: TRIOSERVE_NATIVE_KERNELS: must be true or false, got 'sometimes'"]
    with pytest.raises(ValueError, match=r"TRIOSERVE_NATIVE_KERNELS: must be true or false, got 'sometimes'"):
        settings_from_env({"TRIOSERVE_NATIVE_KERNELS": "sometimes"})
    assert native_kernels_setting({}) and native_kernels_setting({"TRIOSERVE_NATIVE_KERNELS": "on"})
    assert not native_kernels_setting({"TRIOSERVE_NATIVE_KERNELS": " Off "})


@at_levels()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "n"), [(1, 576), (3, 64), (7, 17), (33, 100), (70, 100), (129, 72)])
def test_the_residual_add_fused_into_the_norm_is_the_add_then_the_norm(level, dtype, rows, n):
    """add_rms_norm: h updated in place to h + delta, and the same bits as
    rms_norm of that sum (70 and 129 rows: the threaded path too), so within
    rms_norm's tolerance of the torch twin on that sum; each row the same
    bits alone."""
    gen = torch.Generator().manual_seed(rows + n)
    h = torch.randn(rows, n, generator=gen) * 30
    delta = torch.randn(rows, n, generator=gen).to(dtype)
    weight = torch.rand(n, generator=gen) + 0.5
    summed = h + delta
    out = native.add_rms_norm(h.clone(), delta, weight, 1e-5, dtype)
    for r in (0, rows // 2, rows - 1):  # a row alone: the same bits
        assert torch.equal(native.add_rms_norm(h[r : r + 1].clone(), delta[r : r + 1], weight, 1e-5, dtype), out[r : r + 1])
    want = reference.rms_norm(summed, weight, 1e-5).to(dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # as rms_norm's own test
    torch.testing.assert_close(out.float(), want.float(), atol=tolerance, rtol=tolerance)
    out = native.add_rms_norm(h, delta, weight, 1e-5, dtype)
    assert torch.equal(h, summed)
    assert out.dtype == dtype and torch.equal(out, native.rms_norm(summed, weight, 1e-5, dtype))
    with pytest.raises(RuntimeError, match="add_rms_norm takes contiguous fp32 rows"):
        native.add_rms_norm(h.to(torch.bfloat16), delta, weight, 1e-5, dtype)


@at_levels()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "f"), [(1, 1536), (5, 21), (7, 100), (33, 21), (70, 48), (129, 40)])
def test_silu_mul_is_within_one_rounding_of_the_exact_product_row_by_row(level, dtype, rows, f):
    """silu_mul: silu(gate) * up rounded once (torch's F.silu(gate) * up
    rounds twice); each row the same bits alone as in company; widths not a
    multiple of 16 take the scalar tail."""
    gen = torch.Generator().manual_seed(rows * f)
    gate_up = (torch.randn(rows, 2 * f, generator=gen) * 6).to(dtype)
    got = native.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    # bf16: half a unit of the last place, relative (one rounding); fp32: a
    # few roundings and the exp polynomial's ~2e-7.
    step = 2**-8 if dtype == torch.bfloat16 else 2**-20
    assert got.dtype == dtype and got.shape == (rows, f)
    assert ((got.double() - exact).abs() <= step * exact.abs() + 1e-30).all()
    for r in (0, rows - 1):
        assert torch.equal(native.silu_mul(gate_up[r : r + 1])[0], got[r])
    with pytest.raises(RuntimeError, match=r"silu_mul takes rows \[T, 2F\]"):
        native.silu_mul(gate_up[:, :3])
