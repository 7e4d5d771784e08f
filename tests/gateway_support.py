"""Real processes for the gateway tests: the Node upstream and the gateway under uvicorn."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server import ROOT, free_port

UPSTREAM_JS = ROOT / "examples" / "gateway" / "upstream.js"
HEALTH = "/_idempotency/health"


def _wait_until_up(process: subprocess.Popen[Any], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


class NodeUpstream:
    """examples/gateway/upstream.js in a process of its own; its counts are the audit."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> NodeUpstream:
        self.process = subprocess.Popen(
            ["node", str(UPSTREAM_JS)],
            env={**os.environ, "PORT": str(self.port), "HOST": "127.0.0.1"},
            stdout=subprocess.DEVNULL,
        )
        _wait_until_up(self.process, self.url + "/health", timeout)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def counts(self, key: str) -> dict[str, int]:
        """{"created": orders made with this key, "deliveries": requests that reached it}."""
        response = httpx.get(self.url + "/orders/count", params={"key": key}, timeout=10)
        response.raise_for_status()
        result: dict[str, int] = response.json()
        return result

    def created(self, key: str) -> int:
        return self.counts(key)["created"]


class GatewayProcess:
    """`python -m idempotency_asgi gateway ...`: the real command, one uvicorn worker, so
    that its pid is the process that serves (for kill -9 and memory readings)."""

    def __init__(self, upstream: str, database_url: str, *args: str, port: int | None = None):
        self.port = port or free_port()
        self.args = [
            sys.executable,
            "-m",
            "idempotency_asgi",
            "gateway",
            "--upstream",
            upstream,
            "--database-url",
            database_url,
            "--port",
            str(self.port),
            "--no-access-log",
            "--log-level",
            "warning",
            *args,
        ]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 30.0, env: dict[str, str] | None = None) -> GatewayProcess:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPOTENCY_")}
        self.process = subprocess.Popen(self.args, cwd=ROOT, env={**clean, **(env or {})})
        _wait_until_up(self.process, self.url + HEALTH, timeout)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown at all, as a crashed or OOM-killed gateway."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (the peak so far) of a process, in KiB, from /proc."""
    readings: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            readings[name] = int(value.split()[0])
    return readings
