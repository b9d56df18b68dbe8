"""Nothing a model file or an adapter brings runs without bound (#49), on
real servers with the tiny model:

- a chat template that loops ends its request with a 400 saying so, at
  its deadline; /health and the model's other chats answer meanwhile;
- a render never outlives its request: a client that gives up ends it;
- a LoRA adapter whose target_modules regex backtracks for minutes is
  refused at its deadline, and /health answers while it is matched;
- SIGTERM ends a real `trioserve serve` process within --drain-timeout
  plus a few seconds while such a render or load runs, and the process
  ends even when a thread is stuck where nothing can stop it.

Deadlines are shortened (or, where a test shows the deadline is not what
ends the work, made ten minutes long); the tests' guards are generous."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.http.conftest import MODEL_NAME, assert_error, make_settings, start_server
from tests.http.test_drain import free_port
from tests.lora_files import write_peft_adapter
from tests.tiny_model import TINY, tiny_weights, train_tiny_tokenizer, write_gguf
from trioserve.http.serve import EXIT_GRACE_S
from trioserve.models import bounded, chat_template, lora

GUARD_S = 120  # hang guards only
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# A template that passes the load check and loops on a message saying "spin".
SPIN_ON_REQUEST = (
    "{% for m in messages %}{% if 'spin' in m['content'] %}" + SPIN + "{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BACKTRACKING = "(.*)*Z"  # minutes per module name in Python's re


def chat(content: str) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


@pytest.fixture(scope="module")
def spin_gguf(tmp_path_factory) -> Path:
    tokenizer = train_tiny_tokenizer()
    path = tmp_path_factory.mktemp("spin") / "spin.gguf"
    return write_gguf(path, tiny_weights(tokenizer.get_vocab_size(), seed=0), tokenizer, chat_template=SPIN_ON_REQUEST)


@pytest.fixture(scope="module")
def backtracking_adapter(tmp_path_factory) -> Path:
    """An adapter of every target whose config's target_modules is a
    catastrophic regex (the tensors are those of the plain list)."""
    return write_peft_adapter(tmp_path_factory.mktemp("redos") / "redos", TINY, extra_config={"target_modules": BACKTRACKING})


def busy_children() -> int:
    with bounded._lock:
        return len(bounded._live) - len(bounded._idle)


class HealthPoller:
    """Polls /health while something runs: how many answers came and the
    longest wait for one."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.answers = 0
        self.longest = 0.0

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            started = trio.current_time()
            response = await self.client.get("/health")
            assert response.status_code == 200, response.text
            self.answers += 1
            self.longest = max(self.longest, trio.current_time() - started)
            await trio.sleep(0.02)


async def test_a_looping_template_ends_its_requests_with_an_error(nursery, spin_gguf, monkeypatch):
    """Four looping renders (as many as the server prepares at once) end at
    their deadline with a 400 saying why; a normal chat then answers, and
    /health answered all along."""
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 2.0)
    url = await start_server(nursery, make_settings(spin_gguf))
    async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as client:
        with trio.fail_after(GUARD_S):
            assert (await client.post("/v1/chat/completions", json=chat("hello"))).status_code == 200
            answers: list[httpx.Response] = []
            poller = HealthPoller(client)
            async with trio.open_nursery() as inner:
                await inner.start(poller.run)

                async def spin() -> None:
                    answers.append(await client.post("/v1/chat/completions", json=chat("spin please")))

                async with trio.open_nursery() as spins:
                    for _ in range(4):
                        spins.start_soon(spin)
                    await trio.sleep(0.5)
                    normal = await client.post("/v1/chat/completions", json=chat("hello again"))
                inner.cancel_scope.cancel()
            assert normal.status_code == 200, normal.text
            for response in answers:
                assert_error(
                    response, 400, param="messages",
                    fragment="the chat template rejected the messages: rendering the chat template ran for more than 2 s and was stopped",
                )  # fmt: skip
            assert poller.answers >= 2, "no /health answer came while the renders ran"
    assert busy_children() == 0


async def test_a_render_ends_with_its_request(nursery, spin_gguf, monkeypatch):
    """A client that gives up ends the render it waited for, ten minutes
    before the render's own deadline: the child process is gone."""
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 600.0)
    url = await start_server(nursery, make_settings(spin_gguf))
    async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as client:
        with trio.fail_after(GUARD_S):
            answered = []
            async with trio.open_nursery() as asking:

                async def ask() -> None:
                    answered.append(await client.post("/v1/chat/completions", json=chat("spin please")))

                asking.start_soon(ask)
                while not busy_children():  # its render is running: now the client gives up
                    await trio.sleep(0.05)
                asking.cancel_scope.cancel()
            assert not answered, "the looping render answered"
            while busy_children():
                await trio.sleep(0.05)
            assert (await client.post("/v1/chat/completions", json=chat("hello"))).status_code == 200


