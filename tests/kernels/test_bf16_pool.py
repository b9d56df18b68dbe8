"""A float32 model with a bfloat16 KV pool (`--kv-cache-dtype bfloat16`):
the C kernels store K and V rounded to bf16 as torch casts them, read them
widened exactly (so attention over the bf16 pool is the same bits as over a
float32 pool holding the same rounded values), refuse what they do not
take, and the model with such a pool agrees with its torch path and with
its float32-pool self within bf16 rounding of K and V. The kernel tests
run at every level of the C kernels this CPU executes (tests/kernels/levels.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.kernels.levels import at_levels, use_level
from tests.kernels.test_native import PROMPTS, _case, _prompt_case
from trioserve.kernels import native, native_build, reference
from trioserve.models.step import SeqChunk, build_step


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    if native_build.library() is None:
        pytest.skip("no C kernels here: no working C compiler ($CC), or TRIOSERVE_NATIVE_KERNELS=0")


@pytest.fixture
def level(request, monkeypatch) -> str:
    """The C kernels of the level `at_levels` gives, or a skip saying why this CPU cannot run it."""
    use_level(request.param, monkeypatch)
    return request.param


def _bf16_pool(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bf16 pool, and the float32 pool holding its values."""
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    return k16, v16, k16.float(), v16.float()


@functools.lru_cache(maxsize=2)
def _decode_twin(seqs, heads, kv_heads, dim, block_size):
    """A decode case over a bf16 pool and the twin's answer, made once for
    all levels (the twin does not depend on the level)."""
    gen = torch.Generator().manual_seed(seqs * 7 + heads + dim)
    q, k, v, chunks = _case(gen, seqs=seqs, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, dtype=torch.float32)
    k16, v16, k32, v32 = _bf16_pool(k, v)
    g = build_step(chunks, block_size).groups[0]
    return q, (k16, v16, k32, v32), chunks, g, reference.paged_attention(q, k16, v16, g.block_tables, g.pad_index, g.mask, dim**-0.5)


# (seqs, heads, kv_heads, dim, block_size): each layout at 1, 3, 7 and 33
# sequences, and 129 at two of them (the twin is the slow part there).
DECODE_CASES = [
    *((seqs, *shape) for shape in ((4, 4, 64, 16), (9, 3, 64, 16), (8, 2, 128, 32), (6, 1, 48, 16)) for seqs in (1, 3, 7, 33)),
    (129, 9, 3, 64, 16),
    (129, 8, 2, 128, 32),
]


@at_levels()
@pytest.mark.parametrize(("seqs", "heads", "kv_heads", "dim", "block_size"), DECODE_CASES)
def test_decode_over_a_bf16_pool_is_the_float32_pool_of_its_values(level, seqs, heads, kv_heads, dim, block_size):
    q, (k16, v16, k32, v32), chunks, g, want = _decode_twin(seqs, heads, kv_heads, dim, block_size)
    got = native.decode_attention(q, k16, v16, g.block_tables, g.lengths, dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == (seqs, heads, dim)
    assert torch.equal(got, native.decode_attention(q, k32, v32, g.block_tables, g.lengths, dim**-0.5))
    assert want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    # Each row alone is the same bits as in company.
    for r in {0, seqs // 2, seqs - 1}:
        alone = build_step([chunks[r]], block_size).groups[0]
        assert torch.equal(native.decode_attention(q[r : r + 1], k16, v16, alone.block_tables, alone.lengths, dim**-0.5)[0], got[r])


@at_levels()
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_prompt_rows_over_a_bf16_pool_are_the_float32_pool_of_its_values(level, prompt):
    gen = torch.Generator().manual_seed(5)
    q, k, v, chunks = _prompt_case(gen, heads=9, kv_heads=3, dim=64, block_size=16, dtype=torch.float32, prompt=prompt)
    k16, v16, k32, v32 = _bf16_pool(k, v)
    g = build_step(chunks, 16, buckets=False).groups[0]
    got = native.decode_attention(q, k16, v16, g.block_tables, g.row_lengths, 0.125, row_seq=g.row_seq)
    assert torch.equal(got, native.decode_attention(q, k32, v32, g.block_tables, g.row_lengths, 0.125, row_seq=g.row_seq))
    want = reference.paged_attention(q, k16, v16, g.block_tables, g.pad_index, g.mask, 0.125)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


@at_levels()
@pytest.mark.parametrize(("rows", "real"), [(1, 1), (5, 3), (7, 7), (33, 33), (129, 120)])
def test_rope_writes_k_and_v_rounded_to_bf16_as_torch_casts(level, rows, real):
    heads, kv_heads, dim, block_size, num_blocks, max_pos = 9, 3, 64, 16, 9, 200
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen) * 3
    positions = torch.randint(0, max_pos, (rows,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:real]
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), torch.rand(dim // 2, generator=gen, dtype=torch.float64))
    cos, sin = angles.cos().float(), angles.sin().float()
    wide = [torch.zeros(kv_heads, num_blocks, block_size, dim) for _ in range(2)]
    narrow = [torch.zeros(kv_heads, num_blocks, block_size, dim, dtype=torch.bfloat16) for _ in range(2)]
    q32 = native.rope_write_kv(qkv, positions, cos, sin, *wide, slots, heads, kv_heads)
    q16 = native.rope_write_kv(qkv, positions, cos, sin, *narrow, slots, heads, kv_heads)
    assert q16.dtype == torch.float32 and torch.equal(q16, q32)  # the queries stay float32
    for got, full in zip(narrow, wide, strict=True):
        assert torch.equal(got, full.to(torch.bfloat16))
    # The torch twin stores the same bits.
    twin = [torch.zeros(kv_heads, num_blocks, block_size, dim, dtype=torch.bfloat16) for _ in range(2)]
    c, s = cos.index_select(0, positions), sin.index_select(0, positions)
    k = reference.apply_rope(qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim), c, s)
    reference.write_kv(*twin, slots, k[:real], qkv[:real, (heads + kv_heads) * dim :].reshape(real, kv_heads, dim))
    assert torch.equal(twin[0], narrow[0]) and torch.equal(twin[1], narrow[1])


def test_bf16_rows_with_a_float32_pool_are_refused():
    gen = torch.Generator().manual_seed(1)
    q, k, v, chunks = _case(gen, seqs=2, heads=4, kv_heads=4, dim=64, block_size=16, dtype=torch.float32)
    g = build_step(chunks, 16).groups[0]
    with pytest.raises(RuntimeError, match="bfloat16 pool with bfloat16 rows"):
        native.decode_attention(q.to(torch.bfloat16), k, v, g.block_tables, g.lengths, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16 pool with bfloat16 rows"):
        native.rope_write_kv(torch.zeros(1, 12 * 64, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64), torch.ones(4, 32),
                             torch.zeros(4, 32), k, v, torch.zeros(1, dtype=torch.int64), 4, 4)  # fmt: skip


@at_levels()
def test_a_float32_model_with_a_bf16_pool_agrees_with_its_torch_path_and_its_float32_pool(level, tiny_checkpoints):
    from trioserve.models.checkpoint import load_checkpoint
    from trioserve.models.decoder import DecoderModel

    if not native.int4_q8_supported(16, 32):
        pytest.skip("no int8-activation C kernel here (AVX2 or AVX-512 VNNI): the two paths would take different activations")
    ckpt = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.float32)
    fast = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, activations="int8", kv_dtype=torch.bfloat16)
    slow = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, kernels="reference", activations="int8", kv_dtype=torch.bfloat16)
    wide = DecoderModel.from_checkpoint(ckpt, batch_invariant=True, activations="int8")
    assert fast.kv_dtype == slow.kv_dtype == torch.bfloat16 and wide.kv_dtype == torch.float32
    assert fast.kv_bytes_per_token() * 2 == wide.kv_bytes_per_token()
    caches = {m: m.new_kv_cache(4, 4) for m in (fast, slow, wide)}
    assert caches[fast].k.dtype == caches[fast].v.dtype == torch.bfloat16
    prompt = build_step([SeqChunk([5, 9, 33, 7, 2, 8], 0, [0, 1])], 4, fixed=True)
    decode = build_step([SeqChunk([3], 6, [0, 1], decode=True)], 4, fixed=True)
    for step in (prompt, decode):
        a, b, c = (m.forward(step, caches[m]) for m in (fast, slow, wide))
        assert a.dtype == torch.float32
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
        assert (a - c).abs().max() <= 0.05 * c.abs().max()  # K and V rounded to bf16 (a bf16 model gets as far)
        assert torch.equal(a.argmax(-1), c.argmax(-1))
    assert torch.equal(caches[fast].k, caches[slow].k) and torch.equal(caches[fast].v, caches[slow].v)


