"""Each family against transformers' own modeling code (the reference
forward): tiny random models made by its config and model classes, loaded
from the HF directory transformers saved and from GGUF files written as
llama.cpp's converter writes them; the paged forward (chunked prompts,
several sequences a step, decode rows beside prompt rows, blocks shuffled)
gives transformers' logits at every position, and its greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.families import build_family
from tests.models.test_forward import run_paged
from trioserve.kernels import native
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel

FAMILIES = ["qwen3", "gemma3", "phi3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    built = build_family(tmp_path_factory.mktemp(request.param), request.param, tie=request.param == "gemma3")
    built["name"] = request.param
    return built


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def served(path, **options) -> DecoderModel:
    return DecoderModel.from_checkpoint(load_checkpoint(path, dtype=torch.float32), max_model_len=256, **options)


def prompts(vocab: int, lengths=(13, 7, 22, 1), seed: int = 0) -> list[list[int]]:
    gen = np.random.default_rng(seed)
    return [[int(t) for t in gen.integers(3, vocab, size=n)] for n in lengths]


@pytest.mark.parametrize("kind", ["hf", "gguf_f32"])
def test_paged_forward_equals_transformers(family, kind):
    model = served(family[kind])
    assert model.family.name == family["name"]
    vocab = family["tokenizer"].get_vocab_size()
    tokens, seen = run_paged(model, prompts(vocab), seed=1)
    for s, t in enumerate(tokens):
        reference = reference_logits(family["model"], t[:-1])
        for pos, logits in seen[s]:
            np.testing.assert_allclose(logits, reference[pos], atol=2e-4, rtol=0, err_msg=f"sequence {s}, position {pos}")
        # Greedy: each token is the reference's argmax at its position.
        assert [t[p + 1] for p, _ in seen[s]] == [int(reference[p].argmax()) for p, _ in seen[s]]


def test_the_reference_is_not_trivial(family):
    """The random model's greedy text varies (a family bug would show)."""
    vocab = family["tokenizer"].get_vocab_size()
    logits = reference_logits(family["model"], prompts(vocab, (30,))[0])
    assert len(set(logits.argmax(-1).tolist())) > 5
    assert float(logits.std()) > 0.5


def test_sliding_window_is_in_force(family):
    """Gemma 3's local layers forget what lies past the window: a change 20
    tokens back moves the logits less through them than a full layer
    would, and transformers agrees on both prompts (so the window is
    tested, not only the full layers)."""
    if family["name"] != "gemma3":
        pytest.skip("only gemma3 has sliding-window layers here")
    model = served(family["gguf_f32"])
    assert [spec.window for spec in model.specs] == [8, 8, 8, 8, 8, None, 8]
    vocab = family["tokenizer"].get_vocab_size()
    base = prompts(vocab, (30,), seed=4)[0]
    other = [5 if i == 2 else t for i, t in enumerate(base)]
    for p in (base, other):
        tokens, seen = run_paged(model, [p], seed=2)
        reference = reference_logits(family["model"], tokens[0][:-1])
        for pos, logits in seen[0]:
            np.testing.assert_allclose(logits, reference[pos], atol=2e-4, rtol=0)


def test_q8_0_file_follows_the_f32_file(family):
    """The Q8_0 file on its 8-bit codes kernels (int8 activations; the layers in one C call where
    the C loop takes them: kernels/layer_runner.py) stays near the float32 file's logits."""
    if not native.int4_q8_supported(16, 32):
        pytest.skip("no int8-activation C kernel here (no C compiler, or TRIOSERVE_NATIVE_KERNELS=0)")
    vocab = family["tokenizer"].get_vocab_size()
    exact = served(family["gguf_f32"])
    codes = served(family["gguf_q8_0"], activations="int8")
    assert codes.kernels.activations == "int8"
    p = prompts(vocab, (17, 5))
    _, seen_exact = run_paged(exact, p, seed=3)
    _, seen_codes = run_paged(codes, p, seed=3)
    for a_seq, b_seq in zip(seen_exact, seen_codes):
        a, b = np.stack([x for _, x in a_seq[:1]]), np.stack([x for _, x in b_seq[:1]])
        scale = float(np.abs(a).max())
        assert float(np.abs(a - b).max()) < 0.05 * scale


def test_reference_and_native_kernels_agree(family):
    """The torch twins and the C kernels run the same family description."""
    vocab = family["tokenizer"].get_vocab_size()
    p = prompts(vocab, (11, 4))
    native = served(family["gguf_f32"])
    reference = served(family["gguf_f32"], kernels="reference")
    assert reference.kernels.name == "reference"
    _, a = run_paged(native, p, seed=5)
    _, b = run_paged(reference, p, seed=5)
    for a_seq, b_seq in zip(a, b):
        for (pa, la), (pb, lb) in zip(a_seq, b_seq):
            assert pa == pb
            np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)


def test_batch_invariant_family_rows_are_their_own(family):
    """With batch-invariant arithmetic a sequence's logits are the same bits
    alone and beside others, and however its prompt is chunked."""
    vocab = family["tokenizer"].get_vocab_size()
    model = served(family["gguf_q8_0"], batch_invariant=True)
    p = prompts(vocab, (9, 17, 4), seed=6)
    together, seen_together = run_paged(model, p, seed=7)
    alone, seen_alone = run_paged(model, p[1:2], seed=8, chunk=3)
    assert together[1] == alone[0]
    for (p1, a), (p2, b) in zip(seen_together[1], seen_alone[0]):
        assert p1 == p2
        assert np.array_equal(a, b)


@pytest.mark.parametrize(
    ("name", "omit", "problem"),
    [
        ("qwen3", "blk.1.attn_q_norm.weight", "missing tensor 'blk.1.attn_q_norm.weight'"),
        ("gemma3", "blk.0.post_ffw_norm.weight", "missing tensor 'blk.0.post_ffw_norm.weight'"),
        ("gemma3", "sliding_window", "GGUF metadata lacks required key 'gemma3.attention.sliding_window'"),
        ("phi3", "blk.0.attn_qkv.weight", "missing tensor 'blk.0.attn_qkv.weight'"),
    ],
)
def test_a_file_missing_what_its_family_needs_is_one_line(tmp_path, name, omit, problem):
    from tests.families import hf_model, write_family_gguf
    from tests.tiny_tokenizer import train_tiny_tokenizer
    from trioserve.errors import CheckpointError

    tok = train_tiny_tokenizer()
    path = write_family_gguf(tmp_path / "broken.gguf", name, hf_model(name, tok.get_vocab_size(), tie=True), tok, omit=frozenset({omit}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.problem == problem
