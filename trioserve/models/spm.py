"""SentencePiece ("llama") vocabularies from GGUF metadata, tokenized the way
llama.cpp tokenizes them.

A GGUF with `tokenizer.ggml.model = "llama"` carries pieces, a score per piece
and a type per piece, but no merges. llama.cpp's SPM tokenizer starts from one
symbol per character and repeatedly joins the adjacent pair whose joined text
is a piece with the highest score (on a tie, the leftmost pair), until no
adjacent pair joins into a piece. A symbol left that is not a piece (an
unmerged character outside the vocabulary) becomes its UTF-8 bytes as the
`<0xNN>` byte pieces. Spaces are written as U+2581 ("▁"), and a text gets a
leading space when the vocabulary says `add_space_prefix` (the default).

Before any of that the text is cut at special pieces: user-defined pieces
(type 4) always, control and unknown pieces (types 3 and 2) only when special
text is to be parsed; each piece is taken longest first, as llama.cpp does,
and a text fragment that follows one (or starts the text) gets the leading
space.

The merge loop is ours rather than the `tokenizers` library's: a BPE model
there ranks merges one by one, so pieces of equal score, or one piece
reachable from two overlapping pairs (runs like "▁▁▁"), can come out
differently from llama.cpp's score-then-position order. To keep it fast, text
is cut into words where no piece can span the cut (before a "▁" that follows
another character, when no piece has such a "▁" inside it), and each word's
ids are cached."""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence

from trioserve.errors import TokenizerError

SPACE = "\u2581"

# tokenizer.ggml.token_type values (SentencePiece's piece types).
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 0, 1, 2, 3, 4, 5, 6

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# A run of "▁" and the characters up to the next "▁": words no piece spans
# when no piece has a "▁" after another character.
_WORD = re.compile(f"{SPACE}*[^{SPACE}]+|{SPACE}+")

_CACHE_LIMIT = 200_000  # words cached, then the cache starts over
_CACHED_WORD = 128  # longer words are not cached


def byte_piece(b: int) -> str:
    """The byte-fallback piece for byte `b` (upper-case hex, as llama.cpp looks it up)."""
    return f"<0x{b:02X}>"


def partition_specials(text: str, specials, heads: frozenset[str] | set[str], parse_special: bool) -> list[str | int]:
    """`text` as fragments of text and ids of special pieces: each piece of
    ``specials`` ((piece, id, always), longest first; ``always``: cut even
    when special text is not parsed) cut out of the text fragments left at
    its turn, left to right without overlaps (llama.cpp's
    tokenizer_st_partition). ``heads``: the pieces' first characters."""
    parts: list[str | int] = [text] if text else []
    if not specials or not text:
        return parts
    present = heads.intersection(text)
    if not present:
        return parts
    for piece, tid, always in specials:
        if not (always or parse_special) or piece[0] not in present or piece not in text:
            continue
        cut: list[str | int] = []
        for part in parts:
            if isinstance(part, int) or piece not in part:
                cut.append(part)
                continue
            for k, rest in enumerate(part.split(piece)):
                if k:
                    cut.append(tid)
                if rest:
                    cut.append(rest)
        parts = cut
    return parts


