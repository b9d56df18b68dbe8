"""The paged, batched forward against a dense reference Llama written here,
independently of trioserve's kernels: several sequences of different lengths,
prefill split into chunks mixed with other sequences' decode rows in the same
step, blocks smaller than the prompts, block ids shuffled."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.tiny_model import TINY, hf_config, tiny_weights
from trioserve.models.config import config_from_hf
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step

VOCAB = 360
BLOCK = 4
CHUNK = 5
DECODE_STEPS = 20


def dense_logits(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits at every position of ``ids`` from a plain float64 Llama:
    full causal attention, rotate-half RoPE, GQA by repeating KV heads."""
    heads, kv_heads = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    dim = TINY["hidden_size"] // heads
    eps = TINY["rms_norm_eps"]
    n = len(ids)

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    inv = 1.0 / TINY["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    ang = np.arange(n)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):
        a, b = x[..., : dim // 2], x[..., dim // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    f64 = {k: v.astype(np.float64) for k, v in w.items()}
    x = f64["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((n, n), dtype=bool))
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, f64[p + "input_layernorm.weight"])
        q = rope((h @ f64[p + "self_attn.q_proj.weight"].T).reshape(n, heads, dim))
        k = rope((h @ f64[p + "self_attn.k_proj.weight"].T).reshape(n, kv_heads, dim))
        v = (h @ f64[p + "self_attn.v_proj.weight"].T).reshape(n, kv_heads, dim)
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
        scores = np.where(causal[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * dim)
        x = x + attn @ f64[p + "self_attn.o_proj.weight"].T
        h = norm(x, f64[p + "post_attention_layernorm.weight"])
        gate = h @ f64[p + "mlp.gate_proj.weight"].T
        up = h @ f64[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ f64[p + "mlp.down_proj.weight"].T
    x = norm(x, f64["model.norm.weight"])
    head = f64["model.embed_tokens.weight"] if "lm_head.weight" not in f64 else f64["lm_head.weight"]
    return x @ head.T


@pytest.fixture(scope="module", params=[False, True], ids=["separate-head", "tied-head"])
def tiny(request):
    tie = request.param
    weights = tiny_weights(VOCAB, seed=3, tie=tie)
    config = config_from_hf(hf_config(VOCAB, tie=tie), "tiny")
    model = DecoderModel(config, {k: torch.from_numpy(v) for k, v in weights.items()})
    return weights, model


def run_paged(model: DecoderModel, prompts: list[list[int]], seed: int, chunk: int = CHUNK) -> tuple[list[list[int]], list[list[tuple[int, np.ndarray]]]]:  # fmt: skip
    """Prefill in chunks of ``chunk`` and decode DECODE_STEPS greedy tokens for
    every prompt, all sequences sharing every step. Returns each sequence's
    full token list and the (position, logits) observed for it."""
    rng = random.Random(seed)
    needed = [-(-(len(p) + DECODE_STEPS) // BLOCK) for p in prompts]
    ids = list(range(sum(needed) + 5))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at : at + n])
        at += n
    cache = model.new_kv_cache(len(ids), BLOCK)
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens already in the cache
    seen: list[list[tuple[int, np.ndarray]]] = [[] for _ in prompts]
    while any(len(t) < len(p) + DECODE_STEPS for t, p in zip(tokens, prompts)):
        rows, chunks = [], []
        for s, t in enumerate(tokens):
            if len(t) >= len(prompts[s]) + DECODE_STEPS:
                continue
            new = t[done[s] : done[s] + chunk] if done[s] < len(prompts[s]) else t[done[s] :]
            rows.append(s)
            chunks.append(SeqChunk(new, done[s], tables[s]))
        logits = model.forward(build_step(chunks, BLOCK, fixed=model.batch_invariant), cache)
        for row, s in enumerate(rows):
            done[s] += len(chunks[row].token_ids)
            if done[s] >= len(prompts[s]):  # the prompt is in: these logits pick a token
                seen[s].append((done[s] - 1, logits[row].numpy()))
                tokens[s].append(int(logits[row].argmax()))
    return tokens, seen


# Short chunks take the batched-matmul attention path; a chunk of 80 queries
# takes torch's fused attention (SDPA_MIN_QUERIES), so both are checked.
@pytest.mark.parametrize(("chunk", "lengths"), [(CHUNK, (13, 7, 22, 1)), (80, (100, 3, 70))])
def test_paged_forward_equals_dense(tiny, chunk, lengths):
    weights, model = tiny
    gen = np.random.default_rng(0)
    prompts = [list(gen.integers(3, VOCAB, size=n)) for n in lengths]
    tokens, seen = run_paged(model, prompts, seed=1, chunk=chunk)
    for s, t in enumerate(tokens):
        assert len(seen[s]) == DECODE_STEPS
        reference = dense_logits(weights, t[:-1])
        for pos, logits in seen[s]:
            np.testing.assert_allclose(logits, reference[pos], atol=1e-4, rtol=0)
        # The greedy continuation is the dense model's own greedy continuation.
        assert t[len(prompts[s]) :] == [int(reference[p].argmax()) for p, _ in seen[s]]


def test_batch_does_not_change_a_sequence(tiny):
    """A sequence's logits do not depend on what else shares its steps."""
    _, model = tiny
    gen = np.random.default_rng(5)
    prompts = [list(gen.integers(3, VOCAB, size=n)) for n in (9, 17, 4)]
    together, seen_together = run_paged(model, prompts, seed=2)
    alone, seen_alone = run_paged(model, prompts[1:2], seed=3)
    assert together[1] == alone[0]
    for (p1, a), (p2, b) in zip(seen_together[1], seen_alone[0]):
        assert p1 == p2
        # float32 noise only: a matmul over 3 rows and over 1 row may sum in
        # another order. On CPUs with AVX-512 FP16 (this project's machines
        # since 2026-12) one logit moved by 1.1e-5 (12 ulps of the largest
        # logit, ~12), so the bound is 16 float32 ulps of the largest logit
        # (1.5e-5 here; it was a flat 1e-5). Bit-exact batch invariance is
        # issue #11's to deliver; it will tighten this to equality.
        np.testing.assert_allclose(a, b, atol=16 * np.spacing(np.float32(np.abs(b).max())), rtol=0)


def test_logits_are_not_trivial(tiny):
    """Guards the comparison above: the reference must distinguish positions
    and the logits must be far from uniform, or equality would prove little."""
    weights, _ = tiny
    ref = dense_logits(weights, [5, 9, 11, 5])
    assert ref.std(axis=-1).min() > 0.5
    assert np.abs(ref[0] - ref[3]).max() > 0.1  # same token, other position


def test_position_past_context_is_refused(tiny):
    _, model = tiny
    limit = TINY["max_position_embeddings"]
    cache = model.new_kv_cache(limit // BLOCK + 1, BLOCK)
    table = list(range(limit // BLOCK + 1))
    with pytest.raises(ValueError, match=f"past the model's {limit}"):
        model.forward(build_step([SeqChunk([1], limit, table)], BLOCK), cache)
