"""A real PostgreSQL server for the tests, on 127.0.0.1 and a free port,
made with Debian's `initdb` in a fresh directory (under /tmp) and stopped by the test.

`postgres` refuses to run as root, so a root test run starts it as the
`postgres` user the Debian package makes. Where the binaries or that user
are missing, `start_postgres` raises `Unavailable` saying why, and the
tests skip with that reason (`make test` installs Debian's `postgresql`
where root and apt-get allow)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import attrs

START_TIMEOUT_S = 60
USER = "trioserve"


class Unavailable(Exception):
    """PostgreSQL cannot be started here; the message says why."""


def _binaries() -> Path:
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if versions:
        return Path(versions[-1]).parent
    raise Unavailable("PostgreSQL is not installed (Debian: apt-get install postgresql; make test does it as root)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@attrs.define
class Postgres:
    """A running server; `url` reaches its `postgres` database as a superuser."""

    bin: Path
    data: Path
    port: int
    runas: list[str]

    @property
    def url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str, timeout: float = START_TIMEOUT_S) -> None:
        done = subprocess.run([*self.runas, *argv], capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise Unavailable(f"{Path(argv[0]).name} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")

    def start(self) -> None:
        options = f"-h 127.0.0.1 -p {self.port} -k {self.data} -c fsync=on -c listen_addresses=127.0.0.1"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.data / "log"), "-w", "-t", str(START_TIMEOUT_S), "start")

    def remove(self) -> None:
        """Stop it (if running) and delete its files."""
        try:
            self.stop("immediate")
        except Unavailable:
            pass  # stopped already
        shutil.rmtree(self.data, ignore_errors=True)

    def stop(self, mode: str = "fast") -> None:
        """``mode`` "immediate" is a crash: no shutdown checkpoint."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", str(START_TIMEOUT_S), "stop")


def start_postgres() -> Postgres:
    """A new database cluster in a new directory under the system's temporary
    one (pytest's are closed to other users), started. `remove` it after."""
    binaries = _binaries()
    runas: list[str] = []
    data = Path(tempfile.mkdtemp(prefix="trioserve-pg-"))
    if os.geteuid() == 0:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(data)
            raise Unavailable("running as root and there is no postgres user to run PostgreSQL as") from None
        runas = ["runuser", "-u", "postgres", "--"]
        os.chown(data, account.pw_uid, account.pw_gid)
    data.chmod(0o700)
    server = Postgres(binaries, data, _free_port(), runas)
    try:
        server._run(str(binaries / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync")
        server.start()
    except BaseException:
        shutil.rmtree(data, ignore_errors=True)
        raise
    return server