def test_a_bf16_pool_is_refused_where_it_cannot_run(tiny_checkpoints):
    from trioserve.models.checkpoint import load_checkpoint
    from trioserve.models.decoder import DecoderModel

    ckpt = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype float32: the weights are bfloat16 on cpu; only float32 weights"):
        DecoderModel.from_checkpoint(ckpt, kv_dtype=torch.float32)


def test_served_with_a_bf16_pool_says_so_and_answers(tiny_checkpoints):
    """`trioserve serve --dtype float32 --kv-cache-dtype bfloat16`: the start
    line, the model card and /metrics name the pool's dtype; greedy replies
    come back."""
    import httpx

    from tests.test_cpu_levels import Server

    server = Server(tiny_checkpoints["gguf_q4_1"], "native", "--dtype", "float32", "--kv-cache-dtype", "bfloat16")
    try:
        assert "float32 (bfloat16 KV pool)" in server.compute_line()
        card = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["compute"]
        assert (card["dtype"], card["kv_dtype"]) == ("float32", "bfloat16")
        assert httpx.get(f"{server.url}/metrics", timeout=30).json()["compute"]["kv_dtype"] == "bfloat16"
        body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8, reply.text
    finally:
        server.close()


def test_a_pool_dtype_that_cannot_run_or_is_unknown_is_one_error_line(tiny_checkpoints):
    from tests.test_cli import run_cli

    model = ["--model", str(tiny_checkpoints["gguf_q4_1"]), "--port", "0"]
    wrong = run_cli("serve", *model, "--dtype", "bfloat16", "--kv-cache-dtype", "float32")
    assert wrong.returncode == 2, wrong.stderr
    assert wrong.stderr.splitlines()[-1] == (
        "trioserve: error: --kv-cache-dtype float32: the weights are bfloat16 on cpu; only float32 weights on a CPU may keep "
        "a pool of another dtype (bfloat16). Use --kv-cache-dtype auto"
    )
    env = run_cli("serve", *model, env={"TRIOSERVE_KV_CACHE_DTYPE": "fp8"})
    assert env.returncode == 2 and env.stderr.splitlines() == [
        "trioserve: error: TRIOSERVE_KV_CACHE_DTYPE: must be one of auto, float32, bfloat16, got 'fp8'"
    ]
    flag = run_cli("serve", *model, "--kv-cache-dtype", "fp8")
    assert flag.returncode == 2 and "argument --kv-cache-dtype: invalid choice: 'fp8'" in flag.stderr
