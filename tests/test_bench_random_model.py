"""bench/random_model.py: a GGUF of a given Llama shape with random weights
and the default model's tokenizer, in the types it writes itself; the
loader reads back that shape, those types and that tokenizer. Its main()
runs in this process for each type (the tokenizer's fields read from the
default model once for the module, not once a file: ~2 s each); the
script's refusal runs as a user runs it, in a process of its own."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from trioserve.models.checkpoint import load_checkpoint, resolve_model_path

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_checkpoint(resolve_model_path("smollm2")).tokenizer


@pytest.fixture(scope="module")
def random_model():
    """bench/random_model.py as a module (its sys.path change undone), its
    tokenizer_fields kept for each source file once read."""
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location("random_model", ROOT / "bench" / "random_model.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    module.tokenizer_fields = functools.lru_cache(module.tokenizer_fields)
    return module


@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "f16"])
def test_it_writes_the_shape_and_type_asked_with_smollm2s_tokenizer(tmp_path, kind, smollm2_tokenizer, random_model, capsys):
    out = tmp_path / f"m-{kind}.gguf"
    assert random_model.main(["--shape", "tiny", "--ffn", "96", "--type", kind, "-o", str(out)]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["path"] == str(out) and report["bytes"] == out.stat().st_size
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_up.weight"] == kind.upper() and types["blk.1.attn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == ("F16" if kind == "f16" else "Q8_0")
    ckpt = load_checkpoint(out)
    cfg = ckpt.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (64, 2, 4, 2, 96)
    text = "The capital of France is Paris."
    assert ckpt.tokenizer.encode(text) == smollm2_tokenizer.encode(text) and ckpt.tokenizer.vocab_size == 49152


def test_a_k_quant_without_llama_quantize_is_refused_by_name(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "random_model.py"), "--shape", "tiny", "--type", "q4_k_m", "-o", str(tmp_path / "x.gguf")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and "--type q4_k_m: this writes f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0 itself; other types need --llama-quantize PATH" in done.stderr
