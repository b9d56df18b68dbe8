"""WordPiece ("bert") GGUF tokenizers: ids as llama.cpp's WPM tokenizer gives
them, for the GGUF files llama.cpp's own converter writes from a Hugging Face
BERT directory, and text back out of them as WordPiece decoding gives it.

Oracles:
- the Hugging Face tokenizer the GGUF came from (`tokenizers`, the
  tokenizer.json the converter read), on texts where llama.cpp and it agree
  by design: almost everything. Where they do not, the texts are listed
  with the reason (`DIFFERENT`) and checked against the other two oracles;
- `reference_ids` below: llama.cpp's llm_tokenizer_wpm written the slow,
  obvious way, as its C++ reads (UTF-8 bytes, a words vector, every match
  length tried from the longest piece down);
- llama.cpp itself where a build of it is at hand
  (~/.cache/trioserve/llama.cpp-build/bin/llama-server): its /tokenize on
  the same GGUF, for every listed text and a few hundred random ones.

The vocabularies: WordPiece trained here (tokenizers' trainer, BERT's
normalizer and pre-tokenizer) on Python's own documentation (pydoc_data)
and some lines in other scripts, about 4,000 pieces, one lower-cased (as
bge, e5 and all-MiniLM are) and one cased that strips accents (both
normalizer keys the converter can write); each saved with a small random
BertModel as an HF directory, converted by llama.cpp's converter
(vendor/llama.cpp in llama-cpp-python 0.3.36's sdist; without it those
tests skip).

What the converter needs: a tokenizer_config.json that names every special
token (tests/families.py's names only [CLS] and [SEP]: the converter then
writes no unknown_token_id, and llama.cpp falls back to id 100, whatever
piece that is) and a name for the pre-tokenizer, which it finds by hashing
the ids of a test text and refuses when the hash is unknown, as it is for
any vocabulary trained here; llama.cpp does not read the name for a "bert"
vocabulary, and the converter is run with an unknown hash named "default".
Nothing else is changed."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
import unicodedata
from pathlib import Path

import httpx
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.models import test_llama_cpp_converter as converter_tests
from trioserve.errors import TokenizerError
from trioserve.models.gguf_file import read_metadata
from trioserve.models.tokenizer import Tokenizer

LLAMA_CPP = converter_tests.LLAMA_CPP
# Its skip-when-missing logic: the sdist unpacked, with its converter.
needs_converter = converter_tests.pytestmark
LLAMA_SERVER = converter_tests.SDIST.parent / "llama.cpp-build" / "bin" / "llama-server"
needs_llama_server = pytest.mark.skipif(
    not LLAMA_SERVER.is_file(), reason=f"no llama.cpp build at {LLAMA_SERVER.parent} (llama-server), the third oracle"
)

SPACE = "\u2581"
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# -- files ---------------------------------------------------------------------------------------------------------

def convert_bert(hf: Path, out: Path, outtype: str = "f32") -> Path:
    """``hf`` through llama.cpp's converter into ``out`` (an unknown
    pre-tokenizer hash named "default": llama.cpp ignores the name for a
    WordPiece vocabulary)."""
    return converter_tests.convert(hf, out, outtype, unknown_pre="default")


def name_special_tokens(hf: Path, *, lowercase: bool = True) -> None:
    """A tokenizer_config.json that names all five special tokens, as a real
    BERT's does (BertTokenizerFast's save_pretrained writes these)."""
    config = {
        "tokenizer_class": "BertTokenizerFast", "do_lower_case": lowercase, "cls_token": "[CLS]", "sep_token": "[SEP]",
        "unk_token": "[UNK]", "pad_token": "[PAD]", "mask_token": "[MASK]", "model_max_length": 512,
    }  # fmt: skip
    (hf / "tokenizer_config.json").write_text(json.dumps(config))


def corpus() -> list[str]:
    """Python's documentation (about 460 kB of English prose), with lines in
    other scripts, so that accents, Greek, Cyrillic and CJK have pieces."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)] + MULTILINGUAL * 20


