"""WordPiece ("bert") vocabularies from GGUF metadata, tokenized the way
llama.cpp's WPM tokenizer does.

llama.cpp's converter writes a BERT vocabulary in a "phantom space" form: a
piece that starts a word ("hello") becomes "▁hello", a continuation piece
("##ing") loses its "##" and becomes "ing", and control pieces ([CLS],
[SEP], ...) stay as they are. Tokenizing then goes:

1. cut the text at special pieces (user-defined ones always; control and
   unknown ones only when special text is parsed), longest first;
2. normalize each text fragment one character at a time: with accent
   stripping (on by default, and by default on when lower-casing is), the
   character is replaced by the first character of its NFD decomposition
   and marks (any \\p{M}) are dropped; control and format characters (\\p{C}
   but whitespace), NUL and U+FFFD are dropped; with lower-casing (on by
   default), the character's simple lower case is taken;
3. split into words at whitespace, and make each punctuation character
   (\\p{P}, or an ASCII symbol) and each CJK ideograph a word of its own;
4. for each word, "▁" + word is covered greedily from the left by the
   longest piece that matches at each position; a word with a position
   that no piece matches is the unknown id, once.

Note what step 2 does that Hugging Face's BertNormalizer does not: a
character is replaced by the *first* character of its decomposition only
(a Hangul syllable becomes its leading consonant jamo), and spacing and
enclosing marks are dropped with the nonspacing ones. And step 4 has no
length limit (Hugging Face's WordPiece makes a word of over 100 characters
the unknown id). These are llama.cpp's behaviour, kept on purpose.

The Unicode tables are Python's `unicodedata` (llama.cpp carries its own,
generated from a newer Unicode release): characters assigned after Python's
Unicode version may be classed differently."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

from trioserve.errors import TokenizerError
from trioserve.models.spm import partition_specials

SPACE = "\u2581"

# tokenizer.ggml.token_type values.
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 0, 1, 2, 3, 4, 5, 6

# llama.cpp's whitespace set (Unicode's White_Space property).
_WHITESPACE = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)
# CJK ideograph blocks that are words of their own: BERT's list, including
# its 0x2B920 start of the extension E/F range (llama.cpp follows it).
_CJK = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)  # fmt: skip

_CACHE_LIMIT = 200_000  # words cached, then the cache starts over
_CACHED_WORD = 128  # longer words are not cached
_CHAR_LIMIT = 200_000  # characters whose normalization is kept, then that table starts over


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK)


def _simple_lower(ch: str) -> str:
    """One character's simple lower-case mapping (one character): Python's
    full mapping where it is one character; otherwise its first character
    (U+0130, the only character with a longer unconditional lower case,
    whose simple mapping is "i")."""
    low = ch.lower()
    return low if len(low) == 1 else low[0]


class WpmVocab:
    """One WordPiece vocabulary in llama.cpp's phantom-space form: encoding
    text to ids and each id's bytes. Read-only after construction (its
    caches aside), so threads may share it."""

    def __init__(
        self,
        tokens: Sequence[str],
        types: Sequence[int] | None,
        *,
        lowercase: bool = True,
        strip_accents: bool | None = None,
        unk_id: int | None,
    ) -> None:
        """`types` None: the file has none, and every piece is normal (as
        llama.cpp then reads it: no piece is special). `strip_accents` None:
        as `lowercase`."""
        n = len(tokens)
        if types is None:
            types = [NORMAL] * n
        elif len(types) != n:
            raise TokenizerError(f"{len(types)} token types for {n} tokens")
        if unk_id is not None and not 0 <= unk_id < n:
            raise TokenizerError(f"unknown token id {unk_id} is outside the vocabulary of {n}")
        # llama.cpp names an empty piece so, and matches it under that name.
        self.tokens: list[str] = [tok if tok else f"[EMPTY_{i}]" for i, tok in enumerate(tokens)]
        self.types: list[int] = [int(t) for t in types]
        self.lowercase = bool(lowercase)
        self.strip_accents = self.lowercase if strip_accents is None else bool(strip_accents)
        self.unk_id = unk_id
        ids: dict[str, int] = {}
        for i, tok in enumerate(self.tokens):
            if ids.setdefault(tok, i) != i:
                raise TokenizerError(f"duplicate token in the vocabulary: {tok!r} has ids {ids[tok]} and {i}")
        self._ids = ids
        # The piece lengths there are, longest first: the lengths a match can have.
        self._lengths = sorted({len(tok) for tok in self.tokens}, reverse=True)
        # Special pieces, longest (in UTF-8 bytes, as llama.cpp sorts them) first, then by id.
        specials = [i for i, t in enumerate(self.types) if t in (CONTROL, UNKNOWN, USER_DEFINED)]
        specials.sort(key=lambda i: (-len(self.tokens[i].encode("utf-8", "surrogatepass")), i))
        self._specials = [(self.tokens[i], i, self.types[i] == USER_DEFINED) for i in specials]
        self._special_heads = frozenset(self.tokens[i][0] for i in specials)
        self._chars: dict[int, str | None] = {}  # code point -> its normalized form for str.translate
        self._cache: dict[str, tuple[int, ...]] = {}

    # ---- encoding ----

    def encode(self, text: str, *, parse_special: bool) -> list[int]:
        """The ids of `text`, with no [CLS]/[SEP]. Control and unknown pieces'
        text is matched as their ids only with `parse_special`; user-defined
        pieces' always."""
        out: list[int] = []
        for part in self._partition(text, parse_special):
            if isinstance(part, int):
                out.append(part)
            else:
                self._encode_fragment(part, out)
        return out

    def words(self, text: str) -> list[str]:
        """`text` normalized and split into words, as llama.cpp's WPM
        preprocessing gives them (no special pieces cut out)."""
        return [word for word in self._normalize(text).split(" ") if word]

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        return partition_specials(text, self._specials, self._special_heads, parse_special)

    def _encode_fragment(self, text: str, out: list[int]) -> None:
        cache = self._cache
        for word in self._normalize(text).split(" "):
            if not word:
                continue
            ids = cache.get(word)
            if ids is None:
                ids = self._match(word)
                if len(word) <= _CACHED_WORD:
                    if len(cache) >= _CACHE_LIMIT:
                        cache.clear()
                    cache[word] = ids
            out.extend(ids)

    def _normalize(self, text: str) -> str:
        """`text` with each character replaced by what llama.cpp's
        preprocessing makes of it, words separated by single spaces (empty
        words may come out: the caller skips them)."""
        table = self._chars
        new = {ord(c) for c in set(text)}.difference(table)
        if new:
            if len(table) + len(new) > _CHAR_LIMIT:
                # A new table (threads still using the old one keep it whole).
                table = {}
                new = {ord(c) for c in set(text)}
            for cp in new:
                table[cp] = self._char(cp)
            self._chars = table
        return text.translate(table)

    def _char(self, cp: int) -> str | None:
        """One code point's part in the words: a space where it separates
        words, None where it is dropped, itself (normalized) where it belongs
        to a word, and itself between spaces where it is a word alone."""
        ch = chr(cp)
        if self.strip_accents:
            decomposed = unicodedata.normalize("NFD", ch) if not 0xD800 <= cp <= 0xDFFF else ch
            ch = decomposed[0]
        cp = ord(ch)
        if cp in _WHITESPACE:
            return " "
        category = unicodedata.category(ch)
        if cp == 0 or cp == 0xFFFD or category in ("Cc", "Cf", "Co", "Cs"):
            return None
        if self.strip_accents and category[0] == "M":
            return None
        if self.lowercase:
            ch = _simple_lower(ch)
        if category[0] == "P" or (cp < 0x7F and category[0] == "S") or _is_cjk(cp):
            return f" {ch} "
        return ch

    def _match(self, word: str) -> tuple[int, ...]:
        """Greedy longest-match-first over "▁" + `word`; the unknown id for a
        word with a position no piece matches."""
        ids = self._ids
        text = SPACE + word
        n = len(text)
        out: list[int] = []
        i = 0
        while i < n:
            for size in self._lengths:
                if size > n - i:
                    continue
                tid = ids.get(text[i : i + size])
                if tid is not None:
                    out.append(tid)
                    i += size
                    break
            else:
                if self.unk_id is None:
                    raise TokenizerError(f"the word {word[:40]!r} has no pieces and the vocabulary has no unknown token")
                return (self.unk_id,)
        return tuple(out)

    # ---- decoding ----

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, as llama.cpp's token_to_piece gives them with
        special text shown: normal pieces with "▁" as a space (" hello",
        "ing"), control, unknown and user-defined pieces as their text,
        the rest (unused, undefined, byte) as nothing."""
        out = []
        for tok, kind in zip(self.tokens, self.types, strict=True):
            if kind == NORMAL:
                out.append(tok.replace(SPACE, " ").encode("utf-8", "surrogatepass"))
            elif kind in (CONTROL, UNKNOWN, USER_DEFINED):
                out.append(tok.encode("utf-8", "surrogatepass"))
            else:
                out.append(b"")
        return out

    def hf_tokens(self) -> list[str]:
        """The vocabulary back in Hugging Face's WordPiece form: a piece that
        starts with "▁" without it, any other non-control piece with "##"
        before it, control and unknown pieces as they are. A piece whose form
        another earlier piece already has is written "[WPM_<id>]"."""
        seen: set[str] = set()
        out = []
        for i, (tok, kind) in enumerate(zip(self.tokens, self.types, strict=True)):
            if kind in (CONTROL, UNKNOWN):
                form = tok
            elif tok.startswith(SPACE):
                form = tok[1:]
            else:
                form = "##" + tok
            extra = 0
            while not form or form in seen:
                form = f"[WPM_{i}{'_' * extra}]"
                extra += 1
            seen.add(form)
            out.append(form)
        return out
