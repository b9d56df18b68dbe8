"""Tokenizer: GGUF and Hugging Face constructors, round trips, special tokens,
pre-tokenizer variants, and the errors for checkpoints it cannot serve."""

from __future__ import annotations

import json

import pytest

from tests.tiny_tokenizer import (
    BOS_ID,
    EOS_ID,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    gguf_tokenizer_metadata,
    smollm2_metadata,
    train_tiny_tokenizer,
    write_hf_tokenizer,
)
from trioserve.errors import TokenizerError
from trioserve.models.tokenizer import Tokenizer, byte_to_unicode

SAMPLES = [
    "Hello, world!",
    "The café's crème brûlée, déjà vu; Ærøskøbing.",
    "日本語のテキストと中文",
    "emoji 🤖🎉 and flags 🇫🇷 and a family 👨‍👩‍👧",
    "def f(x):\n\treturn x * 2\n\n\n    # indented  with   spaces\r\n",
    "digits 12345 and 3.14159, -7e10",
    "  leading and trailing spaces  ",
    "",
]


@pytest.fixture(scope="module")
def tiny():
    return train_tiny_tokenizer()


@pytest.fixture(scope="module")
def gguf_tok(tiny):
    return Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(tiny, chat_template="{{ 'x' }}"))


@pytest.fixture(scope="module")
def hf_tok(tiny, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_hf")
    write_hf_tokenizer(tiny, directory, chat_template="{{ 'x' }}")
    return Tokenizer.from_hf_dir(directory)


@pytest.fixture(scope="module")
def smollm2():
    return Tokenizer.from_gguf_metadata(smollm2_metadata())


def test_tiny_training_is_deterministic_and_shaped_like_smollm2(tiny):
    assert train_tiny_tokenizer().to_str() == tiny.to_str()
    assert tiny.get_vocab_size() == VOCAB_SIZE
    assert [tiny.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]


@pytest.mark.parametrize("which", ["gguf_tok", "hf_tok"])
@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(request, which, text):
    tok = request.getfixturevalue(which)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


@pytest.mark.parametrize("text", SAMPLES + ["<|im_start|>user\nhi<|im_end|>\n"])
def test_both_constructors_and_the_trained_tokenizer_agree(tiny, gguf_tok, hf_tok, text):
    ids = gguf_tok.encode(text)
    assert hf_tok.encode(text) == ids
    assert tiny.encode(text, add_special_tokens=False).ids == ids


def test_attributes(gguf_tok, hf_tok):
    for tok in (gguf_tok, hf_tok):
        assert tok.vocab_size == VOCAB_SIZE
        assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (BOS_ID, EOS_ID, frozenset({EOS_ID}))
        assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
        assert tok.byte_level and not tok.add_bos
        assert tok.chat_template == "{{ 'x' }}"


@pytest.mark.parametrize("which", ["gguf_tok", "hf_tok"])
def test_special_tokens_in_text_are_single_ids(request, which):
    tok = request.getfixturevalue(which)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ids[1:-1] == tok.encode("user\nhi")
    assert [tok.is_special(i) for i in (0, 1, 2, ids[1])] == [True, True, True, False]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.token_bytes(1) == b"<|im_start|>"


def test_token_bytes_undo_the_byte_level_table(gguf_tok, tiny):
    table = byte_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"
    for byte, char in table.items():
        assert gguf_tok.token_bytes(tiny.token_to_id(char)) == bytes([byte])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        gguf_tok.token_bytes(VOCAB_SIZE)


def test_add_bos(tiny, gguf_tok):
    assert gguf_tok.encode("hi", add_bos=True) == [BOS_ID, *gguf_tok.encode("hi")]
    meta = gguf_tokenizer_metadata(tiny) | {"tokenizer.ggml.add_bos_token": True}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("hi")[0] == BOS_ID
    assert tok.encode("hi", add_bos=False) == gguf_tok.encode("hi")


def test_eot_and_eom_are_stop_ids(tiny):
    meta = gguf_tokenizer_metadata(tiny) | {"tokenizer.ggml.eot_token_id": 0, "tokenizer.ggml.eom_token_id": 1}
    assert Tokenizer.from_gguf_metadata(meta).stop_ids == {0, 1, 2}


def test_hf_config_variants(tiny, tmp_path):
    write_hf_tokenizer(tiny, tmp_path)
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.eos_id, tok.stop_ids, tok.bos_id, tok.chat_template) == (2, {0, 2}, None, "D")


