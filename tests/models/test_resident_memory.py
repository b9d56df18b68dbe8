"""What a quantized or 16-bit GGUF costs in resident memory once the model
is built: its codes (or 16-bit bits) packed once, the head's copy, the
embedding made row by row from the file, no dense copies, and the file's
mapped pages let go.
Measured in a process of its own, a fresh one for each file. The files are
written by one writer process for the whole module (WRITER below, started
once, so the default model's tokenizer is read once, not once a file):
bench/random_model.py's write_random_gguf for the types it writes, and the
same shape with the same tokenizer in Q4_K and BF16, which it cannot write."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

import pytest

from trioserve.kernels import native, native_build

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import ctypes, gc, json, sys, torch
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
def settled():
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    return status("VmRSS:")
before = settled()
model = DecoderModel.from_checkpoint(load_checkpoint(sys.argv[1], dtype=torch.float32), batch_invariant=True)
grew = settled() - before
print(json.dumps({"grew": grew, "peak": status("VmHWM:") - before, "activations": model.kernels.activations}))
"""
# One process writes every file of the module, each on request (a line of JSON on its stdin:
# [kind, path]; its answer a line of JSON on its stdout). bench/random_model.py's model
# (hidden 1024, 8 heads, 4 KV heads, FFN 4096, 4 layers, the default model's tokenizer,
# weights N(0, 0.02), seed 0: the bytes `random_model.py --shape tiny --hidden 1024 ...`
# writes) in Q4_0, Q8_0 or F16 by its write_random_gguf; in Q4_K as llama-quantize leaves a
# K-quant file (layers and embedding Q4_K, the output head Q6_K; tests/k_quants.py, a slice
# of rows at a time), or in BF16 throughout, by write_k_or_bf16. The tokenizer's fields are
# read from the default model's file once (~2 s each time) and kept for every file.
WRITER = """
import functools, importlib.util, json, os, sys, traceback
from pathlib import Path
import gguf, numpy as np
from tests.k_quants import quantize_q4_k, quantize_q6_k
spec = importlib.util.spec_from_file_location("random_model", "bench/random_model.py")
rm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rm)
rm.tokenizer_fields = functools.lru_cache(rm.tokenizer_fields)
Q = gguf.GGMLQuantizationType
SHAPE = dict(hidden=1024, heads=8, kv_heads=4, ffn=4096, layers=4)
def write_k_or_bf16(kind, hidden, heads, kv_heads, ffn, layers, out):
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
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # whatever else is printed goes to stderr, not into the answers
for line in sys.stdin:
    kind, out = json.loads(line)
    try:
        if kind in ("q4_k", "bf16"):
            write_k_or_bf16(kind, *(SHAPE[k] for k in ("hidden", "heads", "kv_heads", "ffn", "layers")), out)
        else:
            rm.write_random_gguf(Path(out), SHAPE, rm.DIRECT[kind], seed=0, log=lambda text: print(text, file=sys.stderr, flush=True))
        answers.write(json.dumps({"ok": True}) + "\\n")
    except Exception:
        answers.write(json.dumps({"error": traceback.format_exc()}) + "\\n")
    answers.flush()
os._exit(0)  # stdin closed: the files are written and closed, nothing to tear down
"""
WRITE_S = 600  # a hang guard for one file


class Writer:
    """The WRITER process, started at the first file: ``write(kind, path)``
    writes one file, or fails the test with the writer's traceback and the
    tail of its stderr."""

    def __init__(self, log: Path) -> None:
        self.log_path = log
        self.log = None
        self.proc: subprocess.Popen[str] | None = None

    def stderr_tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def write(self, kind: str, path: Path) -> None:
        if self.proc is None:
            self.log = self.log_path.open("w")
            self.proc = subprocess.Popen([sys.executable, "-c", WRITER], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.log, text=True)  # fmt: skip
        self.proc.stdin.write(json.dumps([kind, str(path)]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], WRITE_S)
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"the writer gave no answer for {kind} (exit status {self.proc.poll()}):\n{self.stderr_tail()}"
        answer = json.loads(line)
        assert "error" not in answer, f"{answer['error']}\n{self.stderr_tail()}"

    def close(self) -> None:
        if self.proc is None:
            return
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


@pytest.fixture(scope="module")
def writer(tmp_path_factory):
    started = Writer(tmp_path_factory.mktemp("writer") / "stderr.log")
    try:
        yield started
    finally:
        started.close()


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_k", "f16", "bf16"])
def test_a_quantized_or_16_bit_model_holds_about_its_file_size(tmp_path, qtype, writer):
    sixteen = qtype in ("f16", "bf16")
    if not sixteen and not native.int4_q8_supported(16, 32):
        pytest.skip("no int8-activation C kernel here: the 4- and 8-bit rows need dense weights")
    if native_build.library() is None:
        pytest.skip("the C kernels do not build here (no C compiler): F16 layers are held in float32")
    path = tmp_path / "m.gguf"
    writer.write(qtype, path)
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
