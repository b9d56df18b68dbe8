"""SentencePiece ("llama") vocabularies for the tests, and GGUF files that
hold them the way llama.cpp's converter writes them: `tokenizer.ggml.tokens`,
`.scores`, `.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte), the special ids and flags.

- `llama_like_vocab()`: Llama-2-shaped (<unk>, <s>, </s>, the 256 byte pieces,
  then pieces best score first), learned in-process from a small ASCII-heavy
  corpus with the `tokenizers` BPE trainer, every score distinct; plus a few
  whitespace runs, two control pieces, a user-defined and an unused one.
- `sentencepiece_vocab()`: a real SentencePiece BPE model with byte fallback,
  trained in-process (needs the `sentencepiece` package), and its processor.
- `spm_metadata()` / `write_spm_gguf()`: any such vocabulary as GGUF
  metadata, and as a GGUF file (metadata only, no tensors), which both
  trioserve and `transformers` read."""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from tests.tiny_model import add_metadata
from tests.tiny_tokenizer import CORPUS

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Llama 2
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# Extra pieces of llama_like_vocab(), at the end of the vocabulary.
CONTROL_PIECES = ["<|im_start|>", "<|im_end|>"]
USER_PIECE = "<tool>"
UNUSED_PIECE = "<unused0>"

EXTRA_CORPUS = [
    "Streaming text back to the client, one token at a time, never breaks a character.",
    "Spaces    and\ttabs, new\nlines and  double  spaces matter to a tokenizer.",
    "Les élèves étudient à l'école; el niño está aquí; über Straße.",
    "Hello there! The server answers quickly, and the answer is correct.",
]


def byte_pieces() -> list[str]:
    return [f"<0x{b:02X}>" for b in range(256)]


@dataclass
class SpmVocab:
    """Pieces, their scores and types, index = id."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    meta: dict[str, Any] = field(default_factory=dict)  # extra GGUF keys

    def id_of(self, piece: str) -> int:
        return self.tokens.index(piece)


def _learned_pieces(corpus: list[str], vocab_size: int) -> tuple[list[str], list[str]]:
    """The merged pieces in the order the trainer learned them, and the
    single characters, from a Metaspace BPE trained on `corpus`."""
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False)
    trained.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    merged: list[str] = []
    for pair in model["merges"]:
        a, b = pair if isinstance(pair, list) else pair.split(" ", 1)
        if a + b not in merged:
            merged.append(a + b)
    chars = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if len(t) == 1]
    return merged, chars


@functools.cache
def _llama_like() -> SpmVocab:
    merged, chars = _learned_pieces(CORPUS + EXTRA_CORPUS, 420)
    # Like Llama 2: no piece for a newline or a tab (they fall back to bytes).
    keep = [p for p in merged if not any(c in p for c in "\n\t\r")]
    chars = [c for c in chars if c not in "\n\t\r"]
    scored = [(p, -float(k)) for k, p in enumerate(keep)]
    # Whitespace runs between the learned pieces, every score still distinct.
    scored += [(SPACE * 2, -2.5), (SPACE * 3, -30.5), (SPACE * 4, -60.5)]
    scored.sort(key=lambda ps: -ps[1])
    base = -float(len(keep) + 10)
    scored += [(c, base - k) for k, c in enumerate(chars) if c not in {p for p, _ in scored}]
    tokens = SPECIALS + byte_pieces() + [p for p, _ in scored]
    scores = [0.0] * (3 + 256) + [s for _, s in scored]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(scored)
    for piece, kind in [*((p, CONTROL) for p in CONTROL_PIECES), (USER_PIECE, USER_DEFINED), (UNUSED_PIECE, UNUSED)]:
        tokens.append(piece)
        scores.append(0.0)
        types.append(kind)
    return SpmVocab(tokens, scores, types)


def llama_like_vocab() -> SpmVocab:
    """A fresh copy of the Llama-2-shaped test vocabulary (the same every call)."""
    v = _llama_like()
    return SpmVocab(list(v.tokens), list(v.scores), list(v.types), dict(v.meta))


def sentencepiece_vocab(vocab_size: int = 700) -> tuple[SpmVocab, Any]:
    """A SentencePiece BPE model trained here as Llama 2's was set up (byte
    fallback, identity normalization, no whitespace collapsing, a dummy
    prefix, digits split), as a vocabulary plus its SentencePieceProcessor.
    Raises ImportError without the `sentencepiece` package."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS + EXTRA_CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=-1,
        control_symbols=CONTROL_PIECES,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        if sp.is_unknown(i):
            types.append(UNKNOWN)
        elif sp.is_control(i):
            types.append(CONTROL)
        elif sp.is_byte(i):
            types.append(BYTE)
        elif sp.is_unused(i):
            types.append(UNUSED)
        else:
            types.append(NORMAL)
    return SpmVocab(tokens, scores, types), sp


def spm_metadata(
    vocab: SpmVocab,
    *,
    bos: int | None = BOS_ID,
    eos: int | None = EOS_ID,
    unk: int | None = UNK_ID,
    add_space_prefix: bool | None = None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    types: bool = True,
    chat_template: str | None = None,
) -> dict[str, Any]:
    """The GGUF `tokenizer.*` keys for `vocab`; a None leaves that key out."""
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": list(vocab.tokens),
        "tokenizer.ggml.scores": list(vocab.scores),
    }
    if types:
        meta["tokenizer.ggml.token_type"] = list(vocab.types)
    for key, value in [
        ("tokenizer.ggml.bos_token_id", bos),
        ("tokenizer.ggml.eos_token_id", eos),
        ("tokenizer.ggml.unknown_token_id", unk),
        ("tokenizer.ggml.add_space_prefix", add_space_prefix),
        ("tokenizer.ggml.add_bos_token", add_bos),
        ("tokenizer.ggml.add_eos_token", add_eos),
        ("tokenizer.chat_template", chat_template),
    ]:
        if value is not None:
            meta[key] = value
    meta.update(vocab.meta)
    return meta


def write_spm_gguf(path: Path, meta: dict[str, Any], *, arch: str = "llama") -> Path:
    """A GGUF file holding `meta` (and `general.architecture`), no tensors."""
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    add_metadata(writer, meta)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
