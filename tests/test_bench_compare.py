"""bench/compare.py run for real, on the tiny model: trioserve serves it as
both "trioserve" and "peer" (fresh processes per level, free ports on
127.0.0.1), and the report must hold both sides, the ratio, and only the
peer's requests must carry --peer-body. A peer that exits at once must fail
the run with a message naming it. Every server compare.py starts must be
gone when it returns."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPARE = ROOT / "bench" / "compare.py"
MAX_TOKENS = 6
PEER_MAX_TOKENS = 3  # sent to the peer only, through --peer-body


def tiny_serve_cmd() -> str:
    head = shlex.join([sys.executable, "-m", "trioserve.cli", "serve"])
    return (head + " --host 127.0.0.1 --port {port} --model {model} --dtype float32 --kv-cache-bytes 4MiB "
            "--served-model-name tiny --drain-timeout 5 --log-level warning")


def run_compare(*args: str, timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
    """Run compare.py; on a timeout, Ctrl-C it first so that it stops its
    servers (they run in process groups of their own), then kill it. The
    timeout only guards against a hang, and compare.py does not wait for a
    quiet machine (--quiet-wait 0): a busy machine makes the run slower,
    never failed."""
    proc = subprocess.Popen([sys.executable, str(COMPARE), "--quiet-wait", "0", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"compare.py ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def last_json(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert lines, "no output"
    return json.loads(lines[-1])


def assert_gone(stdout: str) -> None:
    pids = [int(p) for p in re.findall(r"\] pid (\d+),", stdout)]
    assert pids, stdout
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_trioserve_against_itself_reports_both_and_the_ratio(tiny_checkpoints, tmp_path):
    cmd = tiny_serve_cmd()
    logs = tmp_path / "logs"
    done = run_compare(
        "--model", str(tiny_checkpoints["gguf_f32"]), "--trioserve-cmd", cmd, "--peer-cmd", cmd,
        "--peer-body", json.dumps({"max_tokens": PEER_MAX_TOKENS}),
        "--concurrency", "1", "--concurrency", "2", "--prompt-tokens", "12", "--max-tokens", str(MAX_TOKENS),
        "--warmup-tokens", "2", "--startup-timeout", "300", "--timeout", "300", "--log-dir", str(logs),
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    report = last_json(done.stdout)
    assert set(report["levels"]) == {"1", "2"}
    for level, entry in report["levels"].items():
        requests = 2 * int(level)  # bench/serve.py's default: 2 x concurrency
        for name, tokens in (("trioserve", MAX_TOKENS), ("peer", PEER_MAX_TOKENS)):
            side = entry[name]
            assert side["tokens_per_s"] > 0, (name, side)
            assert side["errors"] == 0 and side["requests"] == requests, (name, side)
            # ignore_eos: exactly max_tokens each; the peer's come from --peer-body
            assert side["output_tokens"] == tokens * requests, (name, side)
            assert side["ttft_ms"]["p50"] is not None and side["itl_ms"]["p50"] is not None, (name, side)
        # the report's ratio of its two (rounded) rates, to 3 places: exactly (within 1% failed when a busy
        # machine made the ratio small: 0.023 reported for 0.0225)
        assert entry["ratio"] == round(entry["trioserve"]["tokens_per_s"] / entry["peer"]["tokens_per_s"], 3)
    assert report["peer_body"] == {"max_tokens": PEER_MAX_TOKENS}
    assert report["peer_cmd"] == cmd and report["machine"]
    assert re.search(r"^\| 1 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", done.stdout, re.M), done.stdout
    assert re.search(r"^\| 2 \| ", done.stdout, re.M), done.stdout
    assert "the ratio compares different work" in done.stdout  # 6 vs 3 tokens a request
    # a fresh server per side and level, each stopped with SIGTERM (it drained) and gone
    names = sorted(p.name for p in logs.iterdir())
    assert names == ["peer-c1.log", "peer-c2.log", "trioserve-c1.log", "trioserve-c2.log"]
    for path in logs.iterdir():
        assert "SIGTERM received" in path.read_text(), path.read_text()
    assert_gone(done.stdout)


def test_a_peer_that_exits_at_once_fails_the_run_naming_it(tiny_checkpoints, tmp_path):
    peer = shlex.join([sys.executable, "-c", "import sys; print('peer says bye'); sys.exit(3)"]) + " --port {port}"
    done = run_compare(
        "--model", str(tiny_checkpoints["gguf_f32"]), "--peer-cmd", peer, "--only", "peer",
        "--concurrency", "1", "--startup-timeout", "300", "--log-dir", str(tmp_path),
    )
    assert done.returncode != 0, done.stdout
    assert "peer exited with status 3" in done.stderr, done.stderr
    assert "peer says bye" in done.stderr, done.stderr  # the log's tail
    report = last_json(done.stdout)
    assert "exited with status 3" in report["levels"]["1"]["peer"]["error"]
    assert report["levels"]["1"]["ratio"] is None
    assert_gone(done.stdout)


def test_a_command_without_a_port_is_a_usage_error(tmp_path):
    done = run_compare("--peer-cmd", "llama-server --port 8080", "--log-dir", str(tmp_path))
    assert done.returncode == 2
    assert "--peer-cmd must contain {port}" in done.stderr


@pytest.fixture
def compare(monkeypatch):
    """bench/compare.py imported in process; it puts bench/ on sys.path and
    imports its siblings, which are undone afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_compare", COMPARE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_compare", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    bench = str(COMPARE.parent)
    for name, mod in list(sys.modules.items()):
        if name != "bench_compare" and str(getattr(mod, "__file__", "") or "").startswith(bench):
            del sys.modules[name]


