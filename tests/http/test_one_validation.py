"""One validation: each numeric sampling field's range is written once, in
`trioserve.types.RANGES`, and both the HTTP schemas (chat and completions)
and the engine's `SamplingParams.validate` apply it; an unset field takes
SamplingParams' own default. Every test here is parametrized over RANGES,
so a range added there is covered without touching this file."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import trio

from tests.http.conftest import MODEL_NAME
from trioserve.errors import RequestError
from trioserve.http.errors import to_response
from trioserve.http.edge import sampling_params
from trioserve.http.schemas import parse_chat_request, parse_completion_request
from trioserve.types import RANGES, Range, SamplingError, SamplingParams

USER = [{"role": "user", "content": "hi"}]
TOKEN = 5  # the token a logit_bias value is given for (in every vocabulary here)
VOCAB = 1000


def outside(allowed: Range) -> list[float]:
    """Values just outside ``allowed`` on each side, and NaN."""
    below = allowed.lo if allowed.lo_open else math.nextafter(allowed.lo, -math.inf)
    return [below, math.nextafter(allowed.hi, math.inf), math.nan]


def at_bounds(allowed: Range) -> list[float]:
    """Each bound, or the nearest allowed value to an open one."""
    lowest = math.nextafter(allowed.lo, math.inf) if allowed.lo_open else allowed.lo
    return [lowest, allowed.hi]


def cases(pick) -> list:
    return [pytest.param(name, value, id=f"{name}={value!r}") for name, allowed in RANGES.items() for value in pick(allowed)]


def field_of(name: str, value: float) -> dict:
    """The body field that sets ``name`` to ``value``."""
    if name == "logit_bias":
        return {"logit_bias": {str(TOKEN): value}}
    return {name: value}


def engine_params(name: str, value: float) -> SamplingParams:
    if name == "logit_bias":
        return SamplingParams(logit_bias=((TOKEN, value),))
    return SamplingParams(**{name: value})


def sent(name: str, params: SamplingParams) -> float:
    value = getattr(params, name)
    return dict(value)[TOKEN] if name == "logit_bias" else value


def as_json(body: dict) -> dict:
    """``body`` as a client's JSON carries it (NaN as Python's json writes it)."""
    return json.loads(json.dumps(body))


PARSERS = [
    pytest.param(lambda fields: parse_chat_request(as_json({"messages": USER, **fields})), id="chat"),
    pytest.param(lambda fields: parse_completion_request(as_json({"prompt": "hi", **fields})), id="completions"),
]


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize(("name", "value"), cases(outside))
def test_just_outside_is_refused_by_the_schema_and_the_engine(parse, name, value):
    with pytest.raises(RequestError) as info:
        parse(field_of(name, value))
    status, body, _ = to_response(info.value)
    assert status == 400
    assert body["error"]["param"] == name
    assert body["error"]["message"].startswith(f"{name}: ")
    assert f"must be {RANGES[name].describe()}" in body["error"]["message"]

    with pytest.raises(SamplingError) as refused:
        engine_params(name, value).validate(VOCAB)
    assert refused.value.field == name


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize(("name", "value"), cases(at_bounds))
def test_each_bound_is_accepted_by_the_schema_and_the_engine(parse, name, value):
    params = sampling_params(parse(field_of(name, value)), default_max_tokens=16)
    assert sent(name, params) == value
    params.validate(VOCAB)
    engine_params(name, value).validate(VOCAB)


@pytest.mark.parametrize("parse", PARSERS)
def test_unset_fields_take_sampling_params_defaults(parse):
    defaults = SamplingParams()
    assert sampling_params(parse({}), default_max_tokens=defaults.max_tokens) == defaults


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize("seed", [-1, 2**63, 2**64 + 3, 7])
def test_any_seed_is_folded_as_the_engine_defines(parse, seed):
    params = sampling_params(parse({"seed": seed}), default_max_tokens=16)
    assert params.seed == seed % 2**63
    params.validate(VOCAB)


async def test_the_server_answers_400_outside_and_200_at_the_bounds(server):
    """The same values through a real server's chat route: each value just
    outside a range is a 400 naming the field; each bound runs."""
    async with httpx.AsyncClient(base_url=server, timeout=10) as client:
        with trio.fail_after(60):
            for name, allowed in RANGES.items():
                for value in outside(allowed):
                    if math.isnan(value):
                        continue  # not JSON (the schema test above covers NaN)
                    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 1, **field_of(name, value)}
                    response = await client.post("/v1/chat/completions", json=body)
                    assert response.status_code == 400, (name, value, response.text)
                    error = response.json()["error"]
                    assert error["param"] == name and error["message"].startswith(f"{name}: "), error
                for value in at_bounds(allowed):
                    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 1, **field_of(name, value)}
                    response = await client.post("/v1/chat/completions", json=body)
                    assert response.status_code == 200, (name, value, response.text)
