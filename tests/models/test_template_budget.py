"""Work a model file or an adapter decides runs under a budget (#49):
chat templates and `target_modules` regexes run in child processes
(models/bounded.py) that are killed at their deadline, stop at their
memory and output limits, and stop when the thread waiting for them is
interrupted (a cancelled request), so nothing they do can hold a thread,
the GIL or the process. Each refusal's message is shown.

The deadlines here are shortened; a test's own guard (trio.fail_after or
a join timeout) is many times longer than what it waits for."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import trio

from trioserve.errors import ChatTemplateError
from trioserve.http.serve import request_cancelled
from trioserve.models import bounded, chat_template, lora
from trioserve.models.chat_template import ChatTemplate, TemplateOverrun
from trioserve.models.lora import AdapterError

HELLO = [{"role": "user", "content": "Hello!"}]
# Ten billion empty iterations: never ends in any test's lifetime, prints nothing.
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Loops only on a message that says "spin": passes the load check, loops on request.
SPIN_ON_REQUEST = "{% for m in messages %}{% if 'spin' in m['content'] %}" + SPIN + "{% endif %}{{ m['content'] }}{% endfor %}"
SPIN_PLEASE = [{"role": "user", "content": "spin please"}]


def on_request(body: str) -> str:
    """A template that runs ``body`` only for a conversation saying "spin"
    (so that it passes the load check)."""
    return "{% if 'spin' in messages[0]['content'] %}" + body + "{% endif %}"

GUARD_S = 60  # a hang guard, not a timing


@pytest.fixture(autouse=True)
def short_deadlines(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(lora, "REGEX_TIMEOUT_S", 1.0)


def busy_children() -> int:
    """Children started and not ended, less the idle ones kept for reuse."""
    with bounded._lock:
        return len(bounded._live) - len(bounded._idle)


def test_a_normal_template_renders_as_before():
    template = ChatTemplate(None)
    assert template.render(HELLO) == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    template.check()
    assert busy_children() == 0


def test_a_looping_template_is_stopped_at_its_deadline():
    template = ChatTemplate(SPIN_ON_REQUEST)
    with pytest.raises(TemplateOverrun) as info:
        template.render(SPIN_PLEASE)
    assert str(info.value) == "rendering the chat template ran for more than 1 s and was stopped"
    assert busy_children() == 0  # killed, not left spinning


def test_an_uninterruptible_operation_is_stopped_too():
    """One bytecode that runs for ever (a huge power, computed in C with the
    GIL held) cannot be stopped inside a process, only by killing it."""
    with pytest.raises(TemplateOverrun, match="^rendering the chat template ran for more than 1 s and was stopped$"):
        ChatTemplate(on_request("{{ 7 ** (10 ** 12 * messages|length) }}")).render(SPIN_PLEASE)
    assert busy_children() == 0


def test_compiling_is_bounded_too():
    """Jinja evaluates constant expressions while it compiles: a template
    can spin or fill memory before it renders anything."""
    with pytest.raises(TemplateOverrun) as info:
        ChatTemplate("{{ 7 ** (10 ** 12) }}")
    assert str(info.value) == "compiling the chat template ran for more than 1 s and was stopped"
    # Folding this one runs out of the child's memory, so Jinja leaves it to
    # the render, where it runs out again: at load.
    with pytest.raises(TemplateOverrun) as info:
        ChatTemplate("{{ 'x' * 10000000000 }}")
    assert str(info.value) == (
        "rendering the chat template ran out of its memory (256 MiB) at load, on a user message; the model's chat template cannot be served"
    )
    assert busy_children() == 0


def test_output_past_its_limit_is_stopped(monkeypatch):
    monkeypatch.setattr(chat_template, "OUTPUT_FLOOR_CHARS", 10_000)
    template = ChatTemplate(on_request("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}"))
    with pytest.raises(TemplateOverrun) as info:
        template.render(SPIN_PLEASE)
    assert str(info.value) == "rendering the chat template produced more than 10000 characters and was stopped"
    # The limit grows with the conversation: 4 characters per byte of input.
    big = [{"role": "user", "content": "y" * 5000}]
    assert len(ChatTemplate("{{ messages[0]['content'] * 3 }}").render(big)) == 15000


def test_memory_past_its_limit_is_stopped(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_MEMORY_BYTES", 64 << 20)
    doubling = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
    with pytest.raises(TemplateOverrun, match=r"^rendering the chat template ran out of its memory \(64 MiB\)$"):
        ChatTemplate(on_request(doubling)).render(SPIN_PLEASE)
    assert ChatTemplate(None).render(HELLO).startswith("<|im_start|>user")  # the child is still usable


def test_template_failures_keep_their_messages():
    with pytest.raises(ChatTemplateError, match="^only user messages$") as info:
        ChatTemplate("{{ raise_exception('only user messages') }}").render(HELLO)
    assert not isinstance(info.value, TemplateOverrun)
    with pytest.raises(ChatTemplateError, match=r"^chat template failed: it nests calls too deeply \(RecursionError\)$"):
        ChatTemplate("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").render(HELLO)
    with pytest.raises(ChatTemplateError, match="^chat template failed: 'foo' is undefined$"):
        ChatTemplate("{{ foo.bar }}").render(HELLO)
    with pytest.raises(ChatTemplateError, match=r"^chat template does not compile \(line 1\)"):
        ChatTemplate("{% for %}")


def test_the_load_check_refuses_a_template_that_loops_on_every_conversation():
    with pytest.raises(TemplateOverrun) as info:
        ChatTemplate(SPIN)
    assert str(info.value) == (
        "rendering the chat template ran for more than 1 s and was stopped at load, on a user message; the model's chat template cannot be served"
    )
    # One that loops only on the tools conversation is refused too, naming it.
    tools_spin = "{% if tools %}" + SPIN + "{% endif %}{{ messages[0]['content'] }}"
    with pytest.raises(TemplateOverrun, match="at load, on a user message with a tool;"):
        ChatTemplate(tools_spin)


def test_the_load_check_accepts_templates_that_refuse_some_shapes():
    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}{{ messages[-1]['content'] }}"
    assert ChatTemplate(no_system).render(HELLO) == "Hello!"
    assert ChatTemplate(SPIN_ON_REQUEST).render(HELLO) == "Hello!"


def test_an_interrupted_wait_kills_the_render():
    """What the interrupt check raises ends the wait at once, propagating
    unchanged, and the child is killed (it would run for a minute)."""

    class Interrupted(Exception):
        pass

    calls = 0

    def check():
        nonlocal calls
        calls += 1
        if calls > 4:
            raise Interrupted

    bounded.set_interrupt_check(check)
    try:
        chat_template.RENDER_TIMEOUT_S = 60.0
        started = time.monotonic()
        with pytest.raises(Interrupted):
            ChatTemplate(SPIN_ON_REQUEST).render(SPIN_PLEASE)
        assert time.monotonic() - started < GUARD_S / 2  # far from its deadline: ended by the interruption
    finally:
        bounded.set_interrupt_check(None)
    assert busy_children() == 0


async def test_a_cancelled_request_ends_its_render():
    """A render in trio.to_thread.run_sync, as the routes run it: cancelling
    the task ends the render (trio.Cancelled), the child is killed, long
    before the render's own deadline."""
    chat_template.RENDER_TIMEOUT_S = 600.0
    bounded.set_interrupt_check(request_cancelled)
    try:
        template = ChatTemplate(SPIN_ON_REQUEST)
        rendered = []
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as rendering:

                async def render() -> None:
                    rendered.append(await trio.to_thread.run_sync(template.render, SPIN_PLEASE))

                rendering.start_soon(render)
                while not busy_children():  # the render runs in its child: now cancel it
                    await trio.sleep(0.05)
                rendering.cancel_scope.cancel()
    finally:
        bounded.set_interrupt_check(None)
    assert not rendered
    assert busy_children() == 0