def test_placeholders_fill_every_word_and_leave_other_braces(compare):
    argv = compare.expand("srv --port={port} -m '{model}' -t {threads} --json '{\"a\": 1}'",
                          port=1234, model="/m dir/x.gguf", threads=2, extra=["--flag", "{port}"])
    assert argv == ["srv", "--port=1234", "-m", "/m dir/x.gguf", "-t", "2", "--json", '{"a": 1}', "--flag", "1234"]


def test_peak_memory_counts_a_servers_child_processes(compare, tmp_path):
    """A server that runs its engine in a child process (vLLM does) is
    measured whole: the child's peak is in the figure, not only the parent's."""
    child = "import sys, time; b = bytearray(200 << 20); sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"
    parent = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE); "
              "p.stdout.readline(); open(sys.argv[1], 'w').write('up'); time.sleep(60)")
    flag = tmp_path / "up"
    server = compare.Server("peer", [sys.executable, "-c", parent, str(flag)], 0, tmp_path / "log")
    server.start()
    try:
        for _ in range(600):  # up to 30 s for two Python starts
            if flag.exists() or server.proc.poll() is not None:
                break
            time.sleep(0.05)
        assert flag.exists(), (tmp_path / "log").read_text()
        assert server.peak_rss_mb() >= 200, server.peak_rss_mb()
    finally:
        server.stop()
    assert server.proc.poll() is not None


def test_stopping_a_server_waits_until_its_whole_group_is_gone(compare, tmp_path):
    """A server whose engine child ignores SIGTERM and outlives its parent
    (the parent exits at once on SIGTERM) is gone, child included, when
    `stop` returns: the next server's load does not share the cores with it."""
    child = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"
    parent = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE); "
              f"p.stdout.readline(); open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(60)")
    flag = tmp_path / "child"
    server = compare.Server("peer", [sys.executable, "-c", parent, str(flag)], 0, tmp_path / "log")
    server.start()
    try:
        for _ in range(600):  # up to 30 s for two Python starts
            if flag.exists() and flag.read_text() or server.proc.poll() is not None:
                break
            time.sleep(0.05)
        child_pid = int(flag.read_text())
        assert compare._group_members(server.proc.pid).keys() >= {server.proc.pid, child_pid}
    finally:
        server.stop()
    assert server.proc.poll() is not None
    assert compare._group_members(server.proc.pid) == {}


def test_a_server_starts_only_once_the_machine_is_quiet(compare):
    """`wait_quiet` waits while other processes keep the cores busy (here a
    busy loop a core, each stopping after a while) and returns once they
    are idle; with no one busy it returns at once."""
    if compare.wait_quiet(5.0) < compare.QUIET_IDLE:
        pytest.skip("this machine is not quiet enough to tell a busy one from it")
    loop = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        assert compare.cpu_idle() < compare.QUIET_IDLE
        started = time.monotonic()
        idle = compare.wait_quiet(30.0)
        assert idle >= compare.QUIET_IDLE and time.monotonic() - started >= 1.0
    finally:
        for p in busy:
            p.kill()
            p.wait()