MULTILINGUAL = [
    "Crème brûlée, naïve café, déjà vu, résumé, Ångström, São Paulo, Straße, El Niño, Zürich, Kraków, Łódź.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. Οδυσσεύς, Σίσυφος.",
    "Быстрая коричневая лиса прыгает через ленивую собаку. Нещо на Български.",
    "我想在苹果公司工作。今天天气很好，我们去公园散步吧！中文字符测试。",
    "日本語のテキストです。ひらがなとカタカナ、ガギグゲゴ。",
    "한국어 텍스트입니다. 안녕하세요 세계.",
    "नमस्ते दुनिया, यह एक परीक्षण है।",
    "مرحبا بالعالم، هذا اختبار.",
    "Emoji 🚀 rockets ✅ checks 🦙 llamas and 👍 thumbs.",
    "Prices: €100, £50, ¥1000, 30°C, ±5%, 3×4=12, x≠y, a≤b.",
]


def train_wordpiece(*, lowercase: bool, strip_accents: bool | None, size: int = 4000) -> tokenizers.Tokenizer:
    """A BERT-style WordPiece tokenizer trained on `corpus()`."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=strip_accents)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=size, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tok


def write_bert_dir(directory: Path, tokenizer: tokenizers.Tokenizer, *, lowercase: bool) -> Path:
    """A small random BertModel for ``tokenizer``'s vocabulary, saved with it
    as an HF directory."""
    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    name_special_tokens(directory, lowercase=lowercase)
    return directory


# -- llama.cpp itself -------------------------------------------------------------------------------------------------


class LlamaServer:
    """llama.cpp's llama-server on a GGUF (--embedding), for its /tokenize
    and its embeddings; stopped on leaving the block."""

    def __init__(self, gguf: Path, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        argv = [str(LLAMA_SERVER), "-m", str(gguf), "--embedding", "--host", "127.0.0.1", "--port", str(port), "-t", "1", *extra]
        self._log_path = gguf.with_name(f"{gguf.stem}-llama-server-{port}.log")
        with open(self._log_path, "w") as log:  # the child keeps its own copy of the file
            self._proc = subprocess.Popen(argv, stdout=log, stderr=log)
        self._client = httpx.Client(base_url=self.url, timeout=60)

    def __enter__(self) -> LlamaServer:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise AssertionError(f"llama-server exited {self._proc.returncode}: {self._log_path.read_text()[-3000:]}")
            try:
                if self._client.get("/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("llama-server did not come up in 120 s")

    def __exit__(self, *exc) -> None:
        self._client.close()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        body = {"content": text, "add_special": add_special, "parse_special": parse_special}
        reply = self._client.post("/tokenize", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["tokens"]

    def embeddings(self, texts: list[str]) -> list[list[float]]:
        reply = self._client.post("/v1/embeddings", json={"input": texts})
        assert reply.status_code == 200, reply.text
        return [item["embedding"] for item in reply.json()["data"]]


# -- llama.cpp's algorithm, the slow way ------------------------------------------------------------------------------

_WHITESPACE = {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
               *range(0x2000, 0x200B)}  # fmt: skip


def _chinese(cp: int) -> bool:
    ranges = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]  # fmt: skip
    return any(a <= cp <= b for a, b in ranges)


def reference_words(text: str, *, lowercase: bool, strip_accents: bool) -> list[str]:
    """llm_tokenizer_wpm_session::preprocess, line by line."""
    cpts = [ord(c) for c in text]
    if strip_accents:  # llama.cpp's NFD table: each code point to the first of its decomposition
        cpts = [ord(unicodedata.normalize("NFD", chr(c))[0]) for c in cpts]
    words = [""]
    for cpt in cpts:
        category = unicodedata.category(chr(cpt))
        if cpt in _WHITESPACE:
            if words[-1]:
                words.append("")
            continue
        if cpt == 0 or cpt == 0xFFFD or category in ("Cc", "Cf", "Co", "Cs"):
            continue
        if strip_accents and category.startswith("M"):
            continue
        # UnicodeData's simple lower case: one code point (İ's is "i").
        s = (chr(cpt).lower()[:1] or chr(cpt)) if lowercase else chr(cpt)
        if category.startswith("P") or (cpt < 0x7F and category.startswith("S")) or _chinese(cpt):
            if words[-1]:
                words.append("")
            words[-1] = s
            words.append("")
        else:
            words[-1] += s
    if not words[-1]:
        words.pop()
    return words


def reference_ids(tokens: list[str], unk: int, text: str, *, lowercase: bool, strip_accents: bool) -> list[int]:
    """llm_tokenizer_wpm_session::tokenize over UTF-8 bytes (no special pieces
    in ``text``, no [CLS]/[SEP])."""
    token_to_id = {t.encode(): i for i, t in enumerate(tokens)}
    longest = max(len(t) for t in token_to_id)
    out: list[int] = []
    for word in reference_words(text, lowercase=lowercase, strip_accents=strip_accents):
        word1 = (SPACE + word).encode()
        n = len(word1)
        before = len(out)
        i = 0
        while i < n:
            for j in range(min(n, i + longest + 1), i, -1):
                tid = token_to_id.get(word1[i:j])
                if tid is not None:
                    out.append(tid)
                    i = j
                    break
            else:
                del out[before:]
                break
        if len(out) == before:
            out.append(unk)
    return out


# -- texts -----------------------------------------------------------------------------------------------------------

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "a",
    "",
    "   ",
    "  leading and trailing  \t\n tabs\r\nand newlines  ",
    "(parentheses) [brackets] {braces} a-b_c d.e/f 'single' \"double\" #hash $100 50% a+b=c <tag> ^caret `tick` |pipe| ~tilde @at",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "3.14159 2024-01-01 1,000,000 0x1F 1e-12",
    "Crème brûlée, naïve café, déjà vu, RÉSUMÉ, Ångström, São Paulo, Straße, ÉCOLE, İstanbul",
    "e\u0301 combining acute, n\u0303 combining tilde",
    "Οδυσσεύς ΣΊΣΥΦΟΣ σίσυφος",
    "Быстрая коричневая лиса, НЕЩО на Български",
    "我想在apple工作1314151天～今天天气很好！",
    "日本語のテキストです。ガギグゲゴ、ｶﾞｷﾞ",
    "豈 更 車 (compatibility ideographs) 𠀀𠀁 (extension B)",
    "ＡＢＣ ａｂｃ １２３ ！？",
    "مرحبا بالعالم، هذا اختبار.",
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 👍🏽",
    "€100 £50 ¥1000 30°C ±5% 3×4=12 x≠y a≤b ™©®",
    "Ω Å K (Ohm, Angstrom, Kelvin signs)",
    "zxqv qqqqq xyzzy blorptastic flibbertigibbet",
    "pneumonoultramicroscopicsilicovolcanoconiosis supercalifragilisticexpialidocious",
    "x" * 99,
    "a\x00b\x07c\u200bd\ufeffe\u00adf\u2060g\ue000h",  # NUL, BEL, zero-width space, BOM, soft hyphen, word joiner, private use
    "non\u00a0breaking\u3000ideographic\u2003em\u2028line\u2029paragraph\u205fend",
    "[CLS] [SEP] [MASK] [UNK] [PAD] written as text",
    "## hashes ##ing",
    "�replacement",
    "ǅ ǈ Ꭰ Ა ẞ",  # titlecase letters, Cherokee, Georgian Mtavruli, capital sharp s
    "unassigned \u0378 here",
]

# Where llama.cpp (and so trioserve) and Hugging Face's tokenizer part, and why.
DIFFERENT = {
    "한국어 텍스트입니다": "a Hangul syllable becomes the first character of its NFD, its leading consonant jamo alone",
    "नमस्ते दुनिया": "accent stripping drops spacing marks (Mc) too, Hugging Face's only nonspacing ones (Mn)",
    "keycap 1\ufe0f\u20e3": "accent stripping drops enclosing marks (Me) too",
    "y" * 101: "no word length limit (Hugging Face's WordPiece makes a word of over 100 characters [UNK])",
    "the\u2581quick": 'a "▁" inside a word starts a word piece in llama.cpp\'s vocabulary form',
    "page\x0cbreak\x0bvertical\x85next": "form feed, vertical tab and NEL separate words in llama.cpp; BertNormalizer drops them (Cc)",
}

# Random texts for llama.cpp: words of the corpus and characters of every kind.
_ODD = (
    "\t\n\r\x0b\x0c\x00\x07\x1f\x7f\x85\xa0\xad"
    "ĀāĂăĄąĆćČčĎďĒēĘęĚěĞğİıŁłŃńŇňŐőŒœŘřŚśŞşŠšŢţŤťŮůŰűŸŹźŻżŽžǅǈǋǲẞ"
    "\u0300\u0301\u0302\u0303\u0308\u0327\u0338\u20e3\u0488"
    "ΑΒΓΔΕΖΗΘαβγδεζηθΣσςΆάΐΰ БВГДЁЖЗИЙбвгдёжзийЇї"
    "한국어텍스트가나다ᄀ까 नमस्तेदुनियाक़ ภาษาไทย مرحبا\u064e שלום"
    "我想在工作日本語中文字漢豈\ufa0e𠀀\U0002b820ひらがなカタカナガｶﾞＡＢＣａｂｃ１２３！？"
    "🚀😶🌫✅🦙👍🏽👨\u200d👩\u200d👧\ufe0f"
    "€£¥©®™°±×÷∑∫≠≤≥→←♥★☆ΩÅK"
    "\u1680\u2000\u2003\u2009\u200a\u2028\u2029\u202f\u205f\u3000\u200b\ufeff\u2060\ue000\uf8ff\u0378\ufffd\u2581ﬁᎠᲐ"
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
)


def random_texts(words: list[str], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 12)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(words))
            elif r < 0.8:
                parts.append("".join(rng.choice(_ODD) for _ in range(rng.randint(1, 4))))
            else:
                parts.append(rng.choice(words).upper() + rng.choice(_ODD))
            parts.append(rng.choice([" ", " ", "", "\n", "  "]))
        out.append("".join(parts))
    return out


# -- fixtures ----------------------------------------------------------------------------------------------------------

VOCABS = {"uncased": dict(lowercase=True, strip_accents=None), "cased-strip": dict(lowercase=False, strip_accents=True)}


@pytest.fixture(scope="module", params=sorted(VOCABS))
def vocab(request, tmp_path_factory):
    """One trained vocabulary: its HF tokenizer (special text read as text),
    the GGUF llama.cpp's converter made of it, trioserve's tokenizer from
    that file, and llama.cpp's own ids for every text used (where built)."""
    if needs_converter.args[0]:
        pytest.skip(needs_converter.kwargs["reason"])
    flags = VOCABS[request.param]
    root = tmp_path_factory.mktemp(f"wpm-{request.param}")
    hf = train_wordpiece(**flags)
    directory = write_bert_dir(root / "hf", hf, lowercase=flags["lowercase"])
    gguf = convert_bert(directory, root / "bert.gguf")
    meta = read_metadata(gguf)
    hf.encode_special_tokens = True
    words = sorted({w for line in MULTILINGUAL for w in line.split()} | {w for w in corpus()[0].split()[:400]})
    randoms = random_texts(words, 300, seed=len(request.param))
    llama: dict[tuple[str, bool, bool], list[int]] = {}
    if LLAMA_SERVER.is_file():
        with LlamaServer(gguf, "-c", "64") as server:
            for text in [*TEXTS, *DIFFERENT, *randoms]:
                llama[text, True, False] = server.tokenize(text, add_special=True, parse_special=False)
            for text in TEXTS:
                llama[text, False, True] = server.tokenize(text, add_special=False, parse_special=True)
    return {
        "name": request.param, "flags": flags, "hf": hf, "meta": meta, "tok": Tokenizer.from_gguf_metadata(meta),
        "gguf": gguf, "randoms": randoms, "llama": llama,
    }  # fmt: skip