class SpmVocab:
    """One SentencePiece vocabulary: encoding text to ids and each id's bytes.
    Read-only after construction (the word cache aside), so threads may share it."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        types: Sequence[int] | None,
        *,
        add_space_prefix: bool,
        unk_id: int | None,
        control_ids: Sequence[int] = (),
    ) -> None:
        """`types` None: the file has no token types; every piece is normal
        then, except `control_ids` (its BOS/EOS/UNK ids) and `<0xNN>` pieces,
        which still decode to their byte."""
        n = len(tokens)
        if len(scores) != n:
            raise TokenizerError(f"{len(scores)} token scores for {n} tokens")
        if types is None:
            types = [NORMAL] * n
            for i in control_ids:
                types[i] = CONTROL
            for i, tok in enumerate(tokens):
                if types[i] == NORMAL and _BYTE_PIECE.fullmatch(tok):
                    types[i] = BYTE
        elif len(types) != n:
            raise TokenizerError(f"{len(types)} token types for {n} tokens")
        self.tokens: list[str] = [tok if tok else f"[EMPTY_{i}]" for i, tok in enumerate(tokens)]
        self.types: list[int] = [int(t) for t in types]
        self.scores: list[float] = [float(s) for s in scores]
        self.add_space_prefix = add_space_prefix
        self.unk_id = unk_id
        ids: dict[str, int] = {}
        for i, tok in enumerate(self.tokens):
            if ids.setdefault(tok, i) != i:
                raise TokenizerError(f"duplicate token in the vocabulary: {tok!r} has ids {ids[tok]} and {i}")
        self._ids = ids
        self._byte_ids: list[int | None] = [ids.get(byte_piece(b)) for b in range(256)]
        # Cut at "▁" only if no piece has a "▁" right after another character.
        self._words = not any(SPACE in tok.lstrip(SPACE) for tok in self.tokens)
        self._cache: dict[str, tuple[int, ...]] = {}
        # Longest first (ties: lower id first), as llama.cpp matches them.
        specials = [i for i, t in enumerate(self.types) if t in (CONTROL, UNKNOWN, USER_DEFINED)]
        specials.sort(key=lambda i: -len(self.tokens[i]))
        self._specials = [(self.tokens[i], i, self.types[i] == USER_DEFINED) for i in specials]
        self._special_heads = frozenset(self.tokens[i][0] for i in specials)

    # ---- encoding ----

    def encode(self, text: str, *, parse_special: bool) -> list[int]:
        """The ids of `text` (no BOS/EOS). Control and unknown pieces are
        matched as whole ids only with `parse_special`; user-defined ones always."""
        out: list[int] = []
        after_special = True  # the text's start counts as one
        for part in self._partition(text, parse_special):
            if isinstance(part, int):
                out.append(part)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                part = " " + part
            self._encode_fragment(part.replace(" ", SPACE), out)
            after_special = False
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        return partition_specials(text, self._specials, self._special_heads, parse_special)

    def _encode_fragment(self, text: str, out: list[int]) -> None:
        """Append the ids of one text fragment, spaces already written as "▁"."""
        if not text:
            return
        cache = self._cache
        words = _WORD.findall(text) if self._words else [text]
        for word in words:
            ids = cache.get(word)
            if ids is None:
                ids = self._merge(word)
                if len(word) <= _CACHED_WORD:
                    if len(cache) >= _CACHE_LIMIT:
                        cache.clear()
                    cache[word] = ids
            out.extend(ids)

    def _merge(self, word: str) -> tuple[int, ...]:
        """llama.cpp's merge loop over one word: a heap of adjacent pairs
        whose joined text is a piece, best score first, then leftmost.
        Symbol `i` spans word[i:end[i]]; a symbol merged away has end -1."""
        ids = self._ids
        n = len(word)
        if n == 1:
            tid = ids.get(word)
            return (tid,) if tid is not None else tuple(self._fallback(word))
        scores = self.scores
        end = list(range(1, n + 1))
        prev = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []
        push = heapq.heappush
        for i in range(n - 1):
            tid = ids.get(word[i : i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        pop = heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            # Stale unless both symbols are still exactly the pair pushed.
            if end[left] != right or end[right] != left + size:
                continue
            stop = end[right]
            end[left] = stop
            end[right] = -1
            if stop < n:
                prev[stop] = left
                after = end[stop]
                tid = ids.get(word[left:after])
                if tid is not None:
                    push(heap, (-scores[tid], left, stop, after - left))
            before = prev[left]
            if before >= 0:
                tid = ids.get(word[before:stop])
                if tid is not None:
                    push(heap, (-scores[tid], before, left, stop - before))
        out: list[int] = []
        i = 0
        while i < n:
            j = end[i]
            tid = ids.get(word[i:j])
            if tid is not None:
                out.append(tid)
            else:  # an unmerged character that is no piece
                self._fallback(word[i:j], out)
            i = j
        return tuple(out)

    def _fallback(self, char: str, out: list[int] | None = None) -> list[int]:
        """A character that is no piece as its UTF-8 bytes' `<0xNN>` pieces;
        a byte without one (a vocabulary with no byte pieces) as the unknown
        id, consecutive unknowns fused into one, as SentencePiece does."""
        if out is None:
            out = []
        for b in char.encode("utf-8", "surrogatepass"):
            tid = self._byte_ids[b]
            if tid is None:
                if self.unk_id is None:
                    raise TokenizerError(f"{char!r} has no piece, no byte piece and the vocabulary has no unknown token")
                if out and out[-1] == self.unk_id:
                    continue
                tid = self.unk_id
            out.append(tid)
        return out

    # ---- decoding ----

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, as llama.cpp's token_to_piece gives them with
        special text shown: normal pieces with "▁" as a space, byte pieces
        as their byte, control, unknown and user-defined pieces as their
        text, unused and undefined pieces as nothing."""
        out = []
        for tok, kind in zip(self.tokens, self.types, strict=True):
            if kind == NORMAL:
                out.append(tok.replace(SPACE, " ").encode())
            elif kind == BYTE:
                match = _BYTE_PIECE.fullmatch(tok)
                out.append(bytes([int(match.group(1), 16)]) if match else tok.replace(SPACE, " ").encode())
            elif kind in (CONTROL, UNKNOWN, USER_DEFINED):
                out.append(tok.encode())
            else:
                out.append(b"")
        return out

    # ---- a `tokenizers` twin ----

    def merges(self) -> list[tuple[str, str]]:
        """BPE merges equivalent to the scores where scores decide (best
        first; for one piece, the split with the longer left part first):
        every split of a piece into two pieces. For the `tokenizers` copy
        other libraries read (llguidance); encoding does not use it."""
        ids, scores, tokens = self._ids, self.scores, self.tokens
        found = []
        for tid, tok in enumerate(tokens):
            if self.types[tid] != NORMAL and self.types[tid] != USER_DEFINED:
                continue
            for k in range(len(tok) - 1, 0, -1):
                if tok[:k] in ids and tok[k:] in ids:
                    found.append((-scores[tid], tid, -k, tok[:k], tok[k:]))
        found.sort()
        return [(a, b) for *_, a, b in found]
