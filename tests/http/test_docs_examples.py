"""Every curl command in the docs, run as written with the real `curl`
against a real server on the default model (SmolLM2), so that a documented
command that fails fails the suite.

The shell blocks (```sh, ```bash, ```shell, ```console) of docs/*.md and
README.md that hold a curl command are cut into commands (a command runs on
over a trailing backslash or an open quote) and run one at a time with
bash, in order, block by block, all against one server. What the test
changes in a command, and nothing else:

- the address: `localhost:8000` and `127.0.0.1:8000` become the test
  server's;
- placeholders the docs leave for the reader: `sess-…` becomes the session
  id, and `call_…` the tool call id, that an earlier command of the same
  block answered;
- file paths the docs invent (`PATHS`): the default model's GGUF file for a
  model to load, a LoRA adapter written by the test for SmolLM2's shapes;
- `curl` itself is a shell function that adds `--fail-with-body
  --show-error`, so an HTTP status of 400 or more is a failure (exit 22)
  with the error body in the report; `$ADMIN` is the server's admin key.

Commands in those blocks that are not curl are listed in `NOT_RUN` with the
reason; one that is neither run nor listed fails the test. Slow: loads the
model (a second copy, too, for the admin load example)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from pathlib import Path

import attrs
import pytest
import trio

from tests.http.conftest import start_server
from tests.lora_files import write_peft_adapter
from trioserve.config import EngineConfig, ServerSettings
from trioserve.models.checkpoint import resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SHELL_FENCE = re.compile(r"^\s*```(?:sh|bash|shell|console)\s*$")
ADDRESS = re.compile(r"\b(?:localhost|127\.0\.0\.1):8000\b")
ADMIN_KEY = "docs-admin-key"
CURL = 'curl() { command curl --fail-with-body --show-error --max-time 120 "$@"; }\n'
# SmolLM2-135M's projections, for the adapter the LoRA example loads.
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}

# Commands in curl blocks that the test does not run, by their words (shlex, comments dropped).
NOT_RUN = {
    "trioserve serve --model smollm2 --lora tuned=/adapters/tuned": "starts a server; the test's own server (the default model) stands in for it",
}


@attrs.frozen
class Command:
    doc: str  # docs/x.md:line
    text: str  # as written, lines joined by newlines

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)


def shell_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(line number of the first line, lines) of each shell block in ``path``."""
    lines = path.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if SHELL_FENCE.match(lines[i]):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            blocks.append((i + 2, lines[i + 1 : end]))
            i = end
        i += 1
    return blocks


def commands(name: str, first: int, lines: list[str]) -> list[Command]:
    """The commands of one block: blank and comment lines between commands
    are skipped; a command runs on while its last line ends with a backslash
    or a quote is open."""
    out: list[Command] = []
    pending: list[str] = []
    start = first
    for number, line in enumerate(lines, start=first):
        if not pending:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = number
        pending.append(line)
        text = "\n".join(pending)
        if text.endswith("\\"):
            continue
        try:
            shlex.split(text, comments=True)
        except ValueError:  # a quote still open
            continue
        out.append(Command(f"{name}:{start}", text))
        pending = []
    assert not pending, f"{name}: a command is not closed: {pending}"
    return out


def curl_blocks() -> list[list[Command]]:
    """Each shell block of the docs that holds a curl command, as commands."""
    found = []
    for path in DOCS:
        name = str(path.relative_to(ROOT))
        for first, lines in shell_blocks(path):
            block = commands(name, first, lines)
            if any(c.words[0] == "curl" for c in block):
                found.append(block)
    return found


def test_every_command_in_a_curl_block_is_run_or_listed():
    """Fast: the extraction finds the docs' curl examples, and every other
    command beside them is in NOT_RUN (and NOT_RUN names only commands the
    docs still have)."""
    blocks = curl_blocks()
    runs = [c for block in blocks for c in block if c.words[0] == "curl"]
    others = {" ".join(c.words): c.doc for block in blocks for c in block if c.words[0] != "curl"}
    assert len(runs) >= 25, [c.doc for c in runs]
    assert {"docs/running.md", "docs/sessions.md", "docs/guided.md", "docs/tools.md", "docs/models.md", "README.md"} <= {c.doc.split(":")[0] for c in runs}
    unlisted = {words: doc for words, doc in others.items() if words not in NOT_RUN}
    assert not unlisted, f"commands in curl blocks that this test neither runs nor lists in NOT_RUN: {unlisted}"
    stale = set(NOT_RUN) - set(others)
    assert not stale, f"NOT_RUN lists commands the docs no longer have: {stale}"


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    """The file paths the docs invent, and what stands in for each."""
    return {
        "/models/tuned.gguf": str(resolve_model_path("smollm2")),
        "/adapters/tuned2": str(write_peft_adapter(tmp_path / "tuned2", SMOLLM2_SHAPE, rank=4, targets=("q_proj", "v_proj"), seed=2)),
    }


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="the docs' examples are run with the real curl, and there is none on PATH")
async def test_the_docs_curl_examples_run(nursery, paths):
    engine = EngineConfig(model="smollm2", block_size=16, max_num_seqs=4)
    settings = attrs.evolve(ServerSettings(engine=engine), host="127.0.0.1", port=0, log_level="warning", admin_api_key=ADMIN_KEY)
    url = await start_server(nursery, settings)
    address = url.removeprefix("http://")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ADMIN": ADMIN_KEY, "LC_ALL": "C.UTF-8"}  # no proxy variables: curl goes straight to the server
    failures: list[str] = []
    took: list[tuple[float, str]] = []
    with trio.fail_after(300):
        for block in curl_blocks():
            captured: dict[str, str] = {}  # placeholder -> what an earlier command of the block answered
            for command in block:
                if command.words[0] != "curl":
                    assert " ".join(command.words) in NOT_RUN, command
                    continue
                text = ADDRESS.sub(address, command.text)
                for invented, real in paths.items():
                    text = re.sub(re.escape(invented) + r"\b", real, text)
                for placeholder in ("sess-…", "call_…"):
                    if placeholder in text:
                        if placeholder not in captured:
                            failures.append(f"{command.doc}: {placeholder} but no earlier command of its block answered one\n{command.text}")
                            break
                        text = text.replace(placeholder, captured[placeholder])
                else:
                    start = time.monotonic()
                    done = await trio.run_process(["bash", "-c", CURL + text], env=env, capture_stdout=True, capture_stderr=True, check=False)
                    took.append((time.monotonic() - start, command.doc))
                    out = done.stdout.decode(errors="replace")
                    if done.returncode != 0 or not out.strip():
                        failures.append(f"{command.doc}: exit status {done.returncode}\n{text}\nstdout: {out[:1000]}\nstderr: {done.stderr.decode(errors='replace')[:1000]}")
                        continue
                    for placeholder, pattern in (("sess-…", r'"id":\s*"(sess-[^"]+)"'), ("call_…", r'"id":\s*"(call_[^"]+)"')):
                        match = re.search(pattern, out)
                        if match:
                            captured.setdefault(placeholder, match[1])
    took.sort(reverse=True)
    print(f"{len(took)} commands in {sum(t for t, _ in took):.1f} s; slowest: " + ", ".join(f"{doc} {t:.1f} s" for t, doc in took[:5]))
    assert not failures, "documented commands that failed:\n\n" + "\n\n".join(failures)