def reference(vocab, text: str) -> list[int]:
    meta = vocab["meta"]
    lowercase = meta.get("tokenizer.ggml.normalizer.lowercase", True)
    strip = meta.get("tokenizer.ggml.normalizer.strip_accents", lowercase)
    ids = reference_ids(list(meta["tokenizer.ggml.tokens"]), meta["tokenizer.ggml.unknown_token_id"], text, lowercase=lowercase, strip_accents=strip)
    return [meta["tokenizer.ggml.bos_token_id"], *ids, meta["tokenizer.ggml.seperator_token_id"]]


def needs_llama(vocab) -> None:
    if not vocab["llama"]:
        pytest.skip(f"no llama.cpp build at {LLAMA_SERVER.parent} (llama-server), the third oracle")


# -- the converter's files ----------------------------------------------------------------------------------------------


def test_what_the_converter_writes(vocab):
    """The vocabulary in llama.cpp's phantom-space form (a word-start piece
    "▁"-prefixed, a "##" piece bare, control pieces as they are), the
    special ids from tokenizer_config.json, and the flags: the post-processor
    [CLS] $A [SEP] read as add BOS and add EOS, the normalizer's flags as
    keys."""
    meta, hf = vocab["meta"], vocab["hf"]
    assert meta["tokenizer.ggml.model"] == "bert"
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    assert len(tokens) == hf.get_vocab_size()
    for piece, i in hf.get_vocab().items():
        if piece in SPECIALS:
            assert (tokens[i], types[i]) == (piece, CONTROL)
        else:
            assert (tokens[i], types[i]) == (piece[2:] if piece.startswith("##") else SPACE + piece, NORMAL)
    ids = {name: hf.token_to_id(name) for name in SPECIALS}
    assert meta["tokenizer.ggml.bos_token_id"] == ids["[CLS]"]
    assert meta["tokenizer.ggml.seperator_token_id"] == meta["tokenizer.ggml.eos_token_id"] == ids["[SEP]"]
    assert meta["tokenizer.ggml.unknown_token_id"] == ids["[UNK]"]
    assert meta["tokenizer.ggml.padding_token_id"] == ids["[PAD]"]
    assert meta["tokenizer.ggml.mask_token_id"] == ids["[MASK]"]
    assert "tokenizer.ggml.cls_token_id" not in meta  # the converter's writer has no handler for it
    assert (meta["tokenizer.ggml.add_bos_token"], meta["tokenizer.ggml.add_eos_token"], meta["tokenizer.ggml.add_sep_token"]) == (True, True, False)
    assert meta["tokenizer.ggml.normalizer.lowercase"] == vocab["flags"]["lowercase"]
    assert meta.get("tokenizer.ggml.normalizer.strip_accents") == vocab["flags"]["strip_accents"]
    tok = vocab["tok"]
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (ids["[CLS]"], ids["[SEP]"], len(tokens))
    assert tok.special_tokens == tuple(SPECIALS) and all(tok.is_special(ids[s]) for s in SPECIALS)


