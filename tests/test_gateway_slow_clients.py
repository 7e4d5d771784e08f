"""Slow clients and a trickling upstream against the gateway's bounds: each phase of a
request has one, and nothing slow holds an upstream connection or a key for longer.

The gateway is the real command with two upstream connections and bounds of about a second
(set through the environment, as a deployment would); the upstream is a bare socket whose
routes stall, stream without end, or trickle as each test scripts."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import socket
import threading
import time
from collections.abc import Iterable

import httpx
import orjson
import pytest

from idempotency_asgi.problems import TYPE_PREFIX
from tests.gateway_support import GatewayProcess, Received, status_of
from tests.helpers import assert_problem, eventually, headers, key_row, new_key

pytestmark = pytest.mark.slow

BOUND = 1.0  # the header, body and send timeouts
LEASE = 2.0
EXCHANGE = 3.0

ENV = {
    "IDEMPOTENCY_GATEWAY_MAX_CONNECTIONS": "2",
    "IDEMPOTENCY_GATEWAY_HEADER_TIMEOUT": str(BOUND),
    "IDEMPOTENCY_GATEWAY_IDLE_TIMEOUT": "1",
    "IDEMPOTENCY_GATEWAY_BODY_TIMEOUT": str(BOUND),
    "IDEMPOTENCY_GATEWAY_SEND_TIMEOUT": str(BOUND),
    "IDEMPOTENCY_GATEWAY_CLIENT_TIMEOUT": "1",
    "IDEMPOTENCY_GATEWAY_UPSTREAM_TIMEOUT": "2",
    "IDEMPOTENCY_GATEWAY_EXCHANGE_TIMEOUT": str(EXCHANGE),
    "IDEMPOTENCY_LEASE_SECONDS": str(LEASE),
    # The endless download: held in memory and a 1 MiB file, then read at the client's pace.
    "IDEMPOTENCY_GATEWAY_RESPONSE_SPOOL_BYTES": str(1024 * 1024),
}


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    scripted_upstream.routes[b"/endless"] = endless
    return scripted_upstream


def endless(conn: socket.socket, request: Received) -> bool:
    """A download larger than every buffer on the way: 1 MiB at a time until it breaks."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 40))
    chunk = b"d" * (1 << 20)
    while True:
        conn.sendall(chunk)


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(upstream.url, schema, "--tenant-header", "x-tenant")
    process.start(env=ENV)
    yield process
    process.stop()


def connect(gateway: GatewayProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, patience: float) -> tuple[bytes, float]:
    """Everything the gateway sends until it closes, and how long that took; fails the test
    if it is still open after `patience` seconds."""
    started = time.monotonic()
    sock.settimeout(patience)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        raise AssertionError(f"still open after {patience} s") from None
    except ConnectionResetError:
        pass
    return b"".join(chunks), time.monotonic() - started


def read_while_trickling(
    sock: socket.socket, pieces: Iterable[bytes], patience: float
) -> tuple[bytes, float]:
    """`read_until_closed`, while a thread sends `pieces` on the socket, one every 0.2 s."""
    stop = threading.Event()

    def trickle() -> None:
        for piece in pieces:
            if stop.wait(0.2):
                return
            with contextlib.suppress(OSError):
                sock.send(piece)

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        return read_until_closed(sock, patience)
    finally:
        stop.set()
        sender.join()


def problem_name(response: bytes) -> str:
    body = response.partition(b"\r\n\r\n")[2]
    name: str = orjson.loads(body)["type"].removeprefix(TYPE_PREFIX)
    return name


async def test_slow_uploads_take_no_upstream_connection(gateway, upstream):
    """Twenty clients send a request head and one byte of a 1000-byte body, then nothing.
    Their bodies wait in the gateway's buffer, not on an upstream connection: every other
    request still gets through, and at the body timeout each of them gets 408 and is closed."""
    stalled = []
    for _ in range(20):
        sock = connect(gateway)
        sock.sendall(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\nx")
        stalled.append(sock)
    try:
        await asyncio.sleep(0.3)  # all of them are in
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            started = time.monotonic()
            response = await http.get("/echo")
            waited = time.monotonic() - started
        assert response.status_code == 200, response.text
        assert waited < BOUND  # not after the stalled ones were let go
        for sock in stalled:
            answer, _ = read_until_closed(sock, patience=BOUND + 3)
            assert status_of(answer) == 408
            assert problem_name(answer) == "request-body-timeout"
    finally:
        for sock in stalled:
            sock.close()
    assert upstream.count(b"/upload") == 0


async def test_clients_that_do_not_read_their_download_are_let_go(gateway, upstream):
    """Four clients start an endless download and never read it. With two upstream
    connections, a client that reads would wait for ever; past the send timeout the gateway
    lets them go and frees the connections."""
    stuck = []
    for _ in range(4):
        sock = connect(gateway)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /endless HTTP/1.1\r\nHost: a\r\n\r\n")
        stuck.append(sock)
    try:
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=15) as http:
            response = await http.get("/echo")
        assert response.status_code == 200, response.text
    finally:
        for sock in stuck:
            sock.close()


