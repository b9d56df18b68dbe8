"""The request schemas of the OpenAI routes: what a valid body becomes, the one
RequestError (field path and message) that each bad body gets, the features
refused by name, and the mapping onto SamplingParams."""

from __future__ import annotations

import pytest

from trioserve.errors import RequestError
from trioserve.http.edge import sampling_params
from trioserve.http.chat_parts import MAX_TOOLS, ChatMessage, ContentPart
from trioserve.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    make_converter,
    parse_chat_request,
    parse_completion_request,
)
from trioserve.types import SamplingParams

USER = {"role": "user", "content": "hi"}


def chat(**fields: object) -> dict:
    """A valid chat body with ``fields`` added or replaced."""
    return {"messages": [USER], **fields}


def completion(**fields: object) -> dict:
    return {"prompt": "Once upon a time", **fields}


# --- valid bodies


def test_minimal_chat_request() -> None:
    assert parse_chat_request(chat()) == ChatCompletionRequest(messages=(ChatMessage(role="user", content="hi"),))


def test_full_chat_request() -> None:
    body = {
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": "Be brief.", "name": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 10,
        "max_completion_tokens": 20,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "stop": ["\n\n", "END"],
        "seed": -7,
        "n": 3,
        "logit_bias": {"123": -100, "7": 2.5},
        "logprobs": True,
        "top_logprobs": 5,
        "user": "someone",
        "ignore_eos": True,
    }
    assert parse_chat_request(body) == ChatCompletionRequest(
        model="smollm2",
        messages=(
            ChatMessage(role="system", content="Be brief.", name="rules"),
            ChatMessage(role="user", content=(ContentPart(type="text", text="a"), ContentPart(type="text", text="b"))),
            ChatMessage(role="assistant", content=None),
            ChatMessage(role="tool", content="42", tool_call_id="call_1"),
        ),
        stream=True,
        stream_options=StreamOptions(include_usage=True),
        max_tokens=10,
        max_completion_tokens=20,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        stop=("\n\n", "END"),
        seed=-7,
        n=3,
        logit_bias={123: -100.0, 7: 2.5},
        logprobs=True,
        top_logprobs=5,
        user="someone",
        ignore_eos=True,
    )


def test_minimal_completion_request() -> None:
    assert parse_completion_request({"prompt": "x"}) == CompletionRequest(prompt="x")


def test_full_completion_request() -> None:
    body = {
        "model": "smollm2",
        "prompt": ["a", "b"],
        "stream": True,
        "stream_options": {"include_usage": False},
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 1,
        "top_k": -1,
        "min_p": 0,
        "presence_penalty": 2,
        "frequency_penalty": -2,
        "repetition_penalty": 2,
        "stop": "\n",
        "seed": 2**70,
        "n": 2,
        "best_of": 2,
        "logit_bias": {"0": 100},
        "user": "u",
        "ignore_eos": False,
        "echo": True,
        "logprobs": 5,
        "suffix": None,
    }
    assert parse_completion_request(body) == CompletionRequest(
        model="smollm2",
        prompt=("a", "b"),
        stream=True,
        stream_options=StreamOptions(include_usage=False),
        max_tokens=5,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        presence_penalty=2.0,
        frequency_penalty=-2.0,
        repetition_penalty=2.0,
        stop="\n",
        seed=2**70,
        n=2,
        logit_bias={0: 100.0},
        user="u",
        ignore_eos=False,
        echo=True,
        logprobs=5,
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", "text"),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], (1, 2, 3)),
        ([[1, 2], [0]], ((1, 2), (0,))),
    ],
)
def test_prompt_shapes(prompt: object, expected: object) -> None:
    assert parse_completion_request({"prompt": prompt}).prompt == expected


def test_float_fields_take_integers_as_floats() -> None:
    request = parse_chat_request(chat(temperature=1, top_p=1, presence_penalty=-2))
    assert (request.temperature, request.top_p, request.presence_penalty) == (1.0, 1.0, -2.0)
    assert all(isinstance(v, float) for v in (request.temperature, request.top_p, request.presence_penalty))


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "none"},
        {"tools": []},
        {"tools": None, "functions": None, "function_call": "none"},
        {"response_format": {"type": "text"}},
        {"top_logprobs": 0},  # asks for nothing, so logprobs need not be on
        {"stop": []},
        {"stream_options": None},
    ],
)
def test_chat_values_that_ask_for_nothing_unsupported_are_accepted(fields: dict) -> None:
    parse_chat_request(chat(**fields))


