"""Text <-> token ids for a checkpoint, built from GGUF metadata or a Hugging Face
tokenizer directory.

The splitting and merging is done by the `tokenizers` library; this module owns
turning checkpoint metadata into one configured `tokenizers.Tokenizer`, the
special-token bookkeeping (BOS, EOS, stop ids, which ids are control tokens)
and the exact bytes behind every id, which the detokenizer streams from.

Three kinds of GGUF vocabulary load: byte-level BPE (`tokenizer.ggml.model`
"gpt2"), SentencePiece ("llama": Llama 2, Mistral, Gemma) and WordPiece
("bert": BERT encoders such as bge, e5, all-MiniLM). SentencePiece is split
and merged by trioserve.models.spm, in Python, exactly as llama.cpp does (a
rank-ordered `tokenizers` BPE differs where scores tie); WordPiece is
normalized, split and matched by trioserve.models.wpm as llama.cpp's WPM
tokenizer does it (which differs from Hugging Face's in places: see there).
For both a `tokenizers` twin is kept for its vocabulary and for the
libraries that read one (llguidance); a WordPiece twin also decodes.

Special (control) tokens come only from text the server itself writes: a
chat template's output is encoded with `encode_rendered`, where the pieces a
request brought that spell a control token stand behind placeholders and are
tokenized as the text they are. `encode(text, special=False)` encodes any
text that way; the default still turns special-token text into its id.

Long texts are encoded through the `tokenizers` batch call, which releases
the GIL while it works, so a thread encoding a huge prompt does not stall
the event loop. (SentencePiece encoding holds it: about 0.7 s a megabyte
of new text, a tenth of that for words seen before.)"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from trioserve.errors import TokenizerError
from trioserve.models.files import MAX_JSON, MAX_TEMPLATE, MAX_TOKENIZER_JSON, FileRefused, read_text
from trioserve.models.spm import SPACE, SpmVocab
from trioserve.models.wpm import WpmVocab

# Token types in GGUF's tokenizer.ggml.token_type that are matched as whole ids.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# End-of-turn pieces llama.cpp recognises by their text (Gemma's
# <end_of_turn>, which files do not name as EOT): a SentencePiece
# vocabulary's control pieces among them stop generation too.
_EOT_TEXTS = frozenset(
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "<|eom_id|>"]
)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# Texts at least this long are encoded with the GIL released (same ids).
_LONG_TEXT = 2048


def _encode_with(backend: tokenizers.Tokenizer, text: str) -> list[int]:
    if len(text) < _LONG_TEXT:
        return backend.encode(text, add_special_tokens=False).ids
    return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible table from each byte to a printable character: bytes
    that are already printable keep their code point, the rest are moved to
    256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}
# The same table for str.translate, each byte as the one Latin-1 character
# that encodes to it: a piece made only of the table's characters is its
# bytes in two C calls (`_piece_bytes`), not one Python step a character.
_BYTE_LEVEL_CHARS = frozenset(_UNICODE_TO_BYTE)
_TO_LATIN1 = {ord(c): chr(b) for c, b in _UNICODE_TO_BYTE.items()}


def _piece_bytes(piece: str) -> bytes:
    """A byte-level BPE piece's bytes: each character through GPT-2's table,
    a character outside it as its own UTF-8."""
    if _BYTE_LEVEL_CHARS.issuperset(piece):
        return piece.translate(_TO_LATIN1).encode("latin-1")
    return b"".join(bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode() for c in piece)


def _byte_level_pre(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for the GGUF `tokenizer.ggml.pre` name;
    unknown names get GPT-2's byte-level regex."""
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in ("llama-bpe", "qwen2"):
        split = _LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _require(meta: Mapping[str, Any], key: str) -> Any:
    """`meta[key]`, or TokenizerError naming the missing key."""
    if key not in meta:
        raise TokenizerError(f"tokenizer metadata lacks {key!r}")
    return meta[key]


