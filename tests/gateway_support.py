"""Real processes for the gateway tests: the Node upstream and the gateway under uvicorn, and
an upstream of a test's own (a raw-socket server in a thread) for what Node cannot be made to
do: keep odd targets byte for byte, hold a body back until the test says, reset."""

from __future__ import annotations

import fcntl
import os
import socket
import socketserver
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx
import orjson

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

    def start(
        self,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
        *,
        preexec_fn: Callable[[], object] | None = None,
        stderr: BinaryIO | None = None,
    ) -> GatewayProcess:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPOTENCY_")}
        self.process = subprocess.Popen(
            self.args,
            cwd=ROOT,
            env={**clean, **(env or {})},
            preexec_fn=preexec_fn,
            stderr=stderr,
        )
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


# -- an upstream of a test's own ---------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """One request as the upstream read it off the wire."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


#: Writes the whole answer on the connection; returns False when it closed the connection.
Route = Callable[[socket.socket, Received], bool]


class ScriptedUpstream:
    """An HTTP/1.1 server on a bare socket: each route (by the target's path) writes its answer
    byte by byte as its test scripts it; anything else gets 200 with the request as JSON. It
    keeps every request it was sent, in order: `requests` is the audit."""

    def __init__(self) -> None:
        self.requests: list[Received] = []
        self.routes: dict[bytes, Route] = {}
        upstream = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                upstream._serve(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> ScriptedUpstream:
        self._thread.start()
        return self

    def count(self, target: bytes) -> int:
        """How many of the requests it was sent had this target."""
        return len([r for r in self.requests if r.target == target])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while (request := _read_request(reader)) is not None:
                self.requests.append(request)
                path = request.target.partition(b"?")[0]
                if not self.routes.get(path, echo)(conn, request):
                    return
        except OSError:
            return
        finally:
            reader.close()


def _read_request(reader: BinaryIO) -> Received | None:
    line = reader.readline()
    if not line:
        return None
    method, target, _ = line.rstrip(b"\r\n").split(b" ", 2)
    headers = []
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.rstrip(b"\r\n").partition(b":")
        headers.append((name, value.strip()))
    fields = {name.lower(): value for name, value in headers}
    body = b""
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        while size := int(reader.readline().split(b";")[0], 16):
            body += reader.read(size)
            reader.readline()
        reader.readline()
    elif b"content-length" in fields:
        body = reader.read(int(fields[b"content-length"]))
    return Received(method, target, headers, body)


def answer(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A whole response with a Content-Length."""
    head = [b"HTTP/1.1 %d Scripted" % status, *(name + b": " + value for name, value in headers)]
    head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def writes(answer: bytes) -> Route:
    """A route that writes `answer` in one write (what comes after it arrives with it)."""

    def route(conn: socket.socket, request: Received) -> bool:
        conn.sendall(answer)
        return True

    return route


def echo(conn: socket.socket, request: Received) -> bool:
    """200 with the request as the upstream received it (strings as latin-1: byte for byte)."""
    seen = {
        "method": request.method.decode("latin-1"),
        "target": request.target.decode("latin-1"),
        "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in request.headers],
        "body_bytes": len(request.body),
    }
    conn.sendall(answer(200, [(b"Content-Type", b"application/json")], orjson.dumps(seen)))
    return True


def wait_until_delivered(conn: socket.socket, timeout: float = 10.0) -> None:
    """Until the peer's kernel has acknowledged every byte written on the connection (Linux's
    SIOCOUTQ: written and not yet acknowledged), so that nothing is left to lose."""
    deadline = time.monotonic() + timeout
    while struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]:
        if time.monotonic() > deadline:
            raise AssertionError("the peer did not take the bytes written")
        time.sleep(0.005)


def reset(conn: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the connection breaks, it does not end."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def raw_request(url: str, request: bytes) -> bytes:
    """One HTTP/1.1 exchange on a bare socket: exactly these bytes go out (end them with
    `Connection: close`); everything until the server closes comes back."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far, from /proc (ticks of 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chunked(body: bytes, size: int) -> bytes:
    """`body` in chunks of `size` bytes, with the last chunk: as a chunked answer carries it."""
    head = b"%x\r\n" % size
    whole, tail = divmod(len(body), size)
    parts = [head + body[i * size : (i + 1) * size] + b"\r\n" for i in range(whole)]
    if tail:
        parts.append(b"%x\r\n" % tail + body[whole * size :] + b"\r\n")
    return b"".join(parts) + b"0\r\n\r\n"
