"""What a quantized or 16-bit GGUF costs in resident memory once the model
is built: its codes (or 16-bit bits) packed once, the head's copy, the
embedding made row by row from the file, no dense copies, and the file's
mapped pages let go.
Measured in a process of its own (bench/random_model.py writes the file;
the types it cannot write, Q4_K and BF16, are written by WRITE below in the
same shape, with the same tokenizer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trioserve.kernels import native, native_build

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import ctypes, gc, json, sys, torch
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.llama import LlamaModel
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
def settled():
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    return status("VmRSS:")
before = settled()
model = LlamaModel.from_checkpoint(load_checkpoint(sys.argv[1], dtype=torch.float32), batch_invariant=True)
grew = settled() - before
print(json.dumps({"grew": grew, "peak": status("VmHWM:") - before, "activations": model.kernels.activations}))
"""
# bench/random_model.py's model (its shape from argv, the default model's tokenizer, weights
# N(0, 0.02)) in Q4_K as llama-quantize leaves a K-quant file (layers and embedding Q4_K, the
# output head Q6_K; tests/k_quants.py, a slice of rows at a time), or in BF16 throughout.
WRITE = """
import importlib.util, sys
import gguf, numpy as np
from tests.k_quants import quantize_q4_k, quantize_q6_k
spec = importlib.util.spec_from_file_location("random_model", "bench/random_model.py")
rm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rm)
Q = gguf.GGMLQuantizationType
kind, hidden, heads, kv_heads, ffn, layers, out = sys.argv[1], *map(int, sys.argv[2:7]), sys.argv[7]
fields = rm.tokenizer_fields(rm.resolve_model_path("smollm2"))
vocab = next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
rng = np.random.default_rng(0)
writer = gguf.GGUFWriter(out, "llama")
for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 8192), (writer.add_embedding_length, hidden),
                   (writer.add_feed_forward_length, ffn), (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                   (writer.add_rope_freq_base, 500000.0), (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_dimension_count, hidden // heads),
                   (writer.add_file_type, 15 if kind == "q4_k" else 32)):
    add(value)
for key, value, vtype, sub in fields:
    writer.add_key_value(key, value, vtype, sub)
def matrix(name, rows, cols, qtype=None):
    qtype = qtype or (Q.Q4_K if kind == "q4_k" else Q.BF16)
    quantize = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}.get(qtype, lambda w: gguf.quants.quantize(w, qtype))
    parts = [quantize((rng.standard_normal((min(4096, rows - at), cols), dtype=np.float32) * 0.02)) for at in range(0, rows, 4096)]
    writer.add_tensor(name, np.concatenate(parts), raw_dtype=qtype)
matrix("token_embd.weight", vocab, hidden)
matrix("output.weight", vocab, hidden, Q.Q6_K if kind == "q4_k" else None)
writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
hd = hidden // heads
for i in range(layers):
    for norm in ("attn_norm", "ffn_norm"):
        writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv_heads * hd, hidden), ("attn_v", kv_heads * hd, hidden),
                             ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
        matrix(f"blk.{i}.{name}.weight", rows, cols)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_k", "f16", "bf16"])
def test_a_quantized_or_16_bit_model_holds_about_its_file_size(tmp_path, qtype):
    sixteen = qtype in ("f16", "bf16")
    if not sixteen and not native.int4_q8_supported(16, 32):
        pytest.skip("no int8-activation C kernel here: the 4- and 8-bit rows need dense weights")
    if native_build.library() is None:
        pytest.skip("the C kernels do not build here (no C compiler): F16 layers are held in float32")
    path = tmp_path / "m.gguf"
    if qtype in ("q4_k", "bf16"):
        made = subprocess.run(
            [sys.executable, "-c", WRITE, qtype, "1024", "8", "4", "4096", "4", str(path)], capture_output=True, text=True, timeout=600, cwd=ROOT
        )
    else:
        made = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "random_model.py"), "--shape", "tiny", "--hidden", "1024", "--heads", "8",
             "--kv-heads", "4", "--ffn", "4096", "--layers", "4", "--type", qtype, "-o", str(path)],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )  # fmt: skip
    assert made.returncode == 0, made.stderr
    probe = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert probe.returncode == 0, probe.stderr
    report = json.loads(probe.stdout.splitlines()[-1])
    size = path.stat().st_size  # Q4_0 ~150 MB: 59 M weights in Q4_0, embedding and head in Q8_0; Q8_0 ~250 MB; F16 ~420 MB
    assert report["activations"] == ("bf16" if sixteen else "int8")
    # float32 copies of every weight, as before, would be ~630 MB (4x a Q4_0 file). What a
    # Q4_0 model holds: codes and the 8-bit head (~86 MB), and what any model of this
    # vocabulary has (tokenizer, metadata, RoPE tables: the other ~86 MB seen here);
    # a Q8_0 one its codes at the file's size, an F16 one the file's bits: within 1.2x the
    # file plus 64 MB.
    assert report["grew"] <= 1.2 * size + (64 << 20), (report["grew"] / 2**20, size / 2**20)
    # While loading, at most: the file's pages mapped as they are read, what is made of them,
    # and the tokenizer's and a slice's temporaries; never a float copy of a whole matrix
    # (the 8-bit head of this one's vocabulary, made dense first, was 200 MB of float32).
    assert report["peak"] <= 2 * size + (160 << 20), (report["peak"] / 2**20, size / 2**20)