# -- ids --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_hugging_face(vocab, text):
    """[CLS] text [SEP] as the HF tokenizer encodes it (special-token
    spellings read as text), by encode_input, encode, and bare."""
    tok, hf = vocab["tok"], vocab["hf"]
    expected = hf.encode(text, add_special_tokens=True).ids
    assert tok.encode_input(text) == expected
    assert tok.encode(text, special=False) == expected
    assert tok.encode(text, add_bos=False, special=False) == hf.encode(text, add_special_tokens=False).ids
    assert tok.encode_input(text) == reference(vocab, text)


@pytest.mark.parametrize("text", list(DIFFERENT), ids=list(DIFFERENT.values()))
def test_where_llama_cpp_and_hugging_face_part(vocab, text):
    """These follow llama.cpp (its algorithm here; llama.cpp itself below),
    not the HF tokenizer, which gives other ids (both vocabularies strip
    accents; the reason is the test id)."""
    tok, hf = vocab["tok"], vocab["hf"]
    assert tok.encode_input(text) == reference(vocab, text)
    assert tok.encode_input(text) != hf.encode(text).ids


@pytest.mark.parametrize("text", [*TEXTS, *DIFFERENT])
def test_ids_match_llama_cpp(vocab, text):
    """llama-server's /tokenize on the same file: with its special tokens and
    special text as text (what trioserve embeds), and bare with special text
    parsed."""
    needs_llama(vocab)
    tok = vocab["tok"]
    assert tok.encode_input(text) == vocab["llama"][text, True, False]
    if (text, False, True) in vocab["llama"]:
        assert tok.encode(text, add_bos=False, special=True) == vocab["llama"][text, False, True]