async def test_a_backtracking_target_modules_regex_is_refused_while_health_answers(nursery, tiny_gguf, backtracking_adapter, monkeypatch):
    monkeypatch.setattr(lora, "REGEX_TIMEOUT_S", 2.0)
    url = await start_server(nursery, make_settings(tiny_gguf))
    async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as client:
        with trio.fail_after(GUARD_S):
            poller = HealthPoller(client)
            async with trio.open_nursery() as inner:
                await inner.start(poller.run)
                refused = await client.post("/v1/lora_adapters", json={"name": "redos", "path": str(backtracking_adapter)})
                during = poller.answers
                inner.cancel_scope.cancel()
            assert_error(
                refused, 400, param="path",
                fragment="adapter 'redos': matching target_modules '(.*)*Z' against the model's 14 module names ran for more than 2 s "
                "and was stopped; give target_modules as a list of module names, or a regex that does not backtrack",
            )  # fmt: skip
            # Python's re holds the GIL for a whole match: in this process, no
            # answer could have come until the match was over (minutes).
            assert during >= 2, f"/health answered {during} times during the load"
            listed = (await client.get("/v1/lora_adapters")).json()["data"]
            assert [a["name"] for a in listed] == []
    assert busy_children() == 0


async def test_a_template_that_loops_on_every_conversation_is_refused_at_load(nursery, tiny_gguf, tmp_path, monkeypatch):
    """An admin load of a model whose chat template loops on every
    conversation is refused once its load check runs past the deadline;
    /health answers meanwhile and the served models stay as they were."""
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 5.0)
    tokenizer = train_tiny_tokenizer()
    looping = write_gguf(tmp_path / "looping.gguf", tiny_weights(tokenizer.get_vocab_size(), seed=0), tokenizer, chat_template=SPIN)
    key = "admin-key-49"
    url = await start_server(nursery, attrs.evolve(make_settings(tiny_gguf), admin_api_key=key))
    async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as client:
        with trio.fail_after(GUARD_S):
            poller = HealthPoller(client)
            async with trio.open_nursery() as inner:
                await inner.start(poller.run)
                refused = await client.post("/admin/models/load", headers={"Authorization": f"Bearer {key}"}, json={"name": "looping", "path": str(looping)})
                during = poller.answers
                inner.cancel_scope.cancel()
            error = assert_error(
                refused, 400, param="path", code="load_failed",
                fragment="rendering the chat template ran for more than 5 s and was stopped at load, on a user message; "
                "the model's chat template cannot be served",
            )  # fmt: skip
            assert error["message"].startswith("loading 'looping' from "), error
            assert during >= 2, f"/health answered {during} times during the load"
            # Checked on the event loop, the load would hold every /health for the whole 5 s.
            assert poller.longest < 4.5, f"a /health waited {poller.longest:.1f} s during the load"
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL_NAME]
    assert busy_children() == 0


# -- SIGTERM, on a real process -------------------------------------------------------

# `trioserve serve` as its console script runs it, with a module constant changed first.
SERVE_WITH = "import sys\n{setup}\nfrom trioserve.cli import main\nsys.exit(main(sys.argv[1:]))"
# The backstop moved out of the way, so that exit status 0 shows the drain
# itself ended the work (on a loaded machine, within the drain timeout plus
# however long the engine takes to stop).
NO_BACKSTOP = "import trioserve.http.serve as s; s.EXIT_GRACE_S = 600.0"


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def all_ended(pids: list[int]) -> bool:
    """Whether every one of ``pids`` has ended (or does within a few seconds:
    a child killed or left at its parent's exit ends a moment later)."""
    with trio.move_on_after(10):
        while any(alive(pid) for pid in pids):
            await trio.sleep(0.05)
    return not any(alive(pid) for pid in pids)


