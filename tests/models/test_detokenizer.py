"""IncrementalDetokenizer: streamed pieces never hold a broken character and add
up to the tokenizer's decode of all ids, for byte-level and SentencePiece-style
tokenizers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiny_tokenizer import (
    VOCAB_SIZE,
    gguf_tokenizer_metadata,
    smollm2_metadata,
    train_tiny_tokenizer,
    write_hf_sentencepiece_tokenizer,
)
from trioserve.models.detokenizer import IncrementalDetokenizer
from trioserve.models.tokenizer import Tokenizer

TEXTS = [
    "plain ASCII text, nothing special",
    "accents: café, naïve, Ærøskøbing",
    "CJK: 日本語のテキスト、中文字符",
    "emoji: 🤖🎉 flags 🇫🇷 family 👨‍👩‍👧 end",
    "code:\n\tif x:\n\t\treturn '🙂'\n",
    "🤖",
]


@pytest.fixture(scope="module")
def byte_tok():
    return Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(train_tiny_tokenizer()))


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sp")
    write_hf_sentencepiece_tokenizer(directory)
    tok = Tokenizer.from_hf_dir(directory)
    assert not tok.byte_level
    return tok


def stream(tok, ids, *, skip_special=True):
    """The pieces push() returns for each id, and flush()'s result."""
    detok = IncrementalDetokenizer(tok, skip_special=skip_special)
    return [detok.push(i) for i in ids], detok.flush()


@pytest.mark.parametrize("which", ["byte_tok", "sp_tok"])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_breaks_a_character(request, which, text):
    tok = request.getfixturevalue(which)
    ids = tok.encode(text, add_bos=False)
    pieces, rest = stream(tok, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + rest == text
    assert rest == ""
    if any(ord(c) >= 0x3000 for c in text):
        # A CJK or emoji code point spanned several byte tokens (neither vocab
        # has merges for them) and was held back meanwhile.
        assert "" in pieces


@pytest.mark.parametrize("which", ["byte_tok", "sp_tok"])
def test_flush_of_a_dangling_partial_character(request, which):
    tok = request.getfixturevalue(which)
    ids = tok.encode("ok 🤖", add_bos=False)
    cut = ids[:-1]  # drop the emoji's last byte
    pieces, rest = stream(tok, cut)
    assert "".join(pieces) == "ok "
    assert rest.endswith("\ufffd")
    assert "".join(pieces) + rest == tok.decode(cut)


@pytest.mark.parametrize("which", ["byte_tok", "sp_tok"])
def test_special_tokens_skipped_or_kept(request, which):
    tok = request.getfixturevalue(which)
    special = tok.eos_id
    ids = tok.encode("hi there", add_bos=False)
    pieces, rest = stream(tok, [*ids, special])
    assert pieces[-1] == "" and "".join(pieces) + rest == "hi there"
    pieces, rest = stream(tok, [*ids, special], skip_special=False)
    assert "".join(pieces) + rest == "hi there" + tok.eos_token


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40), skip=st.booleans())
def test_byte_level_stream_equals_decode_for_any_ids(byte_tok, ids, skip):
    pieces, rest = stream(byte_tok, ids, skip_special=skip)
    assert "".join(pieces) + rest == byte_tok.decode(ids, skip_special=skip)


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=30))
def test_sentencepiece_stream_equals_decode_for_any_text(sp_tok, text):
    ids = sp_tok.encode(text, add_bos=False)
    pieces, rest = stream(sp_tok, ids)
    assert not any(p.endswith("\ufffd") for p in pieces)
    assert "".join(pieces) + rest == sp_tok.decode(ids)


@pytest.mark.slow
def test_smollm2_streaming():
    tok = Tokenizer.from_gguf_metadata(smollm2_metadata())
    for text in TEXTS:
        ids = tok.encode(text)
        pieces, rest = stream(tok, ids)
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) + rest == text


@pytest.fixture(scope="module")
def gguf_spm_tok():
    from tests.spm_files import llama_like_vocab, spm_metadata

    return Tokenizer.from_gguf_metadata(spm_metadata(llama_like_vocab()))


@pytest.mark.parametrize("which", ["sp_tok", "gguf_spm_tok"])
def test_an_output_after_a_prompt_keeps_its_first_space(request, which):
    """A SentencePiece decode from the start drops the space its prefix
    added; an output continuing a prompt is not at the start, so its first
    word keeps its space (" world" after "hello", as llama.cpp and vLLM
    stream it), and the pieces are the text of prompt + output less the
    prompt's."""
    tok = request.getfixturevalue(which)
    prompt, full = tok.encode("hello", add_bos=False), tok.encode("hello world again", add_bos=False)
    assert full[: len(prompt)] == prompt
    output = full[len(prompt) :]
    assert tok.decode(output) == "world again"  # a decode of the output alone
    detok = IncrementalDetokenizer(tok, context=prompt[-4:])
    text = "".join(detok.push(i) for i in output) + detok.flush()
    assert text == tok.decode(prompt + output)[len(tok.decode(prompt)) :] == " world again"
    fresh = IncrementalDetokenizer(tok)  # no prompt: the start of a text
    assert "".join(fresh.push(i) for i in output) + fresh.flush() == "world again"
