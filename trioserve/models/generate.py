"""Single-sequence generation for the command line: prefill, then decode until
a stop id or the token limit. The serving path is the engine's scheduler; this
is the plain loop it generalizes, and what `trioserve generate` runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from trioserve.models.detokenizer import IncrementalDetokenizer
from trioserve.models.llama import LlamaModel
from trioserve.models.step import SeqChunk, build_step
from trioserve.models.tokenizer import Tokenizer
from trioserve.state.kv_pool import DEFAULT_BLOCK_SIZE, BlockPool, blocks_needed

PREFILL_CHUNK = 512


@attrs.frozen
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (a stop id) or "length"
    prompt_tokens: int


def generate(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    on_text: Callable[[str], None] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Generation:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids``. Temperature 0
    is greedy; otherwise tokens are drawn from a generator seeded with
    ``seed``. ``on_text`` receives text as it becomes complete."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    total = len(prompt_ids) + max_tokens
    if total > model.config.max_position:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the model's context of {model.config.max_position}"
        )
    pool = BlockPool(blocks_needed(total, block_size), block_size)
    cache = model.new_kv_cache(pool.num_blocks, block_size)
    table = pool.grow("cli", total)
    rng = torch.Generator().manual_seed(seed)
    detok = IncrementalDetokenizer(tokenizer)
    pieces: list[str] = []

    def emit(text: str) -> None:
        if text:
            pieces.append(text)
            if on_text is not None:
                on_text(text)

    logits = None
    for start in range(0, len(prompt_ids), PREFILL_CHUNK):
        chunk = list(prompt_ids[start : start + PREFILL_CHUNK])
        logits = model.forward(build_step([SeqChunk(chunk, start, table)], block_size), cache)
    out: list[int] = []
    finish = "length"
    while len(out) < max_tokens:
        token = _pick(logits[0], temperature, rng)
        if token in tokenizer.stop_ids:
            finish = "stop"
            break
        out.append(token)
        emit(detok.push(token))
        if len(out) == max_tokens:
            break
        step = build_step([SeqChunk([token], len(prompt_ids) + len(out) - 1, table, decode=True)], block_size)
        logits = model.forward(step, cache)
    emit(detok.flush())
    pool.free_sequence("cli")
    return Generation(out, "".join(pieces), finish, len(prompt_ids))


def _pick(logits: torch.Tensor, temperature: float, rng: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=rng))
