"""StopMatcher: worked examples, then a property test against str.find."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.state.stops import StopMatcher


def feed(stops, pieces):
    """Push ``pieces`` until a stop; flush if none came. Returns the text
    published and the matcher."""
    m = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, stopped = m.push(piece)
        out.append(text)
        if stopped:
            return "".join(out), m
    out.append(m.flush())
    return "".join(out), m


# --- worked examples -------------------------------------------------------


def test_held_text_released_once_it_cannot_start_a_stop():
    m = StopMatcher(["Hello"])
    # "Hel" could be the start of "Hello": all of it waits.
    assert m.push("Hel") == ("", False)
    assert m.held == 3
    # "Help" cannot: it all goes out at once.
    assert m.push("p") == ("Help", False)
    assert m.held == 0
    assert m.flush() == ""
    assert m.matched is None


def test_only_the_longest_possible_start_is_held():
    m = StopMatcher(["Hello"])
    # "say " can never begin "Hello"; "Hel" can.
    assert m.push("say Hel") == ("say ", False)
    assert m.held == 3
    # Ended without a stop: the held text is released.
    assert m.flush() == "Hel"
    assert m.matched is None


def test_stop_split_across_pieces_is_never_published():
    m = StopMatcher(["</s>"])
    assert m.push("abc<") == ("abc", False)
    assert m.push("/") == ("", False)
    assert m.held == 2
    # Completing the stop drops it and everything after it.
    assert m.push("s>tail") == ("", True)
    assert m.matched == "</s>"
    assert m.held == 0


def test_text_before_a_stop_in_the_same_piece_is_published():
    m = StopMatcher(["STOP"])
    assert m.push("go go STOP and more") == ("go go ", True)
    assert m.matched == "STOP"


def test_overlapping_stops_take_the_earliest_start():
    # "b" completes at index 2 and "ab" at index 1..2: both end on the same
    # character, and "ab" starts first.
    m = StopMatcher(["b", "ab"])
    assert m.push("xa") == ("x", False)  # "a" may begin "ab"
    assert m.push("b") == ("", True)
    assert m.matched == "ab"


def test_repeated_letters_do_not_lose_the_match():
    # Text "aaab", stop "aab": after "aaa" only the last "aa" can still start
    # the stop, so the first "a" is released; then "b" completes it.
    m = StopMatcher(["aab"])
    assert m.push("a") == ("", False)
    assert m.push("a") == ("", False)
    assert m.push("a") == ("a", False)
    assert m.held == 2
    assert m.push("b") == ("", True)
    assert m.matched == "aab"


def test_stop_that_is_a_prefix_of_another():
    # Both start at index 1; the shorter one completes first and ends the
    # output at the same place the longer would have.
    for pieces in (["xabc"], ["x", "a", "b", "c"], ["xa", "bc"]):
        out, m = feed(["abc", "ab"], pieces)
        assert (out, m.matched) == ("x", "ab")
    # "ab" held while "abc" is possible: "ab" itself is a proper prefix.
    m = StopMatcher(["abc", "ab"])
    assert m.push("xa") == ("x", False)
    assert m.push("b") == ("", True)


def test_short_stop_inside_a_longer_one_that_started_earlier_waits():
    # "bc" completes at index 1..2, but "abcd" began at index 0 and may still
    # complete; the earliest start wins, so nothing is decided yet.
    m = StopMatcher(["abcd", "bc"])
    assert m.push("abc") == ("", False)
    assert m.held == 3
    # "d": "abcd" completes and starts first.
    assert m.push("d") == ("", True)
    assert m.matched == "abcd"

    # "x" instead: "abcd" is impossible, so "bc" at index 1 ends the output.
    m = StopMatcher(["abcd", "bc"])
    m.push("abc")
    assert m.push("x") == ("a", True)
    assert m.matched == "bc"

    # The output ends right there: flush settles it the same way.
    m = StopMatcher(["abcd", "bc"])
    m.push("abc")
    assert m.flush() == "a"
    assert m.matched == "bc"


def test_multibyte_characters():
    m = StopMatcher(["终止", "🛑"])
    assert m.push("好的终") == ("好的", False)
    assert m.held == 1  # one character, however many bytes
    assert m.push("止了") == ("", True)
    assert m.matched == "终止"

    out, m = feed(["🛑"], ["hi ", "", "🛑", " there"])
    assert (out, m.matched) == ("hi ", "🛑")

    out, m = feed(["é🙂x"], ["caf", "é", "🙂", "!"])
    assert (out, m.matched) == ("café🙂!", None)


def test_empty_pieces_and_no_stops():
    m = StopMatcher(["end"])
    assert m.push("") == ("", False)
    assert m.push("e") == ("", False)
    assert m.push("") == ("", False)
    assert m.held == 1

    m = StopMatcher([])
    assert m.push("anything at all") == ("anything at all", False)
    assert m.held == 0
    assert m.flush() == ""
    assert m.matched is None


def test_tail_is_bounded_on_long_streams():
    stop = "a" * 50 + "b"
    m = StopMatcher([stop, "zz"])
    published = 0
    for _ in range(20_000):
        text, stopped = m.push("a")
        published += len(text)
        assert not stopped
        assert m.held <= 50
    assert published == 20_000 - 50
    assert m.push("b") == ("", True)


# --- errors ----------------------------------------------------------------


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_empty_stop_string_is_rejected(stops):
    with pytest.raises(ValueError):
        StopMatcher(stops)


def test_a_bare_string_is_rejected():
    with pytest.raises(TypeError):
        StopMatcher("stop")


def test_push_after_stop_raises():
    m = StopMatcher(["x"])
    assert m.push("ax") == ("a", True)
    with pytest.raises(RuntimeError):
        m.push("more")


def test_push_after_flush_raises():
    m = StopMatcher(["x"])
    m.push("a")
    assert m.flush() == ""
    assert m.flush() == ""
    with pytest.raises(RuntimeError):
        m.push("more")


# --- property: any split gives what str.find says --------------------------


def reference(text, stops):
    """Text truncated before the earliest stop, and that stop (the shortest
    of those starting there, since it is the one that completes first)."""
    hits = [(i, len(s), s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    i, _, s = min(hits)
    return text[:i], s


def may_start_stop(tail, stops):
    """Length of the longest suffix of ``tail`` that is a proper prefix of
    some stop: exactly what the matcher may hold back."""
    for k in range(len(tail), 0, -1):
        if any(len(s) > k and s.startswith(tail[-k:]) for s in stops):
            return k
    return 0


ALPHABET = "ab🙂"
texts = st.text(alphabet=ALPHABET, max_size=30)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=4)


@st.composite
def split(draw, text):
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=600, deadline=None)
@given(data=st.data(), text=texts, stops=stop_lists)
def test_any_split_matches_reference(data, text, stops):
    pieces = data.draw(split(text))
    want, want_stop = reference(text, stops)
    longest = max(map(len, stops), default=0)

    m = StopMatcher(stops)
    out = ""
    seen = ""
    stopped = False
    for piece in pieces:
        emitted, stopped = m.push(piece)
        seen += piece
        out += emitted
        # Nothing published reaches into the stop that ends the text.
        assert want.startswith(out)
        if stopped:
            break
        # Held back: exactly the part that may still begin a stop, which is
        # shorter than the longest stop.
        assert m.held == may_start_stop(seen, stops)
        assert m.held < max(longest, 1)
        assert out + seen[len(seen) - m.held :] == seen
        # And it stops as soon as no earlier start is possible.
        early, _ = reference(seen, stops)
        assert not (early != seen and len(early) <= len(seen) - m.held)
    if not stopped:
        out += m.flush()
    assert out == want
    assert m.matched == want_stop
    assert m.held == 0


# --- one automaton per set of stop strings ---------------------------------


def test_matchers_with_the_same_stops_share_one_automaton():
    """n choices of one request (and requests with the same stops) build the
    automaton once; each matcher still keeps its own position."""
    stops = ["abcd", "bc", "xyz"]
    a, b = StopMatcher(stops), StopMatcher(tuple(stops))
    assert a._auto is b._auto
    assert StopMatcher(["other"])._auto is not a._auto
    assert a.push("xa") == ("x", False)
    assert b.push("ab") == ("", False)
    assert a.push("bcd") == ("", True) and a.matched == "abcd"
    assert b.push("z") == ("abz", False)
    assert b.flush() == ""
