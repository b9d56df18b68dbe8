"""`trioserve generate` as a user meets it: usage errors and broken
checkpoints are one line on stderr with exit status 2, and a working
checkpoint prints exactly the reply the server gives the same request
(greedy, or sampled with the same seed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import httpx
import pytest

from trioserve.kernels import native_build
import torch
import trio

from tests.http.conftest import MODEL_NAME, make_settings, start_server, usage_tokens
from tests.tiny_model import set_gguf_u32
from trioserve import cli
from trioserve.config import EngineConfig
from trioserve.http.edge import sampling_params
from trioserve.http.schemas import parse_chat_request
from trioserve.models.checkpoint import load_checkpoint
from trioserve.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
# The ChatML prompt the CLI must build for "hi": the tiny GGUF carries no
# chat template, so the default (ChatML, no system prompt) applies.
HI_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m trioserve.cli ARGS` with ``env`` added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "trioserve.cli", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        cwd=ROOT,
        env={**os.environ, "PYTHONIOENCODING": "utf-8", **(env or {})},
        timeout=120,
    )


def assert_one_error_line(stderr: str, *fragments: str) -> None:
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("trioserve: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, stderr)


# -- broken checkpoints: one line naming the file, exit 2, no traceback ---------


def missing(tmp: Path, ck: dict[str, Path]) -> tuple[Path, Path, str]:
    return tmp / "absent.gguf", tmp / "absent.gguf", "no such file or directory"


def not_gguf(tmp, ck):
    (tmp / "notes.gguf").write_text("just some text, not a model\n")
    return tmp / "notes.gguf", tmp / "notes.gguf", "not a GGUF file"


def truncated_gguf(tmp, ck):
    (tmp / "cut.gguf").write_bytes(ck["gguf_f32"].read_bytes()[:-1000])
    return tmp / "cut.gguf", tmp / "cut.gguf", "truncated or corrupt GGUF file"


def hf_gpt2(tmp, ck):
    d = shutil.copytree(ck["hf"], tmp / "hf")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    return d, d / "config.json", "unsupported model_type 'gpt2'"


BAD = [missing, not_gguf, truncated_gguf, hf_gpt2]


@pytest.mark.parametrize("build", BAD, ids=[b.__name__ for b in BAD])
def test_bad_checkpoint_is_one_line_and_exit_2(build, tmp_path, tiny_checkpoints):
    model, named, problem = build(tmp_path, tiny_checkpoints)
    proc = run_cli("generate", "--model", str(model), "--prompt", "hi")
    assert proc.returncode == 2, proc.stderr
    assert_one_error_line(proc.stderr, f"trioserve: error: {named}: ", problem)
    assert proc.stdout == ""


@pytest.mark.parametrize(("key", "value"), [("llama.attention.head_count_kv", 3), ("llama.attention.head_count", 8)])
def test_inconsistent_gguf_metadata_is_one_line_naming_the_file(key, value, tmp_path, tiny_checkpoints, capsys):
    # Inconsistent head counts: head_count_kv=3 (with 4 heads) does not divide;
    # head_count=8 contradicts attn_q's rows. Both are one error line naming the file.
    path = set_gguf_u32(shutil.copy(tiny_checkpoints["gguf_f32"], tmp_path / "inconsistent.gguf"), key, value)
    status = cli.main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert status == 2
    # Load-progress lines may come first; the rest is the one error line.
    rest = "\n".join(line for line in err.splitlines() if not line.startswith("Loading weights"))
    assert_one_error_line(rest, f"trioserve: error: {path}: ")


# -- usage errors: argparse's message names the option, before anything loads --


def test_unknown_option_is_a_usage_error():
    proc = run_cli("generate", "--prompt", "hi", "--bogus")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    # argparse reports leftovers from the top-level parser, hence its usage line.
    assert proc.stderr.startswith("usage: trioserve ")
    assert proc.stderr.splitlines()[-1] == "trioserve: error: unrecognized arguments: --bogus"
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "0"], "argument --max-tokens: must be a positive integer, got 0"),
        (["--temperature", "5"], "argument --temperature: must be between 0 and 2, got 5.0"),
        (["--temperature", "-0.1"], "argument --temperature: must be between 0 and 2, got -0.1"),
        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["--threads", "0"], "argument --threads: must be a positive integer, got 0"),
    ],
)
def test_bad_values_are_usage_errors(args, message, tmp_path, capsys):
    # The model path does not exist: had parsing let the value through, the
    # error would be about the file instead.
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--model", str(tmp_path / "absent.gguf"), "--prompt", "hi", *args])
    assert info.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("usage: trioserve generate")
    last = out.err.splitlines()[-1]
    assert last.startswith("trioserve generate: error: " + message), last
    assert "absent.gguf" not in out.err


def test_prompt_is_required(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate"])
    assert info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "trioserve generate: error: the following arguments are required: --prompt"


# -- a working checkpoint ----------------------------------------------------------


async def generate_and_serve(nursery, path: Path, *flags: str) -> tuple[str, list[str], dict, dict]:
    """`trioserve generate --prompt hi FLAGS` on ``path``, and the same
    request to a server running the engine config the command uses: the
    command's stdout (without its final newline) and stderr lines, the
    server's chat completion for the same messages and its completion for
    the same prompt tokens (ChatML: the tiny GGUF has no template)."""
    argv = ["generate", "--model", str(path), "--prompt", "hi", "--dtype", "float32", *flags]
    with trio.fail_after(120):
        proc = await trio.run_process(
            [sys.executable, "-m", "trioserve.cli", *argv], capture_stdout=True, capture_stderr=True, check=False, cwd=ROOT
        )
    stderr = proc.stderr.decode("utf-8")
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    stdout = proc.stdout.decode("utf-8")  # bytes: no newline translation
    assert stdout.endswith("\n")

    args = cli.build_parser().parse_args(argv)
    body = cli.generate_request_body(args)
    settings = attrs.evolve(make_settings(path), engine=cli.generate_engine_config(str(path), "float32"))
    url = await start_server(nursery, settings)
    tok = load_checkpoint(path, dtype=torch.float32).tokenizer
    assert tok.chat_template is None
    system = [f"<|im_start|>system\n{m['content']}<|im_end|>\n" for m in body["messages"] if m["role"] == "system"]
    prompt_ids = tok.encode("".join(system) + HI_PROMPT)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        chat = await client.post("/v1/chat/completions", json={**body, "model": MODEL_NAME})
        assert chat.status_code == 200, chat.text
        rest = {k: v for k, v in body.items() if k != "messages"}
        text = await client.post("/v1/completions", json={**rest, "model": MODEL_NAME, "prompt": prompt_ids})
        assert text.status_code == 200, text.text
    return stdout[:-1], stderr.splitlines(), chat.json(), text.json()


def assert_same_reply(stdout: str, stderr: list[str], chat: dict, text: dict) -> None:
    choice = chat["choices"][0]
    assert stdout, "a non-empty reply to compare"
    assert stdout == choice["message"]["content"] == text["choices"][0]["text"]
    assert choice["finish_reason"] == text["choices"][0]["finish_reason"]
    usage = chat["usage"]
    assert usage_tokens(usage) == usage_tokens(text["usage"])  # the second one meets the first's cached prefix
    assert stderr[-1] == f"[{usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} generated, finish: {choice['finish_reason']}]"


async def test_generate_prints_the_servers_greedy_reply(nursery, tiny_checkpoints):
    path = tiny_checkpoints["gguf_f32"]
    stdout, lines, chat, text = await generate_and_serve(nursery, path, "--max-tokens", "5")
    assert_same_reply(stdout, lines, chat, text)
    assert chat["usage"]["completion_tokens"] == 5  # ran to length: the tiny model's reply, not an early stop
    # Not a TTY: a progress line per tenth of the 21 tensors, ending at 21/21.
    progress = [line for line in lines if re.fullmatch(r"Loading weights: \d+/21 tensors", line)]
    assert progress[-1] == "Loading weights: 21/21 tensors"
    assert len(progress) == 11
    assert re.fullmatch(rf"Loading weights: done in \d+\.\d s \({re.escape(str(path))}, torch\.float32\)", lines[-2])
    # Where the C kernels cannot be built (no compiler), one warning line says so.
    fallback = [line for line in lines if "using the torch reference" in line]
    assert len(fallback) == (0 if native_build.library() is not None else 1), fallback
    assert len(lines) == len(progress) + 2 + len(fallback)


@pytest.mark.parametrize(
    "flags",
    [
        ("--seed", "1234"),
        ("--seed", "-5", "--system", "Be brief."),  # any integer, folded into [0, 2**63) as the server folds it
    ],
    ids=["seed", "negative-seed-and-system"],
)
async def test_generate_with_a_seed_prints_the_servers_sampled_reply(nursery, tiny_checkpoints, flags):
    path = tiny_checkpoints["gguf_f32"]
    stdout, lines, chat, text = await generate_and_serve(nursery, path, "--max-tokens", "20", "--temperature", "1", *flags)
    assert_same_reply(stdout, lines, chat, text)


def test_generate_sends_the_servers_sampling_params():
    """The command's flags become the SamplingParams the server builds for
    the same chat body: temperature, max_tokens and the seed as sent (an
    integer outside [0, 2**63) folded the server's way)."""
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--temperature", "0.7", "--seed", "-1", "--max-tokens", "9"])
    params = sampling_params(parse_chat_request(cli.generate_request_body(args)), default_max_tokens=2048)
    assert params == SamplingParams(max_tokens=9, temperature=0.7, seed=2**63 - 1)
    assert cli.generate_engine_config("m", "float32") == EngineConfig(model="m", dtype="float32")
    serve = cli.build_parser().parse_args(["serve", "--model", "m", "--dtype", "float32"])
    config = EngineConfig(model="m", dtype="float32")
    assert (serve.device, serve.max_num_seqs, serve.max_model_len, serve.kv_cache_bytes, serve.max_queue, serve.prefill_budget, serve.max_step_ms) == (
        config.device, config.max_num_seqs, config.max_model_len, config.kv_cache_bytes, config.max_queue, config.prefill_budget, config.max_step_ms,
    ), "serve's defaults are EngineConfig's, so generate runs the engine serve would"
    assert (not serve.no_prefix_cache, serve.prefix_cache_max_blocks, serve.prefix_cache_bytes, serve.prefix_cache_idle) == (
        config.prefix_cache, config.prefix_cache_max_blocks, config.prefix_cache_max_bytes, config.prefix_cache_idle_s,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefix-cache-bytes", "lots"], "argument --prefix-cache-bytes: must be a size like 512MiB or 2GiB, got 'lots'"),
        (["--max-sessions", "0"], "argument --max-sessions: must be a positive integer, got 0"),
        (["--session-idle", "-5"], "argument --session-idle: must be between 0.001 and 1e+09, got -5.0"),
        (["--max-step-ms", "-1"], "argument --max-step-ms: must be between 0 and 3.6e+06, got -1.0"),
        (["--max-step-ms", "soon"], "argument --max-step-ms: must be a number of milliseconds, got 'soon'"),
    ],
)
def test_bad_serve_limits_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", *args])
    assert info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("trioserve serve: error: " + message), last