@pytest.mark.parametrize("fields", [{"best_of": 1}, {"best_of": 3, "n": 3}, {"suffix": ""}, {"logprobs": 0}])
def test_completion_values_we_support_are_accepted(fields: dict) -> None:
    parse_completion_request(completion(**fields))


def test_unknown_fields_are_ignored() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}], "extra": 1},
        ],
        "metadata": {"a": "b"},
        "service_tier": "auto",
    }
    assert parse_chat_request(body) == ChatCompletionRequest(
        messages=(ChatMessage(role="user", content=(ContentPart(type="text", text="hi"),)),)
    )
    assert parse_completion_request({"prompt": "x", "whatever": [1, 2]}) == CompletionRequest(prompt="x")


@pytest.mark.parametrize(
    ("content", "text"),
    [
        ("plain", "plain"),
        (None, ""),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "a\nb"),
        ([], ""),
    ],
)
def test_message_text(content: object, text: str) -> None:
    request = parse_chat_request({"messages": [{"role": "user", "content": content}]})
    assert request.messages[0].text() == text


def test_each_converter_is_new_and_complete() -> None:
    first, second = make_converter(), make_converter()
    assert first is not second
    assert first.structure(chat(n=2), ChatCompletionRequest) == parse_chat_request(chat(n=2))


# --- bad bodies: (body, field, message fragment)

TWO = [USER, {"role": "user", "content": 5}]
SEVENTEEN = [f"s{i}" for i in range(17)]

