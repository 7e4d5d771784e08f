"""A real uvicorn server in its own process, for tests where the wire and crashes matter."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_PR_SET_PDEATHSIG = 1


def dies_with_parent(signum: int) -> Callable[[], None]:
    """A `preexec_fn` after which the child gets `signum` when the thread that started it
    ends (on Linux; elsewhere it does nothing): a test run killed with SIGKILL, which no
    `finally` and no atexit survive, takes its servers with it. Start such children from
    the main thread. It runs after subprocess has switched to the child's user, whose
    change would clear the setting."""

    def preexec() -> None:  # pragma: no cover - runs in the child, before exec
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)

    return preexec


def child_pids(pid: int) -> list[int]:
    """The pids of `pid`'s child processes (Linux: read from /proc; elsewhere none)."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    # pid (comm) state ppid ...: comm may hold spaces and parentheses.
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def running(pid: int) -> bool:
    """Whether process `pid` is there and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def wait_until_up(
    process: subprocess.Popen[bytes], url: str, timeout: float, *, healthy: int = 500
) -> None:
    """Poll url until it answers below `healthy` (or exactly 200 when healthy=200)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            status = httpx.get(url, timeout=1.0).status_code
            if status == 200 or (healthy != 200 and status < healthy):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


class Supervised:
    """A child process the tests own: killed like a crash, or stopped like a deploy."""

    process: subprocess.Popen[bytes] | None = None
    stop_timeout: float = 10.0

    def kill(self) -> None:
        """SIGKILL: no shutdown, no cleanup, as a crashed or OOM-killed process."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


class UvicornProcess(Supervised):
    #: run in the child before uvicorn starts (see `dies_with_parent`)
    preexec: Callable[[], None] | None = None

    def __init__(
        self,
        target: str,
        env: dict[str, str],
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        log: Path | None = None,
    ) -> None:
        self.target = target
        self.extra_args = extra_args
        self.log = log  # where its stdout and stderr go (default: the test run's own)
        self.env = {**os.environ, **env}
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_path: str = "/read", timeout: float = 20.0) -> UvicornProcess:
        output = None if self.log is None else self.log.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                self.target,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                "--no-access-log",
                *self.extra_args,
            ],
            cwd=ROOT,
            env=self.env,
            stdout=output,
            stderr=output,
            preexec_fn=self.preexec,
        )
        if output is not None:
            output.close()  # the child has its own copy
        try:
            wait_until_up(self.process, self.url + ready_path, timeout)
        except RuntimeError:
            self.stop()
            raise
        return self


def serve(
    dsn: str, *, store: dict | None = None, options: dict | None = None, **env: str
) -> UvicornProcess:
    """The test app (tests/apps.py) under uvicorn on `dsn`: `store` its PostgresStore's
    options, `options` the middleware's, `env` more of its environment."""
    return UvicornProcess(
        "tests.apps:app",
        {
            "DATABASE_URL": dsn,
            "TEST_APP_SERVE": "1",
            "TEST_STORE_OPTIONS": json.dumps(store or {}),
            "TEST_APP_OPTIONS": json.dumps(options or {}),
            **env,
        },
    ).start()


def wire(url: str) -> httpx.AsyncClient:
    """A client for many concurrent requests to one server."""
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=30.0)
