"""`idempotency-asgi dev-postgres`: a PostgreSQL on loopback for the getting-started guide. It
answers at the URL it prints, and nothing of it outlives the command, however it is stopped."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import pytest

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DevPostgres:
    def __init__(self, *arguments: str) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "idempotency_asgi", "dev-postgres"]
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port), *arguments],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            if line.startswith("Serving until Ctrl+C"):
                break
        else:
            raise AssertionError("".join(self.output))

    @property
    def url(self) -> str:
        [line] = [line for line in self.output if "export DATABASE_URL=" in line]
        return line.split("=", 1)[1].strip()

    async def server(self) -> tuple[int, Path]:
        """The postmaster's pid and the data folder, as the server itself tells them."""
        conn = await asyncpg.connect(self.url)
        try:
            data = Path(await conn.fetchval("SHOW data_directory"))
        finally:
            await conn.close()
        return int((data / "postmaster.pid").read_text().split()[0]), data

    def close(self) -> None:
        """However a test ends, its command is stopped (the command stops its server)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def started() -> Iterator[Callable[..., DevPostgres]]:
    made: list[DevPostgres] = []

    def start(*arguments: str) -> DevPostgres:
        made.append(DevPostgres(*arguments))
        return made[-1]

    yield start
    for dev in made:
        dev.close()


def gone(pid: int, timeout: float = 20.0) -> bool:
    """Exited (a zombie not yet reaped by whoever inherited it counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def deleted(path: Path, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


async def query(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval("SELECT 1"))
    finally:
        await conn.close()


async def test_it_prints_a_url_that_answers_and_stops_on_ctrl_c(started):
    dev = started()
    assert dev.url == f"postgresql://postgres@127.0.0.1:{dev.port}/postgres"
    assert await query(dev.url) == 1
    pid, data = await dev.server()
    dev.process.send_signal(signal.SIGINT)
    assert dev.process.wait(timeout=30) == 0
    assert gone(pid, timeout=1), "the server outlived the command"
    assert not data.exists(), "the temporary data folder is still there"
    assert dev.process.stdout is not None
    rest = dev.process.stdout.read()
    assert "PostgreSQL stopped." in rest
    assert "Warning" not in "".join(dev.output) + rest


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
async def test_a_killed_command_leaves_no_server_behind(started, signum):
    dev = started()
    pid, data = await dev.server()
    dev.process.send_signal(signum)
    dev.process.wait(timeout=30)
    assert gone(pid), f"the server outlived a {signum.name}"
    assert deleted(data.parent), "the temporary data folder is still there"


async def test_a_kept_data_dir_keeps_the_tables(started, tmp_path):
    data = tmp_path / "pg"
    dev = started("--data-dir", str(data))
    conn = await asyncpg.connect(dev.url)
    await conn.execute("CREATE TABLE kept (n int)")
    await conn.close()
    dev.process.send_signal(signal.SIGINT)
    assert dev.process.wait(timeout=30) == 0
    assert (data / "PG_VERSION").exists()
    again = started("--data-dir", str(data))
    conn = await asyncpg.connect(again.url)
    assert await conn.fetchval("SELECT count(*) FROM kept") == 0
    await conn.close()


def test_a_port_in_use_is_refused_clearly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        found = subprocess.run(
            [sys.executable, "-m", "idempotency_asgi", "dev-postgres", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert found.returncode == 1
    assert f"127.0.0.1:{port} is in use" in found.stderr
