"""trioserve: an OpenAI-compatible LLM inference server on trio."""

import os

__version__ = "0.1.0"

# One instruction set for torch's oneDNN matmuls on every x86 CPU, so a
# model's outputs do not depend on which processor generation runs it: on
# CPUs with AMX, oneDNN otherwise accumulates bf16 products in another order,
# and SmolLM2's greedy answer changes ("The capital of France is Paris."
# becomes "L'Étoile, ..."), which would break replaying a trace recorded on
# another machine. Set before torch's first oneDNN call (oneDNN reads it
# once); an operator's own ONEDNN_MAX_CPU_ISA wins. See docs/configuration.md.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