def test_request_cancelled_is_nothing_outside_trio_threads():
    request_cancelled()  # the main thread
    errors = []
    thread = threading.Thread(target=lambda: errors.append(request_cancelled()))
    thread.start()
    thread.join(GUARD_S)
    assert errors == [None]


def test_concurrent_renders_each_get_their_own_child():
    template = ChatTemplate("{{ messages[0]['content'] }}")
    results: dict[int, str] = {}

    def render(i: int) -> None:
        results[i] = template.render([{"role": "user", "content": f"message {i}"}])

    threads = [threading.Thread(target=render, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD_S)
    assert results == {i: f"message {i}" for i in range(6)}
    assert len(bounded._idle) <= bounded.MAX_IDLE


def test_an_idle_child_killed_from_outside_is_replaced():
    template = ChatTemplate(None)
    template.render(HELLO)
    with bounded._lock:
        idle = list(bounded._idle)
    for child in idle:
        child.process.kill()
        child.process.wait()
    assert template.render(HELLO).startswith("<|im_start|>user")


def test_an_orphaned_child_ends_itself():
    """A child whose parent never kills it (the parent died) ends by its own
    alarm shortly after the job's deadline."""
    child = bounded._Child()
    try:
        job = {"op": "render", "source": SPIN, "context": {"messages": []}, "output_limit": 100, "timeout_s": 0.5, "memory_bytes": 64 << 20}
        child.send(json.dumps(job).encode())
        assert child.process.wait(GUARD_S) == -signal.SIGALRM
    finally:
        child.kill()


# -- target_modules regexes ----------------------------------------------------------


def module_names(layers: int = 30) -> list[str]:
    return [lora.module_name(i, t) for i in range(layers) for t in lora.TARGETS]


def fail(problem: str) -> AdapterError:
    return AdapterError(f"adapter 'a': {problem}", field="path")


def test_a_backtracking_target_modules_regex_is_stopped():
    """`(.*)*Z` takes minutes per module name in Python's re, holding the
    GIL: here it is stopped at its deadline, and the adapter refused."""
    started = time.monotonic()
    with pytest.raises(AdapterError) as info:
        lora._fullmatches("(.*)*Z", module_names(), fail)
    assert str(info.value) == (
        "adapter 'a': matching target_modules '(.*)*Z' against the model's 210 module names ran for more than 1 s and was stopped; "
        "give target_modules as a list of module names, or a regex that does not backtrack"
    )
    assert time.monotonic() - started < GUARD_S
    assert busy_children() == 0


def test_target_modules_regexes_match_as_peft_does():
    names = module_names(2)
    assert lora._fullmatches(r".*\.(q_proj|v_proj)", names, fail) == [n.endswith(("q_proj", "v_proj")) for n in names]
    assert lora._fullmatches(r"model\.layers\.1\..*", names, fail) == [n.startswith("model.layers.1.") for n in names]
    with pytest.raises(AdapterError, match=r"^adapter 'a': target_modules '\(' is not a valid regular expression: missing \), unterminated subpattern"):
        lora._fullmatches("(", names, fail)
    with pytest.raises(AdapterError, match="^adapter 'a': target_modules is a regex of 5000 characters; at most 4096 are accepted$"):
        lora._fullmatches("a" * 5000, names, fail)