BAD_CHAT = [
    # the body and its messages
    ([], None, "the request body must be a JSON object"),
    ("hi", None, "the request body must be a JSON object"),
    (None, None, "the request body must be a JSON object"),
    ({}, "messages", "this field is required"),
    ({"messages": None}, "messages", "expected a list, got null"),
    ({"messages": "hi"}, "messages", "expected a list, got the string 'hi'"),
    ({"messages": USER}, "messages", "expected a list, got an object"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": ["hi"]}, "messages[0]", "expected an object, got the string 'hi'"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "this field is required"),
    ({"messages": [{"role": "bot"}]}, "messages[0].role", "must be one of 'system', 'developer', 'user', 'assistant', 'tool'"),
    ({"messages": [{"role": 1}]}, "messages[0].role", "must be one of"),
    ({"messages": TWO}, "messages[1].content", "expected a string or a list of content parts, got 5"),
    ({"messages": [{"role": "user", "content": {"type": "text"}}]}, "messages[0].content", "content parts"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[1].type",
        "only 'text' parts are supported",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text", "expected a string"),
    ({"messages": [{"role": "user", "content": [{"text": "a"}]}]}, "messages[0].content[0].type", "required"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "messages[0].content[0]", "expected an object"),
    ({"messages": [{"role": "user", "name": 5}]}, "messages[0].name", "expected a string, got 5"),
    ({"messages": [{"role": "tool", "tool_call_id": []}]}, "messages[0].tool_call_id", "expected a string, got a list"),
    # scalars
    (chat(model=5), "model", "expected a string"),
    (chat(stream="true"), "stream", "expected true or false, got the string 'true'"),
    (chat(stream=1), "stream", "expected true or false, got 1"),
    (chat(stream=True, stream_options="yes"), "stream_options", "expected an object"),
    (chat(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage", "expected true or false"),
    (chat(stream_options={"include_usage": True}), "stream_options", "only allowed when stream is true"),
    (chat(max_tokens=0), "max_tokens", "must be at least 1, got 0"),
    (chat(max_tokens=2.5), "max_tokens", "expected an integer, got 2.5"),
    (chat(max_tokens="10"), "max_tokens", "expected an integer, got the string '10'"),
    (chat(max_tokens=True), "max_tokens", "expected an integer, got true"),
    (chat(max_completion_tokens=-1), "max_completion_tokens", "must be at least 1"),
    (chat(temperature=3), "temperature", "must be between 0 and 2, got 3"),
    (chat(temperature=-0.1), "temperature", "must be between 0 and 2, got -0.1"),
    (chat(temperature="hot"), "temperature", "expected a number"),
    (chat(temperature=True), "temperature", "expected a number, got true"),
    (chat(temperature=float("nan")), "temperature", "must be between 0 and 2"),
    (chat(top_p=0), "top_p", "must be greater than 0 and at most 1, got 0"),
    (chat(top_p=1.5), "top_p", "must be greater than 0 and at most 1, got 1.5"),
    (chat(top_k=-2), "top_k", "must be -1 or a whole number of at least 0"),
    (chat(top_k=2.5), "top_k", "expected an integer"),
    (chat(min_p=1.5), "min_p", "must be between 0 and 1"),
    (chat(min_p=-0.1), "min_p", "must be between 0 and 1"),
    (chat(presence_penalty=2.5), "presence_penalty", "must be between -2 and 2"),
    (chat(frequency_penalty=-3), "frequency_penalty", "must be between -2 and 2, got -3"),
    (chat(frequency_penalty=[]), "frequency_penalty", "expected a number, got a list"),
    (chat(repetition_penalty=0), "repetition_penalty", "must be greater than 0 and at most 2"),
    (chat(repetition_penalty=2.5), "repetition_penalty", "must be greater than 0 and at most 2"),
    (chat(stop=""), "stop", "must not be empty"),
    (chat(stop=["a", ""]), "stop[1]", "must not be empty"),
    (chat(stop=["a", 1]), "stop[1]", "expected a string, got 1"),
    (chat(stop=SEVENTEEN), "stop", "at most 16 stop strings are allowed, got 17"),
    (chat(stop=5), "stop", "expected a string or a list of strings"),
    (chat(seed=1.5), "seed", "expected an integer"),
    (chat(seed="1"), "seed", "expected an integer"),
    (chat(n=0), "n", "must be between 1 and 16, got 0"),
    (chat(n=17), "n", "must be between 1 and 16, got 17"),
    (chat(n=2.5), "n", "expected an integer"),
    (chat(n=True), "n", "expected an integer"),
    (chat(logit_bias="x"), "logit_bias", "expected an object mapping token ids to biases"),
    (chat(logit_bias=[[1, 2]]), "logit_bias", "expected an object"),
    (chat(logit_bias={"abc": 1}), "logit_bias", "key 'abc' is not a token id"),
    (chat(logit_bias={"-1": 1}), "logit_bias", "key '-1' is not a token id"),
    (chat(logit_bias={"1.5": 1}), "logit_bias", "key '1.5' is not a token id"),
    (chat(logit_bias={"5": 1, "05": 2}), "logit_bias", "token 5 appears more than once"),
    (chat(logit_bias={"5": 101}), "logit_bias", "bias for token 5 must be between -100 and 100, got 101"),
    (chat(logit_bias={"5": -100.5}), "logit_bias", "must be between -100 and 100"),
    (chat(logit_bias={"5": "x"}), "logit_bias", "bias for token 5 must be a number"),
    (chat(logit_bias={"5": True}), "logit_bias", "must be a number, got true"),
    (chat(logprobs=1), "logprobs", "expected true or false"),
    (chat(logprobs="true"), "logprobs", "expected true or false"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "must be between 0 and 20, got 21"),
    (chat(logprobs=True, top_logprobs=-1), "top_logprobs", "must be between 0 and 20"),
    (chat(logprobs=True, top_logprobs=2.5), "top_logprobs", "expected an integer"),
    (chat(top_logprobs=3), "top_logprobs", "needs logprobs to be true"),
    (chat(logprobs=False, top_logprobs=3), "top_logprobs", "needs logprobs to be true"),
    (chat(user=5), "user", "expected a string"),
    (chat(ignore_eos="yes"), "ignore_eos", "expected true or false"),
    # tools and output constraints
    (chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name", "a function name is 1 to 64"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools[0].function.parameters", "expected a JSON object"),
    (chat(tools=[{"type": "other", "function": {"name": "f"}}]), "tools[0].type", "must be one of 'function'"),
    (chat(tools=[{"function": {"name": "f"}}, {"function": {"name": "f"}}]), "tools", "two tools have the same name"),
    (chat(tool_choice="sometimes"), "tool_choice", "must be 'none', 'auto', 'required'"),
    (chat(tool_choice="required"), "tool_choice", "'required' needs tools"),
    (chat(tools=[{"function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice", "no tool named 'g' (tools: f)"),
    (chat(tool_choice={"type": "function"}), "tool_choice.function", "expected an object with the function's name"),
    (chat(tool_choice={"type": "x", "function": {"name": "f"}}), "tool_choice.type", "must be 'function'"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]), "messages[0].tool_calls[0].function.arguments", "required"),
    (chat(functions=[{"name": "f"}]), "functions", "send tools"),
    (chat(function_call="auto"), "function_call", "send tool_choice"),
    (chat(response_format={"type": "xml"}), "response_format.type", "must be one of 'text', 'json_object', 'json_schema'"),
    (chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format.json_schema.schema", "expected a JSON schema"),
    (chat(response_format="text"), "response_format", "expected an object"),
    (chat(guided_choice=[]), "guided_choice", "expected a non-empty list of strings"),
    (chat(guided_choice=["a", 3]), "guided_choice[1]", "expected a non-empty string"),
    (chat(guided_regex="a+", guided_choice=["a"]), "guided_choice", "only one output constraint per request; guided_regex is already set"),
    (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "response_format is already set"),
    (chat(tools=[{"function": {"name": "f"}}], tool_choice="required", guided_regex="a"), "guided_regex", "cannot be combined with a tool_choice that forces a call"),
    (chat(tools=[{"function": {"name": "f"}}], parallel_tool_calls=False, stop=[f"s{i}" for i in range(16)]), "stop", "at most 15 stop strings"),
]


@pytest.mark.parametrize(("body", "field", "fragment"), BAD_CHAT)
def test_bad_chat_request(body: object, field: str | None, fragment: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_chat_request(body)
    assert caught.value.field == field
    message = str(caught.value)
    assert fragment in message
    if field is not None:
        assert message.startswith(f"{field}: ")
    assert "\n" not in message


BAD_COMPLETION = [
    ([1, 2], None, "the request body must be a JSON object"),
    ({}, "prompt", "this field is required"),
    ({"prompt": None}, "prompt", "expected a string, a list of strings or a list of token ids, got null"),
    ({"prompt": 5}, "prompt", "expected a string, a list of strings or a list of token ids"),
    ({"prompt": {"text": "a"}}, "prompt", "got an object"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": ["a", ""]}, "prompt[1]", "must not be empty"),
    ({"prompt": ["a", 1]}, "prompt[1]", "expected a string like the first prompt, got 1"),
    ({"prompt": [1, -1]}, "prompt[1]", "expected a token id (a whole number of at least 0), got -1"),
    ({"prompt": [1, "a"]}, "prompt[1]", "expected a token id"),
    ({"prompt": [1, 2.5]}, "prompt[1]", "expected a token id"),
    ({"prompt": [[1], []]}, "prompt[1]", "must not be empty"),
    ({"prompt": [[1], [2, True]]}, "prompt[1][1]", "expected a token id (a whole number of at least 0), got true"),
    ({"prompt": [[1], "a"]}, "prompt[1]", "expected a list of token ids"),
    ({"prompt": [True]}, "prompt[0]", "expected a string, a token id or a list of token ids, got true"),
    ({"prompt": [None]}, "prompt[0]", "got null"),
    (completion(echo="yes"), "echo", "expected true or false"),
    (completion(logprobs=6), "logprobs", "at most 5 log probabilities per token are supported, got 6"),
    (completion(logprobs=-1), "logprobs", "must be between 0 and 5, got -1"),
    (completion(logprobs=True), "logprobs", "expected an integer, got true"),
    (completion(logprobs=1.5), "logprobs", "expected an integer"),
    (completion(suffix="the end"), "suffix", "not supported"),
    (completion(best_of=2), "best_of", "only best_of equal to n is supported, got 2 with n 1"),
    (completion(best_of=4, n=2), "best_of", "got 4 with n 2"),
    (completion(best_of="2"), "best_of", "expected an integer"),
    (completion(stream_options={"include_usage": True}), "stream_options", "only allowed when stream is true"),
    (completion(stream="yes"), "stream", "expected true or false"),
    (completion(max_tokens=0), "max_tokens", "must be at least 1"),
    (completion(temperature=2.5), "temperature", "must be between 0 and 2, got 2.5"),
    (completion(top_p=0), "top_p", "must be greater than 0"),
    (completion(top_k=-5), "top_k", "must be -1 or"),
    (completion(min_p=2), "min_p", "must be between 0 and 1"),
    (completion(presence_penalty=-2.1), "presence_penalty", "must be between -2 and 2"),
    (completion(frequency_penalty="0"), "frequency_penalty", "expected a number"),
    (completion(repetition_penalty=-1), "repetition_penalty", "must be greater than 0"),
    (completion(stop=[""]), "stop[0]", "must not be empty"),
    (completion(seed=None, n=20), "n", "must be between 1 and 16"),
    (completion(seed=[1]), "seed", "expected an integer"),
    (completion(logit_bias={"x": 0}), "logit_bias", "key 'x' is not a token id"),
    (completion(model=[]), "model", "expected a string"),
    (completion(user=False), "user", "expected a string, got false"),
    (completion(ignore_eos=1), "ignore_eos", "expected true or false"),
]


@pytest.mark.parametrize(("body", "field", "fragment"), BAD_COMPLETION)
def test_bad_completion_request(body: object, field: str | None, fragment: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_completion_request(body)
    assert caught.value.field == field
    assert fragment in str(caught.value)
    if field is not None:
        assert str(caught.value).startswith(f"{field}: ")


def test_the_first_problem_is_reported() -> None:
    # Fields in declaration order: messages before temperature before n.
    body = {"messages": [USER, {"role": "x"}, {"role": "user", "content": 1}], "temperature": 9, "n": 0}
    with pytest.raises(RequestError) as caught:
        parse_chat_request(body)
    assert caught.value.field == "messages[1].role"
    with pytest.raises(RequestError) as caught:
        parse_chat_request(chat(n=0, temperature=9))
    assert caught.value.field == "temperature"


# --- onto SamplingParams


def test_sampling_defaults() -> None:
    for request in (parse_chat_request(chat()), parse_completion_request(completion())):
        assert sampling_params(request, default_max_tokens=77) == SamplingParams(max_tokens=77)


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    def max_tokens(**fields: object) -> int:
        return sampling_params(parse_chat_request(chat(**fields)), default_max_tokens=99).max_tokens

    assert max_tokens(max_tokens=10) == 10
    assert max_tokens(max_completion_tokens=20) == 20
    assert max_tokens(max_tokens=10, max_completion_tokens=20) == 20
    assert max_tokens(max_tokens=30, max_completion_tokens=20) == 20
    assert sampling_params(parse_completion_request(completion(max_tokens=5)), default_max_tokens=99).max_tokens == 5


@pytest.mark.parametrize(
    ("seed", "mapped"),
    [(None, None), (0, 0), (12345, 12345), (-1, 2**63 - 1), (-(2**63), 0), (2**63, 0), (2**64 + 5, 5)],
)
def test_seed_is_folded_into_the_engine_range(seed: int | None, mapped: int | None) -> None:
    request = parse_chat_request(chat(seed=seed))
    assert request.seed == seed  # kept as given
    assert sampling_params(request, default_max_tokens=1).seed == mapped


@pytest.mark.parametrize(("top_k", "mapped"), [(None, 0), (-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_off_values(top_k: int | None, mapped: int) -> None:
    assert sampling_params(parse_chat_request(chat(top_k=top_k)), default_max_tokens=1).top_k == mapped


@pytest.mark.parametrize(("logprobs", "flag", "top"), [(None, False, 0), (0, True, 0), (1, True, 1), (5, True, 5)])
def test_completion_logprobs(logprobs: int | None, flag: bool, top: int) -> None:
    params = sampling_params(parse_completion_request(completion(logprobs=logprobs)), default_max_tokens=1)
    assert (params.logprobs, params.top_logprobs) == (flag, top)


def test_chat_logprobs() -> None:
    params = sampling_params(parse_chat_request(chat(logprobs=True, top_logprobs=3)), default_max_tokens=1)
    assert (params.logprobs, params.top_logprobs) == (True, 3)
    params = sampling_params(parse_chat_request(chat(logprobs=True)), default_max_tokens=1)
    assert (params.logprobs, params.top_logprobs) == (True, 0)


def test_full_mapping_passes_validation() -> None:
    request = parse_chat_request(
        chat(
            max_tokens=8,
            temperature=0,
            top_p=0.5,
            top_k=-1,
            min_p=0.1,
            presence_penalty=1,
            frequency_penalty=-1,
            repetition_penalty=1.2,
            stop="END",
            seed=-5,
            logit_bias={"3": 5, "1": -1},
            ignore_eos=True,
        )
    )
    params = sampling_params(request, default_max_tokens=16)
    assert params == SamplingParams(
        max_tokens=8,
        temperature=0.0,
        top_k=0,
        top_p=0.5,
        min_p=0.1,
        presence_penalty=1.0,
        frequency_penalty=-1.0,
        repetition_penalty=1.2,
        logit_bias=((3, 5.0), (1, -1.0)),
        seed=2**63 - 5,
        stop=("END",),
        ignore_eos=True,
    )
    params.validate(vocab_size=10)
    stops = sampling_params(parse_completion_request(completion(stop=["a", "b"])), default_max_tokens=1).stop
    assert stops == ("a", "b")


# --- size limits: work that grows with a field's size is bounded before it starts


def _size_limits():
    from trioserve.http import constraints, schemas
    from trioserve import types as sampling

    return schemas, sampling, constraints


def _bounded_cases() -> list[tuple[dict, str, str]]:
    schemas, sampling, constraints = _size_limits()
    chars, total = sampling.MAX_STOP_CHARS, sampling.MAX_STOP_BYTES
    limit = constraints.MAX_CONSTRAINT_CHARS
    big_schema = {"type": "object", "description": "d" * limit}
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
    return [
        (chat(stop="x" * (chars + 1)), "stop", f"a stop string may be at most {chars} characters, got {chars + 1}"),
        (chat(stop=["a", "x" * (chars + 1)]), "stop[1]", f"at most {chars} characters, got {chars + 1}"),
        (chat(stop=["é" * chars] * 5), "stop", f"the stop strings may total at most {total} bytes (UTF-8), got {5 * 2 * chars}"),
        (completion(stop=["x" * 3_000_000]), "stop[0]", "got 3000000"),
        (chat(logit_bias={str(i): 1 for i in range(schemas.MAX_LOGIT_BIAS_TOKENS + 1)}), "logit_bias", f"at most {schemas.MAX_LOGIT_BIAS_TOKENS} tokens may be biased, got {schemas.MAX_LOGIT_BIAS_TOKENS + 1}"),
        (chat(tools=tools), "tools", f"at most {MAX_TOOLS} tools are allowed, got {MAX_TOOLS + 1}"),
        (chat(guided_regex="a" * (limit + 1)), "guided_regex", f"at most {limit} characters, got {limit + 1}"),
        (completion(guided_grammar="a" * (limit + 1)), "guided_grammar", f"at most {limit} characters"),
        (chat(guided_choice=["x" * (limit // 2 + 1)] * 2), "guided_choice", f"the choices may total at most {limit} characters"),
        (chat(guided_json=big_schema), "guided_json", f"at most {limit} characters of JSON"),
        (chat(response_format={"type": "json_schema", "json_schema": {"schema": big_schema}}), "response_format.json_schema.schema", f"at most {limit} characters of JSON"),
        (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": big_schema}}]), "tools[0].function.parameters", f"at most {limit} characters of JSON"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_sizes_are_bounded(index: int) -> None:
    body, field, fragment = _bounded_cases()[index]
    parse = parse_completion_request if "prompt" in body else parse_chat_request
    with pytest.raises(RequestError) as caught:
        parse(body)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ") and fragment in str(caught.value), str(caught.value)


def test_sizes_at_the_limits_are_accepted() -> None:
    schemas, sampling, constraints = _size_limits()
    chars, total, limit = sampling.MAX_STOP_CHARS, sampling.MAX_STOP_BYTES, constraints.MAX_CONSTRAINT_CHARS
    stops = ["x" * chars] * (total // chars)
    assert parse_chat_request(chat(stop=stops)).stop == tuple(stops)
    parse_chat_request(chat(stop="é" * chars))
    parse_chat_request(chat(logit_bias={str(i): 1 for i in range(schemas.MAX_LOGIT_BIAS_TOKENS)}))
    parse_chat_request(chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS)]))
    parse_chat_request(chat(guided_regex="a" * limit))
    parse_chat_request(chat(guided_choice=["x" * (limit // 2)] * 2))
    schema = {"type": "object", "description": "d" * (limit - 50)}
    parse_chat_request(chat(guided_json=schema))
    parse_chat_request(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}]))


# --- lone surrogates anywhere in a parsed body


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [
        ("\ud800", None, "the request body: the text contains a lone UTF-16 surrogate (\\ud800)"),
        ({"messages": [USER, {"role": "user", "content": "a\udfffb"}]}, "messages[1].content", "(\\udfff), which is not valid Unicode"),
        ({"a": {"b": [1, ["x", "\udc00"]]}}, "a.b[1][1]", "a.b[1][1]: the text contains a lone UTF-16 surrogate (\\udc00)"),
        ({"logit_bias": {"\ud801": 1}}, "logit_bias", "a key contains a lone UTF-16 surrogate (\\ud801)"),
        ({"\ud800x": 1}, None, "the request body: a key contains"),
        # The first one in document order is named.
        ({"z": "\ud800", "a": "\ud801"}, "z", "(\\ud800)"),
    ],
)
@pytest.mark.parametrize("encoding", [None, "utf-8", "utf-16", "utf-32-le"], ids=["parsed", "raw-utf8", "raw-utf16", "raw-utf32"])
def test_lone_surrogates_are_refused_with_their_path(body: object, field: str | None, fragment: str, encoding: str | None) -> None:
    """Checked on the parsed body alone, or with the text it came from
    (whose scan lets a plainly fine body skip the walk): the same error."""
    import json

    from trioserve.http.structuring import check_json_body

    raw = None if encoding is None else json.dumps(body).encode(encoding.replace("-le", ""))
    with pytest.raises(RequestError) as caught:
        check_json_body(body, raw)
    assert caught.value.field == field
    assert fragment in str(caught.value), str(caught.value)
    str(caught.value).encode()  # the message itself is valid Unicode


@pytest.mark.parametrize(
    ("text", "fine"),
    [
        ('{"a": [[], {"b": "c"}], "d": "\\u00e9"}', True),
        ("[" * 100 + "]" * 100, True),  # as deep as allowed
        ("[" * 101 + "]" * 101, False),
        ('["' + "[" * 300 + '"]', True),  # brackets inside a string do not nest
        ('["a\\"' + "[" * 300 + '"]', True),  # an escaped quote does not end the string
        ('{"k": "a\\"b", "v": ' + "[" * 101 + "]" * 101 + "}", False),
        ('"\\ud800"', False),
        ('"\\uDC00"', False),
        ('"\\\\ud800"', False),  # an escaped backslash then text: looked at by the walk, which passes it
        ("[" + "[]," * 100_000 + "[]]", True),  # many, shallow
        ('"\ud800"', False),  # the bytes UTF-8 would give it, which json.loads lets through
        ('"\ud7ff \ue000 \U0001f916"', True),  # the neighbours, and a pair's character, are fine
    ],
)
def test_the_scan_of_the_raw_text(text: str, fine: bool) -> None:
    from trioserve.http.structuring import _plainly_fine

    assert _plainly_fine(text.encode("utf-8", "surrogatepass")) is fine


def test_valid_unicode_passes_the_surrogate_check() -> None:
    from trioserve.http.structuring import check_json_body

    check_json_body({"messages": [{"role": "user", "content": "emoji 🤖 and CJK 日本 and é"}], "n": 1, "x": None, "y": [True, 2.5]})
    from trioserve.http.structuring import MAX_JSON_DEPTH

    deep: object = "ok"
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    check_json_body(deep)


@pytest.mark.parametrize("with_raw", [False, True])
def test_nesting_is_bounded(with_raw: bool) -> None:
    from trioserve.http.structuring import MAX_JSON_DEPTH, check_json_body

    deep: object = {"a": "ok"}
    for _ in range(5000):  # far deeper than recursion could walk
        deep = [deep]
    raw = ('{"tools": ' + "[" * 5000 + '{"a": "ok"}' + "]" * 5000 + "}").encode() if with_raw else None
    with pytest.raises(RequestError) as caught:
        check_json_body({"tools": deep}, raw)
    assert caught.value.field == "tools" + "[0]" * (MAX_JSON_DEPTH - 1)
    assert f"objects and lists may nest at most {MAX_JSON_DEPTH} deep" in str(caught.value)