def test_random_texts_match_llama_cpp(vocab):
    """300 texts of corpus words and characters of every kind (whitespace,
    controls, marks of all three kinds, Hangul, CJK, emoji, unassigned)."""
    needs_llama(vocab)
    tok = vocab["tok"]
    wrong = [t for t in vocab["randoms"] if tok.encode_input(t) != vocab["llama"][t, True, False]]
    assert not wrong, f"{len(wrong)} of {len(vocab['randoms'])} differ, the first {wrong[0]!r}"


def test_random_texts_match_the_reference(vocab):
    tok = vocab["tok"]
    for text in vocab["randoms"]:
        assert tok.encode_input(text) == reference(vocab, text), text


# Characters where llama.cpp and Hugging Face agree by design.
_AGREED = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \t\n.,;:!?'\"()[]{}-_/#$%&*+=<>@^`|~\\"
    "éèêëàâäîïôöùûüçñßÉÈÀÇÑÅåøæœŁłŚśŽžΣσςαβγ БбЖжЯя我想在工作日本語ガカ！？ＡＢ🚀✅🦙\u0301\u200b\u00a0\u3000\x00\ufffd€×°"
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_text_matches_hugging_face(vocab, data):
    words = [w for w in corpus()[0].split()[:300]]
    pieces = st.one_of(st.sampled_from(words), st.text(alphabet=_AGREED, max_size=6))
    text = " ".join(data.draw(st.lists(pieces, max_size=10)))
    tok, hf = vocab["tok"], vocab["hf"]
    assert tok.encode_input(text) == hf.encode(text).ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_any_text_matches_the_reference(vocab, text):
    assert vocab["tok"].encode_input(text) == reference(vocab, text)


