"""Guided decoding on its own, with the tiny tokenizer: random walks through
each kind of constraint (any allowed token, chosen at random) always end in
output the constraint accepts; masks allow only what the matcher accepts;
bad schemas, patterns and grammars are one-line RequestErrors naming the
field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from trioserve.errors import RequestError
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.guided import GuideCompiler, GuideFailed, GuideSpec, apply_masks

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "details": {
            "type": "object",
            "properties": {"wind": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
            "required": ["wind"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit", "details"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tiny_checkpoints) -> GuideCompiler:
    return GuideCompiler(load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32).tokenizer)


def walk(compiler: GuideCompiler, spec: GuideSpec, rng: random.Random, limit: int = 400, prefer: str = "") -> str:
    """Pick allowed tokens at random until the constraint is complete; the
    tokens of ``prefer``'s characters, when allowed, are taken most of the
    time (an open-ended constraint then ends in a reasonable length)."""
    (guide,) = compiler.guides(spec, 1)
    tok = compiler.tokenizer
    favourite = {t for ch in prefer for t in tok.encode(ch, add_bos=False)}
    out: list[int] = []
    for _ in range(limit):
        mask = compiler.fill_masks([guide])
        allowed = torch.isfinite(apply_masks(torch.zeros(1, compiler.vocab_size), mask))[0].nonzero().flatten().tolist()
        assert allowed, "the constraint allows nothing"
        ordinary = [t for t in allowed if t not in tok.stop_ids]
        preferred = [t for t in ordinary if t in favourite]
        if preferred and rng.random() < 0.8:
            ordinary = preferred
        token = rng.choice(ordinary) if ordinary and (rng.random() < 0.9 or not set(allowed) & tok.stop_ids) else min(set(allowed) & tok.stop_ids)
        guide.advance(token)
        if token in tok.stop_ids:
            return tok.decode(out)
        out.append(token)
        if guide.done:  # only a stop token could follow
            return tok.decode(out)
    raise AssertionError(f"no end after {limit} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("seed", range(20))
def test_random_walks_through_a_schema_always_validate(compiler, seed):
    text = walk(compiler, GuideSpec("json_schema", SCHEMA), random.Random(seed))
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(5))
def test_random_walks_through_regex_choice_json_object_and_grammar(compiler, seed):
    rng = random.Random(seed)
    assert re.fullmatch(r"\d{3}-[a-z]{1,5}", walk(compiler, GuideSpec("regex", r"\d{3}-[a-z]{1,5}"), rng))
    assert walk(compiler, GuideSpec("choice", ("yes", "no", "maybe so")), rng) in ("yes", "no", "maybe so")
    assert isinstance(json.loads(walk(compiler, GuideSpec("json_object"), rng, prefer='"}:1')), dict)
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", walk(compiler, GuideSpec("grammar", grammar), rng))


def test_masks_leave_unguided_rows_alone_and_never_touch_the_input(compiler):
    (guide,) = compiler.guides(GuideSpec("choice", ("ab",)), 1)
    mask = compiler.fill_masks([None, guide])
    logits = torch.randn(2, compiler.vocab_size)
    masked = apply_masks(logits, mask)
    assert torch.equal(masked[0], logits[0])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    tok = compiler.tokenizer
    assert allowed and all("ab".startswith(tok.decode([t])) for t in allowed)
    assert torch.isfinite(logits).all()
    assert compiler.fill_masks([None, None]) is None


def test_a_token_the_mask_forbids_is_refused(compiler):
    (guide,) = compiler.guides(GuideSpec("choice", ("yes",)), 1)
    no = compiler.tokenizer.encode("no", add_bos=False)[0]
    with pytest.raises(GuideFailed) as caught:
        guide.advance(no)
    assert caught.value.field == "response_format"
    assert str(caught.value).startswith("response_format: the output constraint failed while generating: ")
    assert "\n" not in str(caught.value) and "<state>" not in str(caught.value)  # llguidance's first line, never its state dump


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (GuideSpec("json_schema", {"type": "foo"}, "response_format.json_schema.schema"), "response_format.json_schema.schema: invalid JSON schema:"),
        (GuideSpec("json_schema", {"type": "array", "uniqueItems": True}, "guided_json"), "guided_json: invalid JSON schema: Unimplemented keys"),
        (GuideSpec("regex", "(abc", "guided_regex"), "guided_regex: invalid regular expression:"),
        (GuideSpec("grammar", "start: foo", "guided_grammar"), "guided_grammar: invalid grammar:"),
    ],
)
def test_bad_constraints_are_one_line_request_errors(compiler, spec, fragment):
    with pytest.raises(RequestError) as caught:
        compiler.guides(spec, 1)
    message = str(caught.value)
    assert message.startswith(fragment), message
    assert "\n" not in message and caught.value.field == spec.field
