"""Write a GGUF of any Llama shape with random weights and the default
model's tokenizer and chat template, for benchmarks of models bigger than
the default one (speed does not depend on the weights' values; serve the
load with ``ignore_eos``).

    .venv/bin/python bench/random_model.py --shape 1b --type q4_0 -o bench/out/random-1b-q4_0.gguf
    .venv/bin/python bench/random_model.py --shape 3b --type q4_k_m --llama-quantize ~/llama.cpp/build/bin/llama-quantize -o ...

Shapes: ``1b`` (Llama-3.2-1B's: hidden 2048, 16 layers, 32 heads, 8 KV
heads, FFN 8192), ``3b`` (hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN
8192), ``8b`` (Llama-3.1-8B's: hidden 4096, 32 layers, 32 heads, 8 KV heads,
FFN 14336; ~16 GB of F16 written on the way to a K-quant), ``tiny`` (for a test), or ``--hidden/--layers/--heads/--kv-heads/--ffn``.
The vocabulary is SmolLM2's (49,152 tokens), its tokenizer and template read
from the default model's GGUF. Types this writes itself with the ``gguf``
package: f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0 (the embedding and output
head q8_0 unless f32/f16, as llama.cpp's converter leaves them for such
files). K-quant types (q4_k_m, q5_k_m, q6_k, ...) go through llama.cpp's
``llama-quantize`` (``--llama-quantize PATH``) from an f16 file written first.
Prints the output's path and size as its last line (JSON)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trioserve.models.checkpoint import resolve_model_path  # noqa: E402

SHAPES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
}
Q = gguf.GGMLQuantizationType
DIRECT = {"f32": Q.F32, "f16": Q.F16, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q8_0": Q.Q8_0}


def tokenizer_fields(source: Path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """Every ``tokenizer.*`` field of ``source`` as (key, value, type, sub type)."""
    reader = gguf.GGUFReader(str(source))
    out = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((name, field.contents(), vtype, sub))
    return out


def _tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    if array.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def write_random_gguf(path: Path, shape: dict[str, int], qtype: gguf.GGMLQuantizationType, *, seed: int = 0,
                      source: Path | None = None, context: int = 8192, log=print) -> Path:  # fmt: skip
    """Write the model; the big matrices in ``qtype``, the embedding and the
    output head in q8_0 for quantized types (f16/f32 otherwise), norms f32."""
    source = source or resolve_model_path("smollm2")
    fields = tokenizer_fields(source)
    vocab = next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
    hidden, layers, heads, kv_heads, ffn = (shape[k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn"))
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    edge = qtype if qtype in (Q.F32, Q.F16) else Q.Q8_0

    def rand(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random-llama-{hidden}x{layers}")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(int(qtype) if qtype in (Q.F32, Q.F16) else {Q.Q4_0: 2, Q.Q4_1: 3, Q.Q5_0: 8, Q.Q5_1: 9, Q.Q8_0: 7}[qtype])
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub)
    started = time.monotonic()
    _tensor(writer, "token_embd.weight", rand(vocab, hidden), edge)
    _tensor(writer, "output.weight", rand(vocab, hidden), edge)
    _tensor(writer, "output_norm.weight", np.ones(hidden, np.float32), Q.F32)
    for i in range(layers):
        blk = f"blk.{i}"
        _tensor(writer, f"{blk}.attn_norm.weight", np.ones(hidden, np.float32), Q.F32)
        _tensor(writer, f"{blk}.ffn_norm.weight", np.ones(hidden, np.float32), Q.F32)
        _tensor(writer, f"{blk}.attn_q.weight", rand(heads * head_dim, hidden), qtype)
        _tensor(writer, f"{blk}.attn_k.weight", rand(kv_heads * head_dim, hidden), qtype)
        _tensor(writer, f"{blk}.attn_v.weight", rand(kv_heads * head_dim, hidden), qtype)
        _tensor(writer, f"{blk}.attn_output.weight", rand(hidden, heads * head_dim), qtype)
        _tensor(writer, f"{blk}.ffn_gate.weight", rand(ffn, hidden), qtype)
        _tensor(writer, f"{blk}.ffn_up.weight", rand(ffn, hidden), qtype)
        _tensor(writer, f"{blk}.ffn_down.weight", rand(hidden, ffn), qtype)
        log(f"random_model: layer {i + 1}/{layers} ({time.monotonic() - started:.0f} s)")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    for name in ("hidden", "layers", "heads", "kv-heads", "ffn"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the shape's {name}")
    p.add_argument("--type", default="q4_0", help=f"{', '.join(DIRECT)}, or a llama-quantize type (q4_k_m, q5_k_m, q6_k, ...)")
    p.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize, for the types this cannot write itself")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    for name in ("hidden", "layers", "heads", "kv_heads", "ffn"):
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    kind = args.type.lower()
    if kind in DIRECT:
        write_random_gguf(out, shape, DIRECT[kind], seed=args.seed, log=log)
    else:
        if not args.llama_quantize:
            p.error(f"--type {kind}: this writes {', '.join(DIRECT)} itself; other types need --llama-quantize PATH")
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            f16 = write_random_gguf(Path(tmp) / "f16.gguf", shape, Q.F16, seed=args.seed, log=log)
            subprocess.run([args.llama_quantize, str(f16), str(out), kind.upper()], check=True, timeout=3600)
    print(json.dumps({"path": str(out), "bytes": out.stat().st_size, "shape": shape, "type": kind}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