def test_a_head_trickled_byte_by_byte_gets_408_at_the_header_timeout(gateway):
    sock = connect(gateway)
    with sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: a\r\n")
        trickled = (bytes([byte]) for byte in b"X-Slow: " + b"y" * 40)
        answer, took = read_while_trickling(sock, trickled, patience=BOUND + 3)
    assert status_of(answer) == 408
    assert problem_name(answer) == "header-timeout"
    assert took < BOUND + 1


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(gateway):
    with connect(gateway) as sock:
        answer, took = read_until_closed(sock, patience=BOUND + 3)
    assert answer == b""  # nothing was asked: nothing to answer
    assert took < BOUND + 1


def test_a_keep_alive_connection_is_closed_when_idle(gateway):
    with connect(gateway) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: a\r\n\r\n")
        answer, took = read_until_closed(sock, patience=3 + 3)
    assert status_of(answer) == 200
    assert answer.count(b"HTTP/1.1 ") == 1
    assert took < 1 + 1  # IDEMPOTENCY_GATEWAY_IDLE_TIMEOUT


async def test_a_stalled_keyed_upload_gets_408_and_reserves_nothing(gateway, db, tenant):
    key = new_key()
    sock = connect(gateway)
    with sock:
        sock.sendall(
            b"POST /orders HTTP/1.1\r\nHost: a\r\nX-Tenant: " + tenant.encode() + b"\r\n"
            b"Idempotency-Key: " + key.encode() + b"\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"sku":'
        )
        answer, took = await asyncio.to_thread(read_until_closed, sock, BOUND + 3)
    assert status_of(answer) == 408
    assert problem_name(answer) == "request-body-timeout"
    assert took < BOUND + 1
    assert await key_row(db, tenant, key) is None


async def test_a_trickling_upstream_gets_the_exchange_deadline_and_the_key_its_lease(
    gateway, upstream, db, tenant
):
    """The upstream sends a byte every 0.3 s, never silent long enough for the upstream
    timeout. Past the exchange deadline the gateway gives up on it: the connection is
    closed, and the key, no longer renewed, is left to its lease (its outcome is unknown)."""
    stopped = threading.Event()

    def trickling(conn: socket.socket, request: Received) -> bool:
        conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n")
        try:
            for _ in range(100):
                time.sleep(0.3)
                conn.sendall(b"t")
        except OSError:
            stopped.set()
        return False

    upstream.routes[b"/trickle"] = trickling
    key = new_key()
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        first = await http.post("/trickle", json={}, headers=headers(tenant, key))
    assert_problem(first, 504, "upstream-still-running")
    assert await asyncio.to_thread(stopped.wait, EXCHANGE + 5)
    assert time.monotonic() - started < EXCHANGE + 2

    async def lease_lapsed() -> bool:
        row = await db.fetchrow(
            "SELECT state, greatest(k.lease_expires_at, l.lease_expires_at) <= now() AS lapsed "
            "FROM idempotency_keys AS k LEFT JOIN idempotency_leases AS l "
            "USING (tenant_id, idempotency_key) WHERE tenant_id = $1 AND idempotency_key = $2",
            tenant,
            key,
        )
        return row is not None and row["state"] == "in_flight" and row["lapsed"]

    await eventually(lease_lapsed, timeout=LEASE + 3)
    assert (await key_row(db, tenant, key))["response_body"] is None