def test_a_long_text_is_its_words(vocab):
    """A text past the length where other tokenizers change path gives the
    ids of its parts (the words cache does not change them either)."""
    tok = vocab["tok"]
    part = "The café's naïve 我想 tokenizer, rewritten: pneumonoultramicroscopic 🦙! "
    text = part * 200
    assert tok.encode(text, add_bos=False) == tok.encode(part, add_bos=False) * 200
    assert tok.encode_input(text) == reference(vocab, text)


def test_special_text_is_an_id_only_when_parsed(vocab):
    tok, hf = vocab["tok"], vocab["hf"]
    text = "one [SEP] two [MASK]"
    cls, sep, mask = (hf.token_to_id(s) for s in ("[CLS]", "[SEP]", "[MASK]"))
    parsed = tok.encode(text, add_bos=False)
    assert sep in parsed and mask == parsed[-1]
    assert parsed == hf.encode("one", add_special_tokens=False).ids + [sep] + hf.encode("two", add_special_tokens=False).ids + [mask]
    plain = tok.encode_input(text)
    assert plain[0] == cls and plain[-1] == sep and sep not in plain[1:-1] and mask not in plain
    # A chat-template-like rendering: the template's [SEP] an id, the request's text as text.
    assert tok.encode_rendered("{q} [SEP] {d}", {"{q}": "one [SEP]", "{d}": "two"}, add_bos=False) == (
        hf.encode("one [SEP]", add_special_tokens=False).ids + [sep] + hf.encode("two", add_special_tokens=False).ids
    )


