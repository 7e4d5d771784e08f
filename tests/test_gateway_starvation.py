"""Slow clients against the gateway run directly (no nginx in front): uploads trickled past
the memory buffer, downloads nobody reads, more connections than the gateway takes. None of
it may hold an upstream connection, or more memory than a buffer per connection: another
tenant's keyed POST still goes through at once. The gateway is the real command with two
upstream connections; the upstream a bare socket whose log of every request it read (and
count of downloads it sent whole) is the audit."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import orjson
import pytest

from idempotency_asgi.problems import TYPE_PREFIX
from tests.gateway_support import GatewayProcess, Received, memory_kib, status_of
from tests.helpers import headers, new_key

pytestmark = pytest.mark.slow

BUFFER = 64 * 1024
ENV = {
    "IDEMPOTENCY_GATEWAY_MAX_CONNECTIONS": "2",
    "IDEMPOTENCY_GATEWAY_CONNECT_TIMEOUT": "1",
    "IDEMPOTENCY_GATEWAY_REQUEST_BUFFER_BYTES": str(BUFFER),
    "IDEMPOTENCY_GATEWAY_BODY_TIMEOUT": "2",
    "IDEMPOTENCY_GATEWAY_BODY_DEADLINE": "3",
    "IDEMPOTENCY_GATEWAY_SEND_TIMEOUT": "5",
    "IDEMPOTENCY_GATEWAY_REQUEST_SPOOL_BYTES": str(4 * 1024 * 1024),
    "IDEMPOTENCY_GATEWAY_MAX_CLIENT_CONNECTIONS": "60",
}


DOWNLOAD = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    scripted_upstream.downloads = 0

    def download(conn: socket.socket, request: Received) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % DOWNLOAD)
        part = b"d" * (1024 * 1024)
        for _ in range(DOWNLOAD // len(part)):
            conn.sendall(part)
        scripted_upstream.downloads += 1  # sent whole: the gateway took every byte
        return True

    scripted_upstream.routes[b"/download"] = download
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(upstream.url, schema, "--tenant-header", "x-tenant")
    process.start(env=ENV)
    yield process
    process.stop()


def connect(gateway: GatewayProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gateway.port), timeout=15)


def problem_name(response: bytes) -> str:
    name: str = orjson.loads(response.partition(b"\r\n\r\n")[2])["type"]
    return name.removeprefix(TYPE_PREFIX)


def read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def test_uploads_trickled_past_the_buffer_hold_no_upstream_connection(gateway, upstream):
    """Two clients (as many as the upstream connections) send a body past the memory buffer,
    then a byte every half second: never a pause as long as `body_timeout`. They are read
    into temporary files, not streamed upstream: another tenant's keyed POST gets through at
    once, and at `body_deadline` each trickler gets 408 and nothing reached the service."""
    size = BUFFER + 1024 + 100
    stop = threading.Event()
    trickling = []
    for _ in range(2):
        sock = connect(gateway)
        sock.sendall(
            b"POST /trickled HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % size
            + b" " * (BUFFER + 1024)
        )
        trickling.append(sock)

    def trickle() -> None:
        while not stop.wait(0.5):
            for sock in trickling:
                with contextlib.suppress(OSError):
                    sock.send(b" ")

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        await asyncio.sleep(0.5)  # both are past the buffer
        key = new_key()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            started = time.monotonic()
            order = await http.post("/echo", json={"sku": "A"}, headers=headers("other", key))
            took = time.monotonic() - started
        assert order.status_code == 200, order.text
        assert took < 1.0  # not after a wait for a connection (1 s, then 502)
        answers = [await asyncio.to_thread(read_until_closed, sock) for sock in trickling]
    finally:
        stop.set()
        sender.join()
        for sock in trickling:
            sock.close()
    for answer in answers:
        assert status_of(answer) == 408, answer[:200]
        assert problem_name(answer) == "request-body-timeout"
        assert b"not whole within 3 s" in answer
    assert upstream.count(b"/trickled") == 0


@pytest.fixture
def gateway_as_shipped(upstream, schema):
    """The command with its defaults."""
    process = GatewayProcess(upstream.url, schema, "--tenant-header", "x-tenant").start()
    yield process
    process.stop()


async def test_trickled_bodies_take_a_buffer_of_memory_each_not_the_body(gateway_as_shipped):
    """Forty clients each send all but a byte of a body just under 1 MiB, and wait. What
    they sent is held in temporary files past the first 64 KiB (the default buffer): the
    gateway's memory grows by a fraction of the 40 MiB they sent (it grew by all of it, 46
    to 87 MiB, with the 1 MiB buffer it had)."""
    gateway = gateway_as_shipped
    size = 1024 * 1024 - 1024
    before = memory_kib(gateway.pid)["VmRSS"]
    stalled = []
    try:
        for _ in range(40):
            sock = connect(gateway)
            sock.sendall(
                b"PUT /upload HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % size
                + b"b" * (size - 1)
            )
            stalled.append(sock)
        await asyncio.sleep(1.0)  # every byte sent was read
        grown = memory_kib(gateway.pid)["VmRSS"] - before
    finally:
        for sock in stalled:
            sock.close()
    print(f"40 stalled 1 MiB uploads: gateway VmRSS +{grown / 1024:.1f} MiB")
    assert grown < 16 * 1024, f"forty stalled uploads grew the gateway by {grown} KiB"


def test_a_body_past_the_read_ahead_is_refused_before_anything_is_sent(gateway, upstream):
    size = 4 * 1024 * 1024 + 1
    with connect(gateway) as sock:
        sock.sendall(
            b"POST /too-large HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x\r\n" % size + b"x" * size + b"\r\n0\r\n\r\n"
        )
        answer = read_until_closed(sock)
    assert status_of(answer) == 413, answer[:200]
    assert problem_name(answer) == "request-body-too-large"
    assert upstream.count(b"/too-large") == 0


async def test_downloads_nobody_reads_hold_no_upstream_connection(gateway, upstream):
    """Four clients (twice the upstream connections) ask for 16 MiB each and never read it.
    The gateway reads each answer at the upstream's pace into a temporary file and frees the
    connection: the upstream sends all four whole, and a keyed POST gets through at once."""
    done = upstream.downloads
    before = memory_kib(gateway.pid)["VmRSS"]
    stuck = []
    try:
        for _ in range(4):
            sock = connect(gateway)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET /download HTTP/1.1\r\nHost: a\r\n\r\n")
            stuck.append(sock)
        for _ in range(100):  # each sent whole, on the upstream's own count
            if upstream.downloads == done + 4:
                break
            await asyncio.sleep(0.1)
        grown = memory_kib(gateway.pid)["VmRSS"] - before
        key = new_key()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            started = time.monotonic()
            order = await http.post("/echo", json={"sku": "B"}, headers=headers("other", key))
            took = time.monotonic() - started
    finally:
        for sock in stuck:
            sock.close()
    assert upstream.downloads == done + 4
    assert order.status_code == 200, order.text
    assert took < 1.0
    assert grown < 16 * 1024, f"four unread downloads grew the gateway by {grown} KiB"


async def test_past_the_connection_bound_a_new_connection_gets_503(gateway):
    """At most 60 connections a worker here (1,000 by default): the 61st is answered 503
    and closed before anything is read; once some close, new ones are served again."""
    idle = [connect(gateway) for _ in range(60)]
    try:
        await asyncio.sleep(0.3)
        with connect(gateway) as extra:
            extra.sendall(b"GET /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            refused = await asyncio.to_thread(read_until_closed, extra)
    finally:
        for sock in idle:
            sock.close()
    assert status_of(refused) == 503, refused[:200]
    assert problem_name(refused) == "too-many-connections"
    await asyncio.sleep(0.3)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        assert (await http.get("/echo")).status_code == 200
