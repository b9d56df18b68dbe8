"""llama.cpp's own converter as the second opinion on the GGUF files the
tests write themselves (tests/families.py, tests/tiny_model.py): the HF
directory each test model is saved as goes through
vendor/llama.cpp/convert_hf_to_gguf.py from llama-cpp-python 0.3.36's sdist
(F32 and Q8_0), and trioserve must read the same tensors, the same config
and give the same logits from llama.cpp's file as from the test's own.
Llama (with its Q/K row permutation) is the control.

The sdist is fetched once into ~/.cache/trioserve (or $TRIOSERVE_CACHE_DIR) by .ci/llama-cpp-sdist
(`make test-tools`); without it these tests skip.

The tiny tokenizer is SmolLM2-shaped (digits one by one, then GPT-2's
byte-level split) but its vocabulary is not SmolLM2's, so the hash the
converter takes of its tokens to name the pre-tokenizer matches no model it
knows and it refuses ("BPE pre-tokenizer was not recognized"). The converter
is run with that one answer supplied: an unrecognised hash is named
"smollm", the pre-tokenizer it is; nothing else is changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.families import build_family
from tests.models.test_forward import run_paged
from tests.tiny_model import build_tiny_checkpoints
from tests.tiny_tokenizer import train_tiny_tokenizer
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.gguf_file import read_metadata

VERSION = "0.3.36"
# Where .ci/llama-cpp-sdist unpacks it (the cache trioserve/kernels/native_build.py uses).
SDIST = Path(os.environ.get("TRIOSERVE_CACHE_DIR") or Path.home() / ".cache" / "trioserve") / f"llama-cpp-python-{VERSION}"
LLAMA_CPP = SDIST / "vendor" / "llama.cpp"

pytestmark = pytest.mark.skipif(
    not ((SDIST / ".complete").is_file() and (LLAMA_CPP / "convert_hf_to_gguf.py").is_file()),
    reason=f"llama-cpp-python {VERSION}'s sdist is not unpacked in {SDIST} (run .ci/llama-cpp-sdist, or `make test-tools`)",
)

# Runs convert_hf_to_gguf.py as its own command line does (its own gguf-py
# first on the path), except that a tokenizer whose pre-tokenizer hash it
# does not know is given a name (argv[2]): SmolLM2's for the tiny BPE
# tokenizer; "default" for a WordPiece one (llama.cpp ignores it for bert).
_CONVERT = """
import runpy, sys
src, unknown = sys.argv[1], sys.argv[2]
sys.path[0:0] = [src, src + "/gguf-py"]
from conversion import base
recognised = base.TextModel.get_vocab_base_pre
def pre_tokenizer(self, tokenizer):
    try:
        return recognised(self, tokenizer)
    except NotImplementedError:
        return unknown
base.TextModel.get_vocab_base_pre = pre_tokenizer
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(hf: Path, out: Path, outtype: str, *, unknown_pre: str = "smollm") -> Path:
    """``hf`` converted by llama.cpp's converter into ``out`` (f32 or q8_0)."""
    done = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(LLAMA_CPP), unknown_pre, str(hf), "--outtype", outtype, "--outfile", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and out.is_file(), f"convert_hf_to_gguf.py failed on {hf}:\n{done.stderr[-3000:]}"
    return out