# -- decoding -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_decode_is_wordpiece_decoding(vocab, text):
    """The HF tokenizer's decode of the same ids (WordPiece's decoder: a word
    piece after a space, "##" pieces joined on, cleanup), special tokens
    skipped or shown."""
    tok, hf = vocab["tok"], vocab["hf"]
    ids = tok.encode_input(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_decode_of_any_ids(vocab):
    tok, hf = vocab["tok"], vocab["hf"]
    rng = random.Random(5)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_token_bytes_are_llama_cpp_pieces(vocab):
    """Each id's bytes as llama.cpp's token_to_piece shows it: a word-start
    piece with its space, a continuation piece bare, control pieces as text."""
    tok, hf = vocab["tok"], vocab["hf"]
    for piece, i in hf.get_vocab().items():
        expected = piece if piece in SPECIALS else piece[2:] if piece.startswith("##") else " " + piece
        assert tok.token_bytes(i) == expected.encode()


def test_the_tokenizers_twin_is_the_hugging_face_tokenizer(vocab):
    """backend_json (what llguidance reads) is the HF tokenizer again: the
    same vocabulary in "##" form, the same normalizer and wrapping."""
    twin = tokenizers.Tokenizer.from_str(vocab["tok"].backend_json())
    twin.encode_special_tokens = True  # as `hf` reads them
    hf = vocab["hf"]
    assert twin.get_vocab() == hf.get_vocab()
    for text in TEXTS:
        assert twin.encode(text).ids == hf.encode(text).ids


# -- metadata handling, without the converter -----------------------------------------------------------------------------

_PIECES = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "▁the", "▁un", "aff", "able", "▁quick", "▁q", "u", "ick", "▁,", "▁!", "s", "▁a", "b"]


def _meta(**changes) -> dict:
    meta = {
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.tokens": list(_PIECES),
        "tokenizer.ggml.token_type": [CONTROL] * 5 + [NORMAL] * (len(_PIECES) - 5),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.seperator_token_id": 3,
        "tokenizer.ggml.unknown_token_id": 1,
        "tokenizer.ggml.eos_token_id": 3,
    }
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


def test_greedy_longest_match_and_unknown_words():
    tok = Tokenizer.from_gguf_metadata(_meta())
    ids = {p: i for i, p in enumerate(_PIECES)}
    assert tok.encode_input("The unaffable, quick!") == [2, ids["▁the"], ids["▁un"], ids["aff"], ids["able"], ids["▁,"], ids["▁quick"], ids["▁!"], 3]
    assert tok.encode_input("quicks qu") == [2, ids["▁quick"], ids["s"], ids["▁q"], ids["u"], 3]
    # A word with a part no piece matches is [UNK] once, whatever matched before.
    assert tok.encode_input("thex zzz the") == [2, 1, 1, ids["▁the"], 3]
    assert tok.encode_input("ab aba") == [2, ids["▁a"], ids["b"], 1, 3]  # no continuation "a"
    assert tok.encode("", add_bos=False) == [] and tok.encode_input("") == [2, 3]


def test_a_word_has_no_length_limit():
    pieces = ["[UNK]", "[CLS]", "[SEP]", "▁a", "b", "a"]
    tok = Tokenizer.from_gguf_metadata(
        _meta(**{"tokenizer.ggml.tokens": pieces, "tokenizer.ggml.token_type": [CONTROL] * 3 + [NORMAL] * 3,
                 "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.seperator_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
                 "tokenizer.ggml.eos_token_id": 2})
    )  # fmt: skip
    assert tok.encode("ab" * 150, add_bos=False) == [3] + [4, 5] * 149 + [4]


