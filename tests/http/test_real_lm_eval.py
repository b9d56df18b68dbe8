"""lm-evaluation-harness 0.4.13 against the real server and the real
default model (issue #48): `--model local-completions` with
`tokenized_requests=False` and no `tokenizer=` finds the server's tokenizer
routes by itself (no Hugging Face hub), and every per-choice loglikelihood
it reports is the one the server's own prompt scoring gives (`echo`,
`logprobs`, `max_tokens` 0), bit for bit, including a choice whose
greedy next token is the end-of-turn token (the case where the generated
token's entry used to be missing and lm-eval scored the choice 0.0).

The task is a local multiple-choice file the test writes; lm-eval runs as
the command users run, offline. Slow: loads SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import start_server
from trioserve.config import EngineConfig, ServerSettings

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("Which gas do plants take in from the air to make food?", ["oxygen", "carbon dioxide", "nitrogen", "helium"], 1),
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which planet is closest to the Sun?", ["Venus", "Mars", "Mercury", "Earth"], 2),
    ("What do bees make?", ["milk", "honey", "silk", "wax paper"], 1),
]
TASK = """task: trioserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path) -> None:
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "trioserve_mc.yaml").write_text(TASK.format(data=data))


async def own_score(client: httpx.AsyncClient, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation's loglikelihood by the server's own prompt scoring,
    with the context counted by /tokenize; and whether generating after
    the whole text ends it at once (its greedy next token is the stop token)."""
    counted = await client.post("/tokenize", json={"prompt": context, "add_special_tokens": False})
    assert counted.status_code == 200, counted.text
    scored = await client.post("/v1/completions", json={"prompt": context + continuation, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert scored.status_code == 200, scored.text
    following = await client.post("/v1/completions", json={"prompt": context + continuation, "max_tokens": 1, "temperature": 0})
    assert following.status_code == 200, following.text
    ends = following.json()["choices"][0]["finish_reason"] == "stop" and following.json()["usage"]["completion_tokens"] == 1
    return sum(scored.json()["choices"][0]["logprobs"]["token_logprobs"][counted.json()["count"] :]), ends


async def test_lm_eval_scores_every_choice_as_the_server_does_with_no_tokenizer_argument(nursery, tmp_path):
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-evaluation-harness is not installed (it is a dev dependency: pip install -e '.[dev]')")
    engine = EngineConfig(model="smollm2")
    url = await start_server(nursery, attrs.evolve(ServerSettings(engine=engine), host="127.0.0.1", port=0, log_level="warning"))
    write_task(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions",
        "--model_args", f"model=smollm2,base_url={url}/v1/completions,tokenized_requests=False",
        "--tasks", "trioserve_mc", "--include_path", str(tmp_path), "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    with trio.fail_after(600):  # a hang guard only
        ran = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False, env=env, cwd=tmp_path)
    log = (ran.stdout + ran.stderr).decode(errors="replace")
    assert ran.returncode == 0, log[-4000:]
    assert "Using remote tokenizer" in log, log[-4000:]
    (samples,) = out.rglob("samples_trioserve_mc_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == len(QUESTIONS)
    ending = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for row in rows:
            args = [row["arguments"][f"gen_args_{i}"] for i in range(len(row["resps"]))]
            for arg, resp in zip(args, row["resps"], strict=True):
                theirs = float(resp[0][0])
                ours, ends = await own_score(client, arg["arg_0"], arg["arg_1"])
                ending += ends
                assert theirs == ours, (arg, theirs, ours)
                assert theirs < 0.0  # a real score: never the 0.0 a missing entry made
    assert ending >= 1, "no choice here is followed by the end-of-turn token: the case this test exists for is not covered"
