"""The output parser: the same content, reasoning and calls however the text
is cut into pieces (character by character, token-sized, at random), the
streamed deltas adding up to the final result, and malformed calls given
back as plain content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.models.output_parser import Delta, OutputParser, Parsed, merge, parse_call

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
TEXT = "<think>Check the weather first.</think>Let me look." + CALL + "\n" + CALL.replace("Paris", "Rome")


def run(pieces, *, tools=True, reasoning=True) -> tuple[Parsed, list[Delta]]:
    parser = OutputParser(tools=tools, reasoning=reasoning)
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    return parser.result(), deltas


def cut(text: str, points) -> list[str]:
    points = sorted(set(p % (len(text) + 1) for p in points))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def test_whole_text_splits_into_channels():
    parsed, deltas = run([TEXT])
    assert parsed.reasoning == "Check the weather first."
    assert parsed.content == "Let me look."  # the newline between the calls is no content
    assert [(c.index, c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (0, "call-0", "get_weather", {"city": "Paris", "days": 2}),
        (1, "call-1", "get_weather", {"city": "Rome", "days": 2}),
    ]
    assert merge(deltas) == parsed


def test_character_by_character_gives_the_same_result_and_deltas_add_up():
    whole, _ = run([TEXT])
    parsed, deltas = run(list(TEXT))
    assert parsed == whole and merge(deltas) == whole
    # Nothing that could not be a marker is held back: the first content delta
    # arrives before the first call is complete.
    kinds = ["call" if d.tool_call else "content" if d.content else "reasoning" for d in deltas]
    assert kinds.index("content") < kinds.index("call")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TEXT)), max_size=40))
def test_any_cutting_gives_the_same_result(points):
    whole, _ = run([TEXT])
    parsed, deltas = run(cut(TEXT, points))
    assert parsed == whole and merge(deltas) == whole


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="<>/thinkoolcal_{}\":ab ", max_size=60), st.lists(st.integers(min_value=0, max_value=60), max_size=10))
def test_arbitrary_text_never_fails_and_loses_nothing(text, points):
    whole, _ = run([text])
    parsed, deltas = run(cut(text, points))
    assert parsed == whole and merge(deltas) == whole
    # Every character is accounted for: content + reasoning + calls + markers.
    if not parsed.tool_calls and "<think>" not in text:
        assert parsed.content == text


def test_markers_split_across_tokens():
    pieces = ["Hi <", "thi", "nk>deep</th", "ink> done <tool", "_call>", '{"name": "f", "arguments": {}}', "</tool_", "call>"]
    parsed, deltas = run(pieces)
    assert (parsed.content, parsed.reasoning) == ("Hi  done", "deep")  # the space before the call is no content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", "{}")]
    assert merge(deltas) == parsed


def test_a_lone_angle_bracket_is_held_only_while_it_could_be_a_marker():
    parser = OutputParser(tools=True, reasoning=True)
    assert parser.feed("a <") == [Delta(content="a")]  # the space waits: a call may come next
    assert parser.feed("b") == [Delta(content=" <b")]
    assert parser.feed("<tool_cal") == []
    assert parser.feed("X") == [Delta(content="<tool_calX")]


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        '{"name": "f", "arguments": [1, 2]}',  # arguments must be an object
        '{"arguments": {}}',  # no name
        '{"name": "", "arguments": {}}',
        '["f", {}]',
        '{"name": "f", "arguments": "{broken"}',
    ],
)
def test_malformed_calls_degrade_to_plain_content(body):
    text = f"before <tool_call>{body}</tool_call> after"
    parsed, deltas = run(list(text))
    assert parsed.tool_calls == () and parsed.content == text
    assert merge(deltas) == parsed


def test_an_unclosed_call_is_recovered_if_it_parses_else_content():
    parsed, _ = run(['x<tool_call>{"name": "f", "arguments": {"a": 1}}\n'])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", '{"a":1}')] and parsed.content == "x"
    half = 'x<tool_call>{"name": "f", "argu'
    parsed, _ = run(list(half))
    assert parsed.tool_calls == () and parsed.content == half


def test_arguments_given_as_a_json_string_are_accepted():
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ("f", '{"a":1}')


def test_channels_that_are_off_stay_content():
    parsed, _ = run([TEXT], tools=False, reasoning=False)
    assert parsed.content == TEXT and parsed.reasoning == "" and parsed.tool_calls == ()
    parsed, _ = run([TEXT], tools=True, reasoning=False)
    assert parsed.content.startswith("<think>Check") and len(parsed.tool_calls) == 2


def test_an_unclosed_think_is_all_reasoning():
    parsed, _ = run(list("<think>still thinking"))
    assert (parsed.reasoning, parsed.content) == ("still thinking", "")


def test_a_closing_tag_inside_an_argument_string_does_not_end_the_call():
    text = '<tool_call>{"name": "echo", "arguments": {"text": "a</tool_call>b"}}</tool_call> done'
    for pieces in ([text], list(text)):
        parsed, deltas = run(pieces)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("echo", {"text": "a</tool_call>b"})]
        assert parsed.content == " done" and merge(deltas) == parsed


def test_whitespace_between_calls_is_not_content_streamed_or_buffered():
    text = CALL + "\n\n" + CALL + "\n"
    parsed, deltas = run(list(text))
    assert parsed.content == "" and len(parsed.tool_calls) == 2
    assert all(not d.content for d in deltas)
    # ... but whitespace that content follows is kept, in order
    parsed, _ = run(list(CALL + "\n\nThat is all."))
    assert parsed.content == "\n\nThat is all."
    parsed, _ = run(["  \n"])
    assert parsed.content == "  \n"  # no calls: whitespace is the answer


@pytest.mark.parametrize("pieces", [["<tool_call>oops</tool_call> then <tool_call>", '{"name": "f", "arguments": {}}</tool_call>'], ["<tool_call>{} junk</tool_call>ok"]])
def test_a_malformed_call_ends_at_its_first_closing_tag_and_parsing_goes_on(pieces):
    parsed, deltas = run(pieces)
    text = "".join(pieces)
    first_end = text.index("</tool_call>") + len("</tool_call>")
    assert parsed.content.startswith(text[:first_end])
    assert merge(deltas) == parsed
    whole, _ = run(list(text))
    assert whole == parsed