def test_llama_cpp_defaults_for_missing_keys():
    """No special ids: [CLS] 101, [SEP] 102, [UNK] 100 (llama.cpp's), none
    where outside the vocabulary; a file's cls_token_id stands in for a
    missing bos_token_id; no token types: nothing is special."""
    pieces = [f"▁w{i}" for i in range(110)]
    pieces[100:104] = ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": pieces})
    assert tok.encode_input("w5 zz") == [101, 5, 100, 102]
    assert (tok.bos_id, tok.eos_id) == (101, 102) and not tok.is_special(101)
    tok = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": pieces, "tokenizer.ggml.cls_token_id": 7})
    assert tok.encode_input("w5") == [7, 5, 102]
    with pytest.raises(TokenizerError, match="lacks 'tokenizer.ggml.bos_token_id'"):
        Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.ggml.bos_token_id": None}))
    with pytest.raises(TokenizerError, match="lacks 'tokenizer.ggml.seperator_token_id'"):
        Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.ggml.seperator_token_id": None}))
    # Without an unknown id (and [UNK] 100 outside the vocabulary) an unknown word cannot be encoded.
    tok = Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.ggml.unknown_token_id": None}))
    with pytest.raises(TokenizerError, match="no unknown token"):
        tok.encode_input("zzz")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokenizer.ggml.bos_token_id": 99}, "cls token id 99 (tokenizer.ggml.bos_token_id) is outside the vocabulary of 18"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "2 token types for 18 tokens"),
        ({"tokenizer.ggml.tokens": [*_PIECES[:-1], "▁the"]}, "duplicate token in the vocabulary: '▁the' has ids 5 and 17"),
        ({"tokenizer.ggml.model": "t5"}, "tokenizer model 't5' is not supported"),
    ],
)
def test_bad_metadata_is_refused_in_one_line(change, message):
    with pytest.raises(TokenizerError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        Tokenizer.from_gguf_metadata(_meta(**change))
    assert "\n" not in str(info.value)


def test_the_flags_do_not_change_the_wrapping():
    """llama.cpp wraps every input of a WordPiece vocabulary [CLS] ... [SEP]
    whatever add_bos_token / add_eos_token / add_sep_token say."""
    for flags in ({}, {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False, "tokenizer.ggml.add_sep_token": False}):
        tok = Tokenizer.from_gguf_metadata(_meta(**flags))
        assert tok.encode_input("the") == [2, 5, 3] == tok.encode("the")
        assert tok.encode("the", add_bos=False) == [5]
        assert tok.add_bos


def test_normalizer_keys():
    pieces = ["[UNK]", "[CLS]", "[SEP]", "▁cafe", "▁café", "▁Cafe", "▁CAFÉ", "▁ca", "fe"]
    base = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": pieces, "tokenizer.ggml.token_type": [CONTROL] * 3 + [NORMAL] * 6,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.seperator_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}  # fmt: skip

    def ids(text, **keys):
        return Tokenizer.from_gguf_metadata({**base, **keys}).encode(text, add_bos=False)

    assert ids("CAFÉ Café") == [3, 3]  # lower-cased and stripped (the defaults)
    assert ids("CAFÉ Café", **{"tokenizer.ggml.normalizer.lowercase": False}) == [6, 0]  # neither
    assert ids("CAFÉ Café", **{"tokenizer.ggml.normalizer.lowercase": False, "tokenizer.ggml.normalizer.strip_accents": True}) == [0, 5]
    assert ids("CAFÉ Café", **{"tokenizer.ggml.normalizer.strip_accents": False}) == [4, 4]


def test_user_defined_pieces_are_always_whole():
    pieces = ["[UNK]", "[CLS]", "[SEP]", "▁a", "<x>"]
    tok = Tokenizer.from_gguf_metadata(
        {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": pieces, "tokenizer.ggml.token_type": [CONTROL] * 3 + [NORMAL, USER_DEFINED],
         "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.seperator_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    )  # fmt: skip
    assert tok.encode_input("a<x>a [CLS]") == [1, 3, 4, 3, 0, 0, 0, 2]
    assert tok.encode("a<x>a [CLS]", add_bos=False) == [3, 4, 3, 1]
