"""The request spec (trioserve/http/job.py): a frozen record, and the one
place that turns choice numbers into engine requests and seeds."""

from __future__ import annotations

import attrs
import pytest

from trioserve.http.edge import resolve_seed
from trioserve.http.job import GenerationJob, Prompt
from trioserve.models.output_parser import OutputParser
from trioserve.types import SEED_LIMIT, SamplingParams


def job(**fields) -> GenerationJob:
    given = {
        "id": "chatcmpl-abc123def456xyz",
        "shape": "chat",
        "model": "m",
        "created": 1,
        "prompts": [Prompt("", [1, 2, 3], SamplingParams(max_tokens=4, seed=10))],
        **fields,
    }
    return GenerationJob(**given)


def test_a_job_is_frozen_once_built() -> None:
    spec = job()
    for field, value in (("n", 2), ("retain", "s"), ("guides", None), ("stream", True)):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(spec, field, value)


def test_choices_are_numbered_as_openai_does_and_seeded_from_their_prompt() -> None:
    """Choice i is choice i % n of prompt i // n; its seed is its prompt's
    plus i % n, folded; only choice 0 carries the request id, the draw
    start and the retaining owner."""
    first = Prompt("a", [1], SamplingParams(max_tokens=2, seed=SEED_LIMIT - 1))
    second = Prompt("b", [2, 3], SamplingParams(max_tokens=3, seed=5))
    spec = job(shape="text", prompts=[first, second], n=3, draw_start=7, retain="sess")
    assert spec.choices == 6
    assert spec.prompt_tokens == 3
    requests = [spec.request(i) for i in range(6)]
    assert [r.prompt_ids for r in requests] == [(1,)] * 3 + [(2, 3)] * 3
    assert [r.params.seed for r in requests] == [SEED_LIMIT - 1, 0, 1, 5, 6, 7]
    assert [r.params.max_tokens for r in requests] == [2, 2, 2, 3, 3, 3]
    assert requests[0].request_id == spec.request_id == f"{spec.id}-0"
    assert (requests[0].draw_start, requests[0].retain) == (7, "sess")
    assert all(r.request_id is None and r.draw_start == 0 and r.retain is None for r in requests[1:])


def test_an_unsent_seed_stays_unset_for_every_choice() -> None:
    """The engine's edge draws a fresh seed for each (and reports it)."""
    spec = job(prompts=[Prompt("", [1], SamplingParams(max_tokens=1))], n=4)
    assert [spec.request(i).params.seed for i in range(4)] == [None] * 4


@pytest.mark.parametrize(("sent", "choice", "engine"), [(None, 3, None), (0, 0, 0), (-1, 0, SEED_LIMIT - 1), (-1, 2, 1), (SEED_LIMIT, 1, 1), (2**64 + 5, 0, 5)])
def test_a_sent_seed_is_resolved_in_one_place(sent, choice, engine) -> None:
    assert resolve_seed(sent, choice) == engine


def test_guides_must_match_the_choices() -> None:
    with pytest.raises(ValueError, match="1 guides for 2 choices"):
        job(n=2, guides=[None])
    with pytest.raises(ValueError, match="at least one prompt"):
        job(prompts=[])


def test_only_chat_shapes_parse_their_output() -> None:
    """A parser splits tool calls or reasoning out of a chat, response or
    turn reply; a text completion's, or a reply with nothing to split, has none."""
    assert job(calls=False, reasoning=False).parser(0) is None
    assert job(shape="text", calls=True, reasoning=True).parser(0) is None
    for shape in ("chat", "response", "turn"):
        parser = job(shape=shape, calls=True).parser(2)
        assert isinstance(parser, OutputParser)
        assert (parser.tools, parser.reasoning) == (True, False)
        assert parser.call_id_prefix == "call_abc123def4562"  # 12 characters of the id's random part, then the choice
    assert job(reasoning=True).parser(0).reasoning is True
