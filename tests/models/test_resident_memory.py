"""What a quantized or 16-bit GGUF costs in resident memory once the model
is built: its codes (or 16-bit bits) packed once, the head's copy, the
embedding made row by row from the file, no dense copies, and the file's
mapped pages let go.
Measured in a process of its own (bench/random_model.py writes the file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trioserve.kernels import native

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


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "f16"])
def test_a_quantized_or_16_bit_model_holds_about_its_file_size(tmp_path, qtype):
    if qtype != "f16" and not native.int4_q8_supported(16, 32):
        pytest.skip("no int8-activation C kernel here: the 4- and 8-bit rows need dense weights")
    if native.library() is None:
        pytest.skip("the C kernels do not build here (no C compiler): F16 layers are held in float32")
    path = tmp_path / "m.gguf"
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
    assert report["activations"] == ("bf16" if qtype == "f16" else "int8")
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
