"""Bucketed steps: padding the prompt tokens, the query rows and the key
blocks to a few sizes (so memory stays flat under endlessly varying steps)
changes no result. The same step built with and without buckets gives the
same logits and leaves the same KV cache."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_model import TINY, hf_config, tiny_weights
from trioserve.kernels.ops import Kernels
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.config import config_from_hf
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, bucket, build_step

VOCAB = 300
BLOCK = 4
NUM_BLOCKS = 160


def test_bucket_sizes_are_few_and_close():
    sizes = [bucket(n) for n in range(1, 8193)]
    assert sizes[:8] == list(range(1, 9))  # exact up to 8
    assert all(b >= n and b < 1.25 * n for n, b in zip(range(1, 8193), sizes))
    assert sizes == sorted(sizes)
    assert len(set(sizes)) <= 8 + 4 * 10  # four per power of two above 8
    assert all(bucket(b) == b for b in sizes)


def mixed_chunks() -> list[SeqChunk]:
    """Three decode rows with different contexts, then a short prompt chunk
    and one long enough for the fused attention kernel. Block ids are
    scattered; every table is exactly as long as its sequence needs."""
    plan = [(5, 1, True), (30, 1, True), (70, 1, True), (0, 11, False), (9, 70, False)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    chunks = []
    for start, n, decode in plan:
        need = -(-(start + n) // BLOCK)
        table, ids = ids[:need], ids[need:]
        tokens = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        chunks.append(SeqChunk(tokens, start, table, decode))
    return chunks


def test_bucketed_layout_pads_only_what_is_never_read():
    chunks = mixed_chunks()
    step = build_step(chunks, BLOCK)
    real = sum(len(c.token_ids) for c in chunks)
    assert step.num_tokens == real == 84
    assert step.token_ids.shape[0] == 3 + bucket(81)  # decode rows are never padded
    assert step.token_ids[real:].eq(0).all() and step.positions[real:].eq(0).all()
    decode, prompt = step.groups
    assert (decode.first, decode.count, decode.mask.shape[1], decode.flash) == (0, 3, 1, False)
    assert decode.block_tables.shape == (3, bucket(18))
    assert (prompt.first, prompt.count, prompt.mask.shape[1], prompt.flash) == (3, 81, bucket(70), True)
    assert prompt.block_tables.shape == (2, bucket(20))
    for group, members in ((decode, chunks[:3]), (prompt, chunks[3:])):
        assert group.mask.any(-1).all()  # no row attends to nothing
        for s, chunk in enumerate(members):
            # a real query sees no key past its sequence's end, padded blocks included
            n = len(chunk.token_ids)
            assert not group.mask[s, :n, chunk.start + n :].any()
    exact = build_step(chunks, BLOCK, buckets=False)
    assert exact.token_ids.shape[0] == real
    assert exact.groups[1].block_tables.shape == (2, 20)
    for name in ("slot_mapping", "last_index"):
        assert torch.equal(getattr(step, name), getattr(exact, name))


def tiny_model(dtype: torch.dtype) -> DecoderModel:
    weights = tiny_weights(VOCAB, seed=7)
    config = config_from_hf(hf_config(VOCAB, tie=False), "tiny")
    return DecoderModel(config, {k: torch.from_numpy(v).to(dtype) for k, v in weights.items()})


def filled_cache(model: DecoderModel):
    """A cache full of distinct values, so reading a wrong slot shows."""
    cache = model.new_kv_cache(NUM_BLOCKS, BLOCK)
    gen = torch.Generator().manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


def assert_same_step(model: DecoderModel, chunks: list[SeqChunk]) -> None:
    padded_cache, exact_cache = filled_cache(model), filled_cache(model)
    padded = model.forward(build_step(chunks, BLOCK), padded_cache)
    exact = model.forward(build_step(chunks, BLOCK, buckets=False), exact_cache)
    assert padded.shape == (len(chunks), VOCAB)
    assert torch.equal(padded, exact)
    # pad tokens wrote nothing: the caches are identical
    assert torch.equal(padded_cache.k, exact_cache.k) and torch.equal(padded_cache.v, exact_cache.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bucketed_step_gives_identical_logits(dtype):
    model = tiny_model(dtype)
    chunks = mixed_chunks()
    assert_same_step(model, chunks)
    assert_same_step(model, chunks[:3])  # decode rows only
    assert_same_step(model, chunks[3:])  # prompt chunks only
    assert_same_step(model, chunks[4:])  # one long chunk


def test_bucketed_step_gives_identical_logits_with_int4_weights(tiny_checkpoints):
    """The served configuration: bf16 weights, 4-bit ones for decode rows."""
    model = DecoderModel.from_checkpoint(load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.bfloat16))
    assert model.layers[0].qkv.packed is not None
    config_vocab = model.config.vocab_size
    chunks = [SeqChunk([t % config_vocab for t in c.token_ids], c.start, c.block_table, c.decode) for c in mixed_chunks()]
    padded_cache, exact_cache = filled_cache(model), filled_cache(model)
    padded = model.forward(build_step(chunks, BLOCK), padded_cache)
    exact = model.forward(build_step(chunks, BLOCK, buckets=False), exact_cache)
    assert torch.equal(padded, exact)
    assert torch.equal(padded_cache.k, exact_cache.k) and torch.equal(padded_cache.v, exact_cache.v)


def test_gather_buffers_are_reused_across_steps():
    """The torch attention path's gather buffers (the C kernel, where it
    builds, reads the pool in place and needs none)."""
    model = tiny_model(torch.float32)
    model.kernels = Kernels()  # the torch set
    cache = filled_cache(model)
    chunks = mixed_chunks()
    model.forward(build_step(chunks, BLOCK), cache)
    buffers = model._scratch
    assert buffers is not None
    model.forward(build_step(chunks[:3], BLOCK), cache)  # smaller: the same buffers
    assert model._scratch is buffers
    per_block = TINY["num_key_value_heads"] * BLOCK * (TINY["hidden_size"] // TINY["num_attention_heads"])
    assert buffers.shape[1] >= 2 * bucket(20) * per_block
    native_model = tiny_model(torch.float32)
    if native_model.kernels.reads_in_place:
        native_model.forward(build_step(chunks, BLOCK), filled_cache(native_model))
        assert native_model._scratch is not None and native_model._scratch.shape[1] == 0