FAMILIES = ["llama", "qwen3", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def files(request, tmp_path_factory):
    """The test's own GGUF files and llama.cpp's from the same HF directory."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        built = build_tiny_checkpoints(root)
    else:
        built = build_family(root, request.param, tie=request.param == "gemma3")
    return {
        "name": request.param,
        "hf": built["hf"],
        "ours_f32": built["gguf_f32"],
        "ours_q8_0": built["gguf_q8_0"],
        "llama_cpp_f32": convert(built["hf"], root / "llama-cpp-f32.gguf", "f32"),
        "llama_cpp_q8_0": convert(built["hf"], root / "llama-cpp-q8_0.gguf", "q8_0"),
    }


def checkpoint(path: Path):
    return load_checkpoint(path, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_every_tensor_trioserve_reads_is_the_same(files, kind):
    """(a) Under trioserve's names, after its loader's transforms (Q/K
    un-permuted, Gemma's 1 + w), both files give the same bits; for Q8_0
    the same 8-bit codes and block scales too."""
    ours, theirs = checkpoint(files[f"ours_{kind}"]), checkpoint(files[f"llama_cpp_{kind}"])
    assert list(ours.weights) and sorted(ours.weights) == sorted(theirs.weights)
    for name in ours.weights:
        a, b = ours.weights[name], theirs.weights[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{files['name']} {kind}: {name} differs, max |diff| {float((a - b).abs().max())}"
    assert sorted(ours.int8) == sorted(theirs.int8)
    if kind == "q8_0":
        assert ours.int8, "the Q8_0 files' projections should load as 8-bit codes"
    for name in ours.int8:
        assert torch.equal(ours.int8[name].c, theirs.int8[name].c), name
        assert torch.equal(ours.int8[name].d, theirs.int8[name].d), name


def test_the_configs_are_equal(files):
    """(b) The ModelConfig read from each file's metadata."""
    ours, theirs = checkpoint(files["ours_f32"]), checkpoint(files["llama_cpp_f32"])
    assert ours.config.architecture == files["name"]
    assert ours.config == theirs.config


def test_the_tokenizers_encode_alike(files):
    """The tokenizer the converter wrote (from the HF tokenizer.json) reads
    as the one the test wrote from the same trained tokenizer."""
    ours, theirs = checkpoint(files["ours_f32"]).tokenizer, checkpoint(files["llama_cpp_f32"]).tokenizer
    for text in ["The quick brown fox, 2024 and 3.14159.", "def add(a, b):\n    return a + b\n", "crème brûlée 🦙", "<|im_start|>user"]:
        assert ours.encode(text) == theirs.encode(text), text
        assert theirs.decode(theirs.encode(text), skip_special=False) == text


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_the_logits_are_equal(files, kind):
    """(c) Prompts through DecoderModel (chunked prefill, then greedy
    decode steps): the same logits, bit for bit, from either file."""
    vocab = train_tiny_tokenizer().get_vocab_size()
    gen = np.random.default_rng(7)
    prompts = [[int(t) for t in gen.integers(3, vocab, size=n)] for n in (19, 6)]
    seen = []
    for path in (files[f"ours_{kind}"], files[f"llama_cpp_{kind}"]):
        model = DecoderModel.from_checkpoint(checkpoint(path), max_model_len=256)
        assert model.family.name == files["name"]
        seen.append(run_paged(model, prompts, seed=3))
    (tokens_a, logits_a), (tokens_b, logits_b) = seen
    assert tokens_a == tokens_b
    for a_seq, b_seq in zip(logits_a, logits_b):
        assert [p for p, _ in a_seq] == [p for p, _ in b_seq]
        for (pos, a), (_, b) in zip(a_seq, b_seq):
            np.testing.assert_array_equal(a, b, err_msg=f"{files['name']} {kind}, position {pos}")


# Metadata the converter adds about the file itself, not the model.
_GENERAL = ("general.name", "general.type", "general.size_label", "general.file_type", "general.quantization_version")
# Keys llama.cpp's converter writes that tests/families.py does not (for the
# tiny models, with the values the converter gave them). llama.cpp 0.3.36
# reads both: gemma3.rope.freq_base_swa is the local layers' RoPE base
# (src/models/gemma3.cpp), the padding id comes from the HF config's
# pad_token_id.
_MISSING_IN_OURS = {
    "llama": {"llama.attention.key_length": 16, "llama.attention.value_length": 16, "llama.vocab_size": 360},
    "qwen3": {},
    "gemma3": {"gemma3.rope.freq_base_swa": 10000.0, "tokenizer.ggml.padding_token_id": 0},
}


def test_the_metadata_differs_only_where_listed(files):
    """Apart from general.*, every key the test's file has, llama.cpp's has
    with the same value; what llama.cpp's adds is listed above (llama's are
    what trioserve derives when absent: head size hidden / heads, the
    vocabulary from the tokens)."""
    ours, theirs = read_metadata(files["ours_f32"]), read_metadata(files["llama_cpp_f32"])
    assert theirs["tokenizer.ggml.pre"] == "smollm"
    for key, value in ours.items():
        if key not in _GENERAL:
            assert key in theirs, f"{key} is in the test's file only"
            assert _same(value, theirs[key]), f"{key}: {value!r} in the test's file, {theirs[key]!r} in llama.cpp's"
    added = {k: v for k, v in theirs.items() if k not in ours and k not in _GENERAL}
    assert added == _MISSING_IN_OURS[files["name"]]


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return np.float32(a) == np.float32(b)
    return a == b


def test_gemma3_local_rope_base_comes_from_the_file(tmp_path):
    """A Gemma 3 whose sliding-window layers use another RoPE base than
    10,000: the converter writes it as gemma3.rope.freq_base_swa, and the
    GGUF must load as the HF directory does."""
    built = build_family(tmp_path / "base", "gemma3", tie=True)
    hf = tmp_path / "gemma3-local-base-hf"
    shutil.copytree(built["hf"], hf)
    config = json.loads((hf / "config.json").read_text())
    config["rope_parameters"]["sliding_attention"]["rope_theta"] = 40000.0
    (hf / "config.json").write_text(json.dumps(config))
    converted = convert(hf, tmp_path / "gemma3-local-base.gguf", "f32")
    assert read_metadata(converted)["gemma3.rope.freq_base_swa"] == 40000.0
    from_hf, from_gguf = checkpoint(hf), checkpoint(converted)
    assert from_hf.config.rope_local_theta == 40000.0
    assert from_gguf.config.rope_local_theta == 40000.0