def test_a_request_pipelined_behind_a_slow_answer_is_not_timed_as_a_head(gateway, upstream):
    """The first answer streams for about twice the header timeout; the second request is sent
    whole while it does. It is a request waiting its turn, not a head arriving slowly: both
    are answered, and nothing is written inside the first answer."""

    def slow(conn: socket.socket, request: Received) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n")
        for part in (b"sl", b"o", b"w"):
            time.sleep(BOUND * 0.6)  # each within the client timeout
            conn.sendall(part)
        return True

    upstream.routes[b"/slow-answer"] = slow
    with connect(gateway) as sock:
        sock.sendall(b"GET /slow-answer HTTP/1.1\r\nHost: a\r\n\r\n")
        first = sock.recv(65536)  # the answer has begun: the next request comes in its midst
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        rest, _ = read_until_closed(sock, patience=BOUND * 2 + 5)
    answer = first + rest
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 2, answer
    assert b"slow" in answer and b"408" not in answer.split(b"\r\n")[0]
    assert b"header-timeout" not in answer


@pytest.mark.parametrize(
    "head",
    [
        b"POST /orders HTTP/1.1\r\nHost: a\r\nX-Tenant: t\r\nIdempotency-Key: not a key\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n1\r\n{",
        b"POST /orders HTTP/1.1\r\nHost: a\r\nX-Tenant: t\r\nIdempotency-Key: k\r\n"
        b"Content-Length: 10000000000\r\n\r\n{",
    ],
    ids=["invalid-key", "too-large"],
)
def test_an_answer_before_the_body_is_whole_closes_the_connection(gateway, head):
    """Refused before its body was read (a bad key: 400; a body past the limit: 413), while
    the client goes on trickling that body, a byte every 0.2 s, faster than every bound.
    The answer says `Connection: close`, and the connection ends: the rest of the body is
    neither read as another request nor read at all."""
    with connect(gateway) as sock:
        sock.sendall(head)
        more_body = itertools.repeat(b"1\r\nx\r\n" if b"chunked" in head else b"x")
        answer, _ = read_while_trickling(sock, more_body, patience=BOUND + 4)
    assert status_of(answer) in (400, 413), answer
    assert b"connection: close" in answer.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert answer.count(b"HTTP/1.1 ") == 1


def test_a_head_whose_end_straddles_two_reads_is_counted_to_its_end(gateway, upstream):
    """The empty line that ends the head comes split, `\\r\\n\\r` in one read and `\\n` with
    60 KiB of body in the next: only the head counts against `max_header_bytes` (32 KiB),
    so the request is forwarded, not refused with 431."""
    body = b"b" * 60_000
    with connect(gateway) as sock:
        sock.sendall(
            b"PUT /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r" % len(body)
        )
        time.sleep(0.3)  # its own read
        sock.sendall(b"\n" + body)
        answer, _ = read_until_closed(sock, patience=10)
    assert status_of(answer) == 200, answer[:300]
    assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["body_bytes"] == len(body)


@pytest.mark.skipif(
    importlib.util.find_spec("httptools") is None,
    reason="httptools is not installed (the gateway command uses it when it is)",
)
def test_under_httptools_a_head_pipelined_behind_an_answer_is_bounded_too(gateway, upstream):
    """While an answer streams, the client pipelines a head that never ends. uvicorn's
    httptools protocol goes on reading it (h11 holds it until its turn): it is counted all
    the same, and past `max_header_bytes` the connection closes, so the head cannot grow
    without bound in memory."""

    def slow(conn: socket.socket, request: Received) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n")
        for part in (b"s", b"l", b"w"):
            time.sleep(BOUND * 0.6)
            with contextlib.suppress(OSError):
                conn.sendall(part)
        return True

    upstream.routes[b"/slower-answer"] = slow
    endless = b"y" * (1 << 20)
    with connect(gateway) as sock:
        sock.sendall(b"GET /slower-answer HTTP/1.1\r\nHost: a\r\n\r\n")
        sock.recv(65536)  # the answer has begun
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: a\r\nX-Endless: ")
        sock.settimeout(BOUND)
        taken = 0
        with contextlib.suppress(OSError):  # reset, or stalled: the server stopped reading
            while taken < (64 << 20):
                taken += sock.send(endless)
        with contextlib.suppress(OSError):
            read_until_closed(sock, patience=BOUND * 3 + 5)
    # What the kernels' buffers hold (about 2 MiB here), not what an unbounded head takes.
    assert taken < (16 << 20), f"the server read {taken} bytes of an endless head"
