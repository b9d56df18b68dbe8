"""A float32 safetensors copy of a GGUF model, for a peer that cannot read
GGUF (vLLM's CPU backend). Run it with the peer's own Python, which has
transformers (not a trioserve dependency):

    /path/to/vllm-venv/bin/python bench/to_safetensors.py MODEL.gguf OUT_DIR

transformers dequantizes the GGUF's tensors as it loads them; a model it
loaded from GGUF refuses `save_pretrained`, so the weights are moved into a
plain model of the same config, which saves. The tokenizer comes from the
same file. Needs transformers, gguf and accelerate in that Python (vLLM
brings transformers). Nothing is downloaded."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# bench/ is on sys.path as this script's folder, and its profile.py would
# stand in for the standard library's module of that name, which
# transformers imports (through cProfile).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = str(args.gguf.parent), args.gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    config.torch_dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if [m for m in missing if not m.endswith("lm_head.weight")] or unexpected:
        raise SystemExit(f"weights do not match: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.save_pretrained(args.out, safe_serialization=True)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(args.out)
    print(f"{args.out}: {sum(p.numel() for p in plain.parameters()):,} parameters, float32")


if __name__ == "__main__":
    main()