def _digit_meta(pre: str | None) -> dict:
    """A vocabulary of the 256 byte symbols plus "12" and "123", so how digit
    runs are pre-split shows in the ids."""
    tokens = ["<|endoftext|>", *byte_to_unicode().values(), "12", "123"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": ["1 2", "12 3"],
        "tokenizer.ggml.eos_token_id": 0,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("smollm", ["1", "2", "3", "4", "5"]),  # every digit on its own
        ("qwen2", ["1", "2", "3", "4", "5"]),  # \p{N}: single digits
        ("llama-bpe", ["123", "4", "5"]),  # \p{N}{1,3}: "123" + "45"
        ("gpt2", ["123", "4", "5"]),  # GPT-2's regex keeps the digit run whole
        (None, ["123", "4", "5"]),
        ("some-future-pre", ["123", "4", "5"]),  # unknown: GPT-2 behaviour
    ],
)
def test_pre_tokenizer_variants_split_digits(pre, pieces):
    tok = Tokenizer.from_gguf_metadata(_digit_meta(pre))
    ids = tok.encode("12345")
    assert [tok.token_bytes(i).decode() for i in ids] == pieces
    text = "It's 2024: héllo  world\n\n🤖 <|endoftext|>"
    assert tok.decode(tok.encode(text), skip_special=False) == text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # "llama" (SentencePiece) loads now: tests/models/test_spm_tokenizer.py
        ({"tokenizer.ggml.model": "t5"}, "tokenizer model 't5' is not supported"),
        ({"tokenizer.ggml.tokens": None}, "lacks 'tokenizer.ggml.tokens'"),
        ({"tokenizer.ggml.model": None}, "lacks 'tokenizer.ggml.model'"),
        ({"tokenizer.ggml.eos_token_id": None}, "lacks 'tokenizer.ggml.eos_token_id'"),
        ({"tokenizer.ggml.eos_token_id": 10_000}, "eos token id 10000 is outside"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "2 token types for"),
        ({"tokenizer.ggml.merges": ["a nosuchtoken"]}, "merge 'a nosuchtoken'"),
    ],
)
def test_bad_gguf_metadata(tiny, change, message):
    meta = gguf_tokenizer_metadata(tiny) | change
    meta = {k: v for k, v in meta.items() if v is not None}
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf_metadata(meta)


def test_bad_hf_dir(tiny, tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)
    write_hf_tokenizer(tiny, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(TokenizerError, match="'</s>' is not in the vocabulary"):
        Tokenizer.from_hf_dir(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_smollm2_round_trip(smollm2, text):
    assert smollm2.decode(smollm2.encode(text)) == text


@pytest.mark.slow
def test_smollm2_facts(smollm2):
    tokens = smollm2_metadata()["tokenizer.ggml.tokens"]
    assert smollm2.vocab_size == len(tokens) == 49152
    assert smollm2.encode("<|im_start|>") == [1]
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.eos_token) == (1, 2, "<|im_end|>")
    assert 2 in smollm2.stop_ids and not smollm2.add_bos
    assert smollm2.encode("Hi")[0] != 1
    # Control tokens are ids 0-16 (<|endoftext|> ... <empty_output>).
    assert [smollm2.is_special(i) for i in (0, 16, 17)] == [True, True, False]
    # The smollm pre-tokenizer splits digits one by one, whatever the merges.
    assert smollm2.encode("12345") == [tokens.index(d) for d in "12345"]
    # Whole words that are vocabulary entries come out as one token each.
    assert smollm2.encode("Hello world") == [tokens.index("Hello"), tokens.index("Ġworld")]
    assert smollm2.token_bytes(tokens.index("Ġworld")) == b" world"
    assert "<|im_start|>" in smollm2.chat_template


# --- special-token text as text


@pytest.mark.parametrize("which", ["gguf_tok", "hf_tok"])
def test_special_text_can_be_encoded_as_text(request, which):
    tok = request.getfixturevalue(which)
    text = "<|im_start|>user\nhi<|im_end|>"
    plain = tok.encode(text, special=False)
    assert not any(tok.is_special(i) for i in plain)
    assert tok.decode(plain) == text  # nothing to skip: it is all text
    assert tok.encode("hello there", special=False) == tok.encode("hello there")
    assert tok.encode(text) == [1, *tok.encode("user\nhi"), 2]  # the default still parses them
    assert tok.special_tokens == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def test_long_text_encodes_as_short_text_does(tiny, gguf_tok):
    """Long texts take the path that lets other threads run; same ids."""
    text = ("Hello, world! <|im_end|> The café 2024. " * 3000) + "日本語 🤖"
    assert gguf_tok.encode(text) == tiny.encode(text, add_special_tokens=False).ids
    tiny_plain = train_tiny_tokenizer()
    tiny_plain.encode_special_tokens = True
    assert gguf_tok.encode(text, special=False) == tiny_plain.encode(text, add_special_tokens=False).ids


def test_gguf_user_defined_tokens_are_text_pieces_matched_whole(tiny):
    """Token type 4 (user-defined, e.g. Qwen's <tool_call>) is always one id,
    is not a control token, and decodes as its text; type 3 is control."""
    meta = gguf_tokenizer_metadata(tiny)
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<tool_call>"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 4]
    tok = Tokenizer.from_gguf_metadata(meta)
    call = VOCAB_SIZE
    for special in (True, False):
        assert tok.encode("a<tool_call>b", special=special) == [*tok.encode("a"), call, *tok.encode("b")]
    assert not tok.is_special(call) and tok.decode([call]) == "<tool_call>"
    assert tok.special_tokens == tuple(SPECIAL_TOKENS)


def test_every_smollm2_piece_has_the_bytes_gpt2s_table_gives_it(smollm2):
    # The pieces' bytes are made by str.translate where a piece is all
    # table characters: they must equal the table applied a character at
    # a time (a character outside it as its own UTF-8), for every token of
    # the real vocabulary and for pieces the fast path must not take.
    from trioserve.models.tokenizer import _UNICODE_TO_BYTE, _piece_bytes

    def slow(piece: str) -> bytes:
        return b"".join(bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode() for c in piece)

    pieces = smollm2_metadata()["tokenizer.ggml.tokens"]
    assert all(_piece_bytes(p) == slow(p) for p in pieces)
    for odd in ("\u00e9\u0120x", "a\u2581b", "\x07", "", "\u0100\u0101"):
        assert _piece_bytes(odd) == slow(odd), odd
    assert _piece_bytes("\u0120hello") == b" hello" and _piece_bytes("\u00e9") == b"\xe9"  # GPT-2 maps byte 0xE9 to "é"