async def sigterm_while(model: Path, setup: str, start_work, *, drain_timeout: float = 2.0) -> tuple[int, float, str, list[int]]:
    """Start a real server running ``setup`` first, start ``start_work(client)``
    (a request that keeps running), SIGTERM it once that runs, and wait for
    the process to end. Returns its exit status, the seconds from the
    signal to the end, its stderr, and the child processes it had."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-c", SERVE_WITH.format(setup=setup), "serve", "--model", str(model), "--dtype", "float32", "--port", str(port),
        "--kv-cache-bytes", "1MiB", "--served-model-name", MODEL_NAME, "--drain-timeout", str(drain_timeout), "--log-level", "warning",
    ]  # fmt: skip
    stderr = bytearray()
    proc = await trio.lowlevel.open_process(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with trio.open_nursery() as nursery:

            async def drain_stderr() -> None:
                async for data in proc.stderr:
                    stderr.extend(data)

            nursery.start_soon(drain_stderr)
            with trio.fail_after(GUARD_S):
                async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as client:
                    while True:
                        assert proc.returncode is None, stderr.decode(errors="replace")[-2000:]
                        try:
                            if (await client.get("/health")).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        await trio.sleep(0.1)
                    nursery.start_soon(start_work, client)
                    while not children_of(proc.pid):  # the work's child process runs
                        await trio.sleep(0.05)
                    await trio.sleep(0.5)
                    children = children_of(proc.pid)
                    proc.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
                    code = await proc.wait()
                    took = time.monotonic() - signalled
    except BaseException as failure:
        failure.add_note(f"server stderr: {stderr.decode(errors='replace')[-4000:]}")
        raise
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.move_on_after(10):
                await proc.wait()
    return code, took, stderr.decode(errors="replace"), children


async def expect_failure(client: httpx.AsyncClient, method: str, path: str, body: dict) -> None:
    """Send a request the server's end cuts (or answers with an error)."""
    try:
        response = await client.request(method, path, json=body)
    except httpx.TransportError:
        return
    assert response.status_code != 200, response.text


async def test_sigterm_ends_the_process_while_a_template_loops(spin_gguf):
    async def work(client: httpx.AsyncClient) -> None:
        await expect_failure(client, "POST", "/v1/chat/completions", chat("spin please"))

    setup = f"import trioserve.models.chat_template as t; t.RENDER_TIMEOUT_S = 600.0\n{NO_BACKSTOP}"
    code, took, stderr, children = await sigterm_while(spin_gguf, setup, work)
    assert code == 0, f"{took:.1f} s after SIGTERM; stderr: {stderr[-3000:]}"  # the drain cut the request, and that ended the render
    assert children and await all_ended(children)


async def test_sigterm_ends_the_process_while_an_adapter_regex_backtracks(tiny_gguf, backtracking_adapter):
    async def work(client: httpx.AsyncClient) -> None:
        await expect_failure(client, "POST", "/v1/lora_adapters", {"name": "redos", "path": str(backtracking_adapter)})

    setup = f"import trioserve.models.lora as l; l.REGEX_TIMEOUT_S = 600.0\n{NO_BACKSTOP}"
    code, took, stderr, children = await sigterm_while(tiny_gguf, setup, work)
    assert code == 0, f"{took:.1f} s after SIGTERM; stderr: {stderr[-3000:]}"
    assert children and await all_ended(children)


async def test_sigterm_ends_the_process_whatever_holds_it(spin_gguf):
    """A thread stuck where nothing can interrupt it (here: the wait for a
    looping render, made deaf to cancellation, with ten minutes to go)
    cannot hold the process: it ends EXIT_GRACE_S after the drain timeout,
    with status 1 and a line saying so, its children killed."""

    async def work(client: httpx.AsyncClient) -> None:
        await expect_failure(client, "POST", "/v1/chat/completions", chat("spin please"))

    setup = (
        "import time\nimport trioserve.models.chat_template as t\nt.RENDER_TIMEOUT_S = 600.0\nrender = t.ChatTemplate.render\n"
        "def stuck(self, messages, **kw):\n"
        "    if 'spin' in messages[-1]['content']:\n"
        "        t.bounded.set_interrupt_check(None)\n"  # nothing interrupts the wait either
        "    return render(self, messages, **kw)\n"
        "t.ChatTemplate.render = stuck"
    )
    code, took, stderr, children = await sigterm_while(spin_gguf, setup, work, drain_timeout=1.0)
    assert code == 1, stderr[-3000:]
    assert f"trioserve: still running {1.0 + EXIT_GRACE_S:g} s after the signal; exiting now" in stderr, stderr[-3000:]
    assert took < GUARD_S
    assert children and await all_ended(children)