class Tokenizer:
    """A checkpoint's tokenizer. Build it with `from_gguf_metadata` or
    `from_hf_dir`; the constructor only wires up parts already checked."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        byte_level: bool,
        bos_id: int | None,
        eos_id: int,
        extra_stop_ids: Sequence[int] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
        spm: SpmVocab | None = None,
        add_eos: bool = False,
        wpm: WpmVocab | None = None,
        end_id: int | None = None,
    ) -> None:
        """`end_id`: the id `encode` appends where the checkpoint adds one at
        the end (default `eos_id`; a WordPiece GGUF's [SEP])."""
        self._backend = backend
        self.byte_level = byte_level
        # A SentencePiece or WordPiece vocabulary from GGUF encodes itself
        # (llama.cpp's way); `backend` is then its `tokenizers` twin.
        self._spm = spm
        self._wpm = wpm
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        for name, tid in [("bos", bos_id), ("eos", eos_id), ("end", end_id), *(("stop", t) for t in extra_stop_ids)]:
            if tid is not None and not (isinstance(tid, int) and 0 <= tid < self.vocab_size):
                raise TokenizerError(f"{name} token id {tid} is outside the vocabulary of {self.vocab_size}")
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids: frozenset[int] = frozenset([eos_id, *extra_stop_ids])
        self.add_bos = bool(add_bos) and bos_id is not None
        self.add_eos = bool(add_eos)
        self._end_id = eos_id if end_id is None else end_id
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self._special = frozenset(i for i, t in added.items() if t.special)
        specials = sorted((i, t) for i, t in added.items() if t.special and t.content)
        self.special_tokens: tuple[str, ...] = tuple(t.content for _, t in specials)  # in id order
        longest_first = sorted(specials, key=lambda item: -len(item[1].content))
        self._special_split = _special_pattern([t for _, t in longest_first])
        self._special_ids = [i for i, _ in longest_first]  # by the pattern's group number - 1
        self._plain_backend: tokenizers.Tokenizer | None = None
        self._plain_lock = threading.Lock()
        self._twin_json: str | None = None
        if spm is not None or wpm is not None:
            self._bytes = spm.token_bytes() if spm is not None else wpm.token_bytes()
            if len(self._bytes) != self.vocab_size:
                raise TokenizerError(f"{len(self._bytes)} pieces but a vocabulary of {self.vocab_size}")
        else:
            self._bytes = [self._compute_bytes(i, added) for i in range(self.vocab_size)]
        self.bos_token: str | None = None if bos_id is None else self._text_of(bos_id)
        self.eos_token: str = self._text_of(eos_id)

    def _text_of(self, token_id: int) -> str:
        return self._bytes[token_id].decode("utf-8", errors="replace")

    def _compute_bytes(self, token_id: int, added: Mapping[int, AddedToken]) -> bytes:
        """The bytes one id stands for: added tokens are their own UTF-8 text;
        byte-level pieces go back through GPT-2's table; SentencePiece-style
        pieces map `<0xNN>` to a byte and `▁` to a space (a best effort: the
        detokenizer does not rely on it for non-byte-level tokenizers)."""
        if token_id in added:
            return added[token_id].content.encode()
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self.byte_level:
            return _piece_bytes(piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """A tokenizer from GGUF `tokenizer.*` metadata: byte-level BPE
        (`tokenizer.ggml.model` "gpt2"), SentencePiece ("llama") or WordPiece
        ("bert"); raises TokenizerError for other tokenizer models or
        missing/inconsistent keys."""
        kind = _require(meta, "tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_spm(meta)
        if kind == "bert":
            return cls._from_gguf_wpm(meta)
        if kind != "gpt2":
            raise TokenizerError(
                f"tokenizer model {kind!r} is not supported (only 'gpt2', byte-level BPE, 'llama', SentencePiece, "
                "and 'bert', WordPiece)"
            )
        tokens = list(_require(meta, "tokenizer.ggml.tokens"))
        merges = list(_require(meta, "tokenizer.ggml.merges"))
        types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        if len(types) != len(tokens):
            raise TokenizerError(f"{len(types)} token types for {len(tokens)} tokens")
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep or a not in vocab or b not in vocab:
                raise TokenizerError(f"merge {m!r} does not name two tokens of the vocabulary")
            pairs.append((a, b))
        pre = meta.get("tokenizer.ggml.pre")
        try:
            bpe = models.BPE(vocab, pairs, ignore_merges=pre == "llama-bpe")
        except Exception as exc:  # the Rust side reports any inconsistency as a plain Exception
            raise TokenizerError(f"cannot build BPE from the vocabulary and merges: {exc}") from exc
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _byte_level_pre(pre)
        backend.decoder = decoders.ByteLevel()
        # Control tokens are special; user-defined ones (e.g. Qwen's
        # <tool_call>) are ordinary text that is always one id, as in llama.cpp.
        pieces = [(tok, tok_type) for tok, tok_type in zip(tokens, types, strict=True) if tok]
        backend.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok, kind in pieces if kind == _CONTROL])
        backend.add_tokens([AddedToken(tok, special=False, normalized=False) for tok, kind in pieces if kind == _USER_DEFINED])
        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        return cls(
            backend,
            byte_level=True,
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=_require(meta, "tokenizer.ggml.eos_token_id"),
            extra_stop_ids=extra,
            add_bos=meta.get("tokenizer.ggml.add_bos_token", False),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def _from_gguf_spm(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """A SentencePiece vocabulary (`tokenizer.ggml.model` "llama"): pieces,
        their scores and types, with llama.cpp's defaults where a key is
        missing (BOS 1, EOS 2, UNK 0, add BOS, add the space prefix)."""
        tokens = list(_require(meta, "tokenizer.ggml.tokens"))
        n = len(tokens)
        scores = list(meta.get("tokenizer.ggml.scores", [0.0] * n))
        types = meta.get("tokenizer.ggml.token_type")
        types = None if types is None else list(types)

        def special_id(key: str, default: int | None) -> int | None:
            tid = meta.get(key, default)
            if key not in meta and tid is not None and tid >= n:
                return None  # a default outside a small vocabulary: none
            return tid

        bos_id = special_id("tokenizer.ggml.bos_token_id", 1)
        eos_id = special_id("tokenizer.ggml.eos_token_id", 2)
        unk_id = special_id("tokenizer.ggml.unknown_token_id", 0)
        if eos_id is None:
            raise TokenizerError("tokenizer metadata lacks 'tokenizer.ggml.eos_token_id'")
        for name, tid in (("bos", bos_id), ("eos", eos_id), ("unknown", unk_id)):
            if tid is not None and not (isinstance(tid, int) and 0 <= tid < n):
                raise TokenizerError(f"{name} token id {tid} is outside the vocabulary of {n}")
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        spm = SpmVocab(
            tokens,
            scores,
            types,
            add_space_prefix=add_prefix,
            unk_id=unk_id,
            control_ids=[i for i in (bos_id, eos_id, unk_id) if i is not None],
        )
        backend = _spm_backend(spm, merges=False)
        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        extra += [i for i, tok in enumerate(spm.tokens) if tok in _EOT_TEXTS and spm.types[i] == _CONTROL]
        return cls(
            backend,
            byte_level=False,
            bos_id=bos_id,
            eos_id=eos_id,
            extra_stop_ids=extra,
            add_bos=meta.get("tokenizer.ggml.add_bos_token", True),
            add_eos=meta.get("tokenizer.ggml.add_eos_token", False),
            chat_template=meta.get("tokenizer.chat_template"),
            spm=spm,
        )

    @classmethod
    def _from_gguf_wpm(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """A WordPiece vocabulary (`tokenizer.ggml.model` "bert", llama.cpp's
        WPM) with llama.cpp's defaults where a key is missing: [CLS] the BOS
        id (101; a file's cls_token_id stands in where it has no
        bos_token_id), [SEP] 102, [UNK] 100, a default outside the
        vocabulary being none; lower-casing on, accent stripping as
        lower-casing. As in llama.cpp, every input with special tokens is
        [CLS] text [SEP], whatever add_bos_token / add_eos_token /
        add_sep_token say (the converter writes them for BERT as true,
        true, false)."""
        tokens = list(_require(meta, "tokenizer.ggml.tokens"))
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        types = None if types is None else list(types)

        def special_id(name: str, keys: Sequence[str], default: int) -> int | None:
            for key in keys:
                if key in meta:
                    tid = meta[key]
                    if not (isinstance(tid, int) and 0 <= tid < n):
                        raise TokenizerError(f"{name} token id {tid} ({key}) is outside the vocabulary of {n}")
                    return tid
            return default if default < n else None

        cls_id = special_id("cls", ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.cls_token_id"), 101)
        sep_id = special_id("sep", ("tokenizer.ggml.seperator_token_id",), 102)
        unk_id = special_id("unknown", ("tokenizer.ggml.unknown_token_id",), 100)
        if cls_id is None or sep_id is None:
            missing = "tokenizer.ggml.bos_token_id" if cls_id is None else "tokenizer.ggml.seperator_token_id"
            raise TokenizerError(f"tokenizer metadata lacks {missing!r} (a WordPiece input is [CLS] text [SEP])")
        eos_id = special_id("eos", ("tokenizer.ggml.eos_token_id",), sep_id)
        lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
        strip = meta.get("tokenizer.ggml.normalizer.strip_accents")
        wpm = WpmVocab(tokens, types, lowercase=lowercase, strip_accents=None if strip is None else bool(strip), unk_id=unk_id)
        return cls(
            _wpm_backend(wpm, cls_id, sep_id),
            byte_level=False,
            bos_id=cls_id,
            eos_id=eos_id,
            add_bos=True,
            add_eos=True,
            end_id=sep_id,
            chat_template=meta.get("tokenizer.chat_template"),
            wpm=wpm,
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """A tokenizer from a Hugging Face directory: tokenizer.json (required),
        tokenizer_config.json and generation_config.json (optional)."""
        path = Path(path)
        try:
            raw = read_text(path / "tokenizer.json", MAX_TOKENIZER_JSON)
        except FileRefused as exc:
            raise TokenizerError(f"cannot read {exc}") from None
        try:
            backend = tokenizers.Tokenizer.from_str(raw)
        except Exception as exc:
            raise TokenizerError(f"{path / 'tokenizer.json'} is not a valid tokenizer: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_id(field: str) -> int | None:
            value = config.get(field)
            text = value.get("content") if isinstance(value, dict) else value
            if text is None:
                return None
            tid = backend.token_to_id(text)
            if tid is None:
                raise TokenizerError(f"{field} {text!r} is not in the vocabulary")
            return tid

        gen_eos = gen.get("eos_token_id")
        gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        eos_id = token_id("eos_token")
        if eos_id is None and not gen_eos:
            eos_id = token_id("sep_token")  # a BERT tokenizer's end of input ([SEP]): an encoder's
        if eos_id is None:
            if not gen_eos:
                raise TokenizerError(f"{path}: no eos_token in tokenizer_config.json or generation_config.json")
            eos_id = gen_eos[0]
        bos_id = token_id("bos_token")
        add_bos = config.get("add_bos_token")
        if add_bos is None and bos_id is not None:
            # No explicit flag: a post-processor that prepends BOS says yes.
            with_post = backend.encode("a").ids[:1]
            add_bos = with_post == [bos_id] and backend.encode("a", add_special_tokens=False).ids[:1] != with_post
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if template is None and (path / "chat_template.jinja").exists():
            try:
                template = read_text(path / "chat_template.jinja", MAX_TEMPLATE)
            except FileRefused as exc:
                raise TokenizerError(f"cannot read {exc}") from None
        decoder = json.loads(raw).get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        byte_level = any(p.get("type") == "ByteLevel" for p in parts)
        return cls(
            backend,
            byte_level=byte_level,
            bos_id=bos_id,
            eos_id=eos_id,
            extra_stop_ids=gen_eos,
            add_bos=bool(add_bos),
            chat_template=template,
        )

    def backend_json(self) -> str:
        """The `tokenizers` serialization (for llguidance's tokenizer). For a
        GGUF SentencePiece vocabulary, a BPE twin with merges from the scores
        (made on first use: about a second for a 256k vocabulary)."""
        if self._spm is None:
            return self._backend.to_str()  # a WordPiece GGUF's twin as it is
        with self._plain_lock:
            if self._twin_json is None:
                self._twin_json = _spm_backend(self._spm, merges=True).to_str()
            return self._twin_json

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids for `text`. With `special` (the default) special-token
        text in it becomes its single id; without, it is tokenized as the
        text it is. BOS is prepended when `add_bos` (default: the
        checkpoint's setting). Thread-safe."""
        if self._spm is not None:
            ids = self._spm.encode(text, parse_special=special)
        elif self._wpm is not None:
            ids = self._wpm.encode(text, parse_special=special)
        else:
            ids = _encode_with(self._backend if special else self._plain(), text)
        return self._with_bos(ids, add_bos)

    def encode_rendered(self, text: str, literals: Mapping[str, str], *, add_bos: bool | None = None) -> list[int]:
        """Token ids for `text` a chat template rendered, in which each key
        of `literals` (a placeholder) stands for its value, text a request
        brought. Special-token text in `text` itself is the template's and
        becomes its id; the literals are tokenized as text, together with
        the text around them (a run between two of the template's special
        tokens is encoded as one). Without any placeholder in `text` this
        is exactly `encode(text)`. Thread-safe."""
        found = [key for key in literals if key in text]
        if not found:
            return self.encode(text, add_bos=add_bos)
        holes = re.compile("|".join(re.escape(key) for key in sorted(found, key=len, reverse=True)))
        ids: list[int] = []
        run: list[str] = []  # the text since the last special token
        start = 0
        for hole in holes.finditer(text):
            self._template_text(text[start : hole.start()], run, ids)
            run.append(literals[hole.group()])
            start = hole.end()
        self._template_text(text[start:], run, ids)
        self._flush(run, ids)
        return self._with_bos(ids, add_bos)

    def _template_text(self, text: str, run: list[str], ids: list[int]) -> None:
        """Split the template's own `text` at its special tokens, as the
        `tokenizers` library does (longest match; whitespace taken by
        tokens that strip it): each ends the run so far and adds its id."""
        start = 0
        if self._special_split is not None:
            for match in self._special_split.finditer(text):
                run.append(text[start : match.start()])
                self._flush(run, ids)
                ids.append(self._special_ids[match.lastindex - 1])
                start = match.end()
        run.append(text[start:])

    def _flush(self, run: list[str], ids: list[int]) -> None:
        text = "".join(run)
        run.clear()
        if not text:
            return
        if self._spm is not None:
            # Like llama.cpp, a run after a special token gets the space prefix.
            ids.extend(self._spm.encode(text, parse_special=False))
        elif self._wpm is not None:
            ids.extend(self._wpm.encode(text, parse_special=False))
        else:
            ids.extend(_encode_with(self._plain(), text))

    def encode_input(self, text: str) -> list[int]:
        """An encoder's input: `text` as text (special-token spellings are
        not their ids), wrapped as the tokenizer's own post-processor wraps
        an input ([CLS] text [SEP] for a BERT tokenizer.json); for a
        WordPiece GGUF [CLS] text [SEP] too, as llama.cpp wraps every input
        to a BERT; for other GGUF files, as `encode` with the checkpoint's
        BOS/EOS."""
        if self._wpm is not None:
            return self.encode(text, add_bos=True, special=False)
        if self.byte_level or self._spm is not None:
            return self.encode(text, special=False)
        return self._plain().encode(text, add_special_tokens=True).ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """A cross-encoder's input: two texts as text, joined as the
        tokenizer's own post-processor joins a pair ([CLS] a [SEP] b [SEP]
        for BERT, <s> a </s></s> b </s> for RoBERTa). Hugging Face
        tokenizers only (TokenizerError otherwise)."""
        if self.byte_level or self._spm is not None:
            raise TokenizerError("this tokenizer has no pair template: a cross-encoder needs its tokenizer.json")
        return self._plain().encode(first, second, add_special_tokens=True).ids

    def _plain(self) -> tokenizers.Tokenizer:
        """A copy of the backend that reads special-token text as text
        (made on first use; never changed after, so shared by threads)."""
        backend = self._plain_backend
        if backend is None:
            with self._plain_lock:
                if self._plain_backend is None:
                    copy = tokenizers.Tokenizer.from_str(self._backend.to_str())
                    copy.encode_special_tokens = True
                    self._plain_backend = copy
                backend = self._plain_backend
        return backend

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        """BOS first when `add_bos` (default: the checkpoint's setting); EOS
        last where the checkpoint adds one, unless `add_bos` is False (no
        special tokens at all)."""
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.add_eos and add_bos is not False:
            ids.append(self._end_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """The text of `ids`. Byte-level and GGUF SentencePiece: the tokens'
        bytes decoded as UTF-8 with invalid sequences as U+FFFD (exactly what
        the detokenizer streams); SentencePiece then without the one leading
        space its prefix added, as llama.cpp and Hugging Face decode. A
        WordPiece GGUF decodes as Hugging Face's WordPiece decoder does
        (pieces that start a word after a space, continuations joined on,
        the space before . , ! ? taken out)."""
        if not self.byte_level and self._spm is None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special)
        skip = self._special if skip_special else frozenset()
        text = b"".join(self.token_bytes(i) for i in ids if i not in skip).decode("utf-8", errors="replace")
        if self._spm is not None and self._spm.add_space_prefix and text.startswith(" "):
            return text[1:]
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes `token_id` stands for (special tokens: their text)."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token, skipped by `decode`."""
        return token_id in self._special


def _spm_backend(spm: SpmVocab, *, merges: bool) -> tokenizers.Tokenizer:
    """The `tokenizers` twin of a SentencePiece vocabulary, as Hugging Face
    builds one from a GGUF: BPE over the pieces (with `merges`, merges from
    the scores), byte fallback, Metaspace, and the special pieces as added
    tokens. Other libraries read it (llguidance); trioserve's own encoding
    does not use it, and the Tokenizer needs only its vocabulary."""
    vocab = {tok: i for i, tok in enumerate(spm.tokens)}
    unk = None if spm.unk_id is None else spm.tokens[spm.unk_id]
    try:
        bpe = models.BPE(vocab, spm.merges() if merges else [], unk_token=unk, byte_fallback=True, fuse_unk=True)
    except Exception as exc:  # the Rust side reports any inconsistency as a plain Exception
        raise TokenizerError(f"cannot build BPE from the SentencePiece vocabulary: {exc}") from exc
    backend = tokenizers.Tokenizer(bpe)
    scheme = "first" if spm.add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if spm.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    special = [(tok, kind) for tok, kind in zip(spm.tokens, spm.types, strict=True)]
    backend.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok, kind in special if kind in (_CONTROL, _UNKNOWN)]
    )
    backend.add_tokens([AddedToken(tok, special=False, normalized=False) for tok, kind in special if kind == _USER_DEFINED])
    return backend


def _wpm_backend(wpm: WpmVocab, cls_id: int, sep_id: int) -> tokenizers.Tokenizer:
    """The `tokenizers` twin of a WordPiece GGUF vocabulary: the vocabulary
    back in Hugging Face's "##" form (WpmVocab.hf_tokens), BERT's
    normalizer, pre-tokenizer, [CLS] $A [SEP] post-processor and WordPiece
    decoder, control and unknown pieces as special added tokens. It decodes
    for the Tokenizer; llama.cpp's encoding is WpmVocab's (the twin encodes
    as Hugging Face does, which differs in places)."""
    forms = wpm.hf_tokens()
    unk = "[UNK]" if wpm.unk_id is None else forms[wpm.unk_id]
    try:
        model = models.WordPiece({form: i for i, form in enumerate(forms)}, unk_token=unk, max_input_chars_per_word=100)
    except Exception as exc:  # the Rust side reports any inconsistency as a plain Exception
        raise TokenizerError(f"cannot build WordPiece from the vocabulary: {exc}") from exc
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=wpm.strip_accents, lowercase=wpm.lowercase
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    cls_text, sep_text = forms[cls_id], forms[sep_id]
    try:
        backend.post_processor = processors.TemplateProcessing(
            single=[cls_text, "$A", sep_text],
            pair=[cls_text, "$A", sep_text, "$B:1", f"{sep_text}:1"],
            special_tokens=[(cls_text, cls_id), (sep_text, sep_id)],
        )
    except Exception:  # pieces a template cannot spell ("$A"): the twin then wraps nothing
        pass
    kinds = list(zip(forms, wpm.types, strict=True))
    backend.add_special_tokens(
        [AddedToken(form, special=True, normalized=False) for form, kind in kinds if kind in (_CONTROL, _UNKNOWN)]
    )
    backend.add_tokens([AddedToken(form, special=False, normalized=False) for form, kind in kinds if kind == _USER_DEFINED])
    return backend


def _special_pattern(tokens: Sequence[AddedToken]) -> re.Pattern[str] | None:
    """One alternation over ``tokens`` (longest first), group i+1 for the
    i-th; a token that strips whitespace on a side takes it there, as the
    `tokenizers` library does."""
    if not tokens:
        return None
    alternatives = []
    for token in tokens:
        left = r"\s*" if token.lstrip else ""
        right = r"\s*" if token.rstrip else ""
        alternatives.append(f"({left}{re.escape(token.content)}{right})")
    return re.compile("|".join(alternatives))


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it does not exist."""
    try:
        value = json.loads(read_text(path, MAX_JSON))
    except FileRefused as exc:
        if exc.missing:
            return {}
        raise TokenizerError(f"cannot read {exc}") from None
    except ValueError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} does not hold a JSON object")
    return value
