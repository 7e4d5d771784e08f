"""Real processes for the gateway tests: the Node upstream and the gateway under uvicorn."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server import ROOT, Supervised, free_port, wait_until_up

UPSTREAM_JS = ROOT / "examples" / "gateway" / "upstream.js"
HEALTH = "/_idempotency/health"


class NodeUpstream(Supervised):
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
        wait_until_up(self.process, self.url + "/health", timeout, healthy=200)
        return self

    def counts(self, key: str) -> dict[str, int]:
        """{"created": orders made with this key, "deliveries": requests that reached it}."""
        response = httpx.get(self.url + "/orders/count", params={"key": key}, timeout=10)
        response.raise_for_status()
        result: dict[str, int] = response.json()
        return result

    def created(self, key: str) -> int:
        return self.counts(key)["created"]


class GatewayProcess(Supervised):
    """`python -m idempotency_asgi gateway ...`: the real command, one uvicorn worker, so
    that its pid is the process that serves (for kill -9 and memory readings)."""

    stop_timeout = 15.0

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
        wait_until_up(self.process, self.url + HEALTH, timeout, healthy=200)
        return self


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (the peak so far) of a process, in KiB, from /proc."""
    readings: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            readings[name] = int(value.split()[0])
    return readings
