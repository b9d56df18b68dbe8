"""What an arithmetic costs in answers: greedy replies of the default model
to 16 chat prompts under each variant, against a float32 model with the
4-bit weights dequantized (the checkpoint's own numbers, computed as exactly
as this machine can), and optionally against another server's greedy
replies (llama.cpp's `llama-server` on the same GGUF: its own arithmetic).

For each variant: how many replies are identical to the float32 ones, and
the mean number of leading tokens they share (of ``--max-tokens``). Variants:
    bf16act   the served configuration with --activations bf16
    int8act   the served configuration with --activations int8
Both batch-invariant, bf16 weights, 4-bit projections for generated tokens.

    .venv/bin/python bench/agreement.py [--max-tokens 64] [--peer-url http://127.0.0.1:PORT]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import torch

from trioserve.kernels.cpu import resolve_dtype
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step
from trioserve.state.kv_pool import BlockPool

BLOCK = 16
PROMPTS = (
    "What is the capital of France?",
    "Name a primary color.",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "How many legs does a spider have?",
    "Give me three tips for sleeping better.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in one sentence.",
    "What does a compiler do?",
    "List the planets of the solar system.",
    "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet turtle.",
)


def greedy(model: DecoderModel, stop_ids, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy replies, each sequence alone (batch-invariant models give the
    same bits in company; this keeps the float32 reference simple)."""
    out = []
    for prompt in prompts:
        pool = BlockPool((len(prompt) + max_tokens) // BLOCK + 2, BLOCK)
        cache = model.new_kv_cache(pool.num_blocks, BLOCK)
        table = pool.grow(0, len(prompt) + max_tokens)
        logits = model.forward(build_step([SeqChunk(prompt, 0, table)], BLOCK, fixed=model.batch_invariant), cache)
        reply: list[int] = []
        while True:
            token = int(logits[0].argmax())
            if token in stop_ids or len(reply) == max_tokens:
                break
            reply.append(token)
            step = build_step([SeqChunk([token], len(prompt) + len(reply) - 1, table, decode=True)], BLOCK, fixed=model.batch_invariant)
            logits = model.forward(step, cache)
        out.append(reply)
    return out


def peer_replies(url: str, questions, max_tokens: int) -> list[str]:
    texts = []
    for q in questions:
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens, "temperature": 0, "stream": False}
        request = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            texts.append(json.load(response)["choices"][0]["message"]["content"])
    return texts


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--peer-url", default=None, help="an OpenAI-compatible server on the same GGUF to compare with too")
    args = parser.parse_args()

    exact = load_checkpoint("smollm2", dtype=torch.float32)
    tok = exact.tokenizer
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    prompts = [tok.encode(template.render([{"role": "user", "content": q}])) for q in PROMPTS]
    reference = greedy(DecoderModel.from_checkpoint(exact, use_int4=False, batch_invariant=True), tok.stop_ids, prompts, args.max_tokens)
    del exact
    served = load_checkpoint("smollm2", dtype=resolve_dtype("auto"))
    replies = {"float32": reference}
    for name, activations in (("bf16act", "bf16"), ("int8act", "int8")):
        model = DecoderModel.from_checkpoint(served, batch_invariant=True, activations=activations)
        replies[name] = greedy(model, tok.stop_ids, prompts, args.max_tokens)
        del model
    texts = {name: [tok.decode(r) for r in rs] for name, rs in replies.items()}
    if args.peer_url:
        texts["peer"] = peer_replies(args.peer_url, PROMPTS, args.max_tokens)

    result = {}
    print(f"# {len(PROMPTS)} chat prompts, greedy, up to {args.max_tokens} tokens")
    print("| variant | identical to float32 | mean shared leading tokens | identical to the peer |")
    print("|---|---|---|---|")
    for name in ("bf16act", "int8act"):
        same = sum(a == b for a, b in zip(replies[name], reference))
        lead = sum(shared(a, b) for a, b in zip(replies[name], reference)) / len(PROMPTS)
        row = {"identical": same, "mean_shared_tokens": round(lead, 1)}
        peer = ""
        if "peer" in texts:
            row["identical_to_peer"] = sum(a.strip() == b.strip() for a, b in zip(texts[name], texts["peer"]))
            peer = f"{row['identical_to_peer']} of {len(PROMPTS)}"
        result[name] = row
        print(f"| {name} | {same} of {len(PROMPTS)} | {lead:.1f} | {peer} |")
    if "peer" in texts:
        result["float32_identical_to_peer"] = sum(a.strip() == b.strip() for a, b in zip(texts["float32"], texts["peer"]))
        print(f"# float32 replies identical to the peer's: {result['float32_identical_to_peer']} of {len(PROMPTS)}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
