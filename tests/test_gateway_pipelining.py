"""Requests a client pipelines behind a keyed POST still being answered: under httptools,
uvicorn parses every one of them at once (h11 holds them until their turn). None may be
answered in place of the POST, and none may multiply the memory a connection holds. The
gateway is the real command, run directly; the upstream a bare socket that answers the POST
only when the test has sent everything."""

from __future__ import annotations

import asyncio
import socket
import threading

import orjson
import pytest

from tests.gateway_support import GatewayProcess, Received, answer, memory_kib, status_of
from tests.helpers import key_row, new_key

#: Only a guard against hanging: each exchange takes milliseconds.
PATIENCE = 15.0


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(request, upstream, schema):
    process = GatewayProcess(
        upstream.url, schema, "--tenant-header", "x-tenant", "--http", request.param
    ).start()
    yield process
    process.stop()


def held_order(release: threading.Event):
    """201 for a POST, once `release` is set (a slow upstream, on the test's word)."""

    def route(conn: socket.socket, request: Received) -> bool:
        release.wait(PATIENCE)
        conn.sendall(answer(201, [(b"Content-Type", b"application/json")], b'{"id":"o-1"}'))
        return True

    return route


def keyed_post(tenant: str, key: str, path: bytes) -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: a\r\nX-Tenant: " + tenant.encode() + b"\r\n"
        b"Idempotency-Key: " + key.encode() + b"\r\nContent-Length: 2\r\n\r\n{}"
    )


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in `data`, all framed by Content-Length."""
    found = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        length = int({k.lower(): v for k, v in fields.items()}.get(b"content-length", b"0"))
        found.append((status_of(head), rest[:length]))
        data = rest[length:]
    return found


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(PATIENCE)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


@pytest.mark.parametrize("gateway", ["h11", "httptools"], indirect=True)
async def test_a_refused_pipelined_request_never_takes_the_place_of_an_owed_answer(
    gateway, upstream, db, tenant
):
    """A keyed POST, and behind it, while the upstream holds the POST, a GET whose head is
    past `max_header_bytes`. The POST runs; its answer is the first on the wire, whole, and
    only then comes the refusal of the GET (a 4xx problem), and the connection closes.
    (Under httptools the 431 used to go out at once, read by the client as the POST's
    answer: "nothing was forwarded", while the order was made and recorded.)"""
    release = threading.Event()
    path = b"/held-" + new_key().encode()
    upstream.routes[path] = held_order(release)
    key = new_key()
    huge = b"GET /echo HTTP/1.1\r\nHost: a\r\nX-Large: " + b"v" * (40 * 1024) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=PATIENCE) as sock:
        sock.sendall(keyed_post(tenant, key, path))
        await asyncio.sleep(0.3)  # the POST is upstream, held there
        sock.sendall(huge)
        await asyncio.sleep(0.5)  # whatever the gateway answers early, it has answered by now
        release.set()
        got = read_all(sock)
    answers = responses(got)
    assert answers[0] == (201, b'{"id":"o-1"}'), got[:300]
    assert [status for status, _ in answers[1:]] in ([], [400], [431]), got[:600]
    row = await key_row(db, tenant, key)
    assert (row["state"], row["response_status"]) == ("completed", 201)
    assert upstream.count(path) == 1


@pytest.mark.parametrize("gateway", ["h11", "httptools"], indirect=True)
def test_requests_pipelined_behind_a_keyed_post_are_answered_in_turn(gateway, upstream, tenant):
    release = threading.Event()
    path = b"/held-" + new_key().encode()
    upstream.routes[path] = held_order(release)
    gets = b"".join(b"GET /echo?n=%d HTTP/1.1\r\nHost: a\r\n\r\n" % n for n in range(3))
    last = b"GET /echo?n=3 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=PATIENCE) as sock:
        sock.sendall(keyed_post(tenant, new_key(), path) + gets + last)
        release.set()
        answers = responses(read_all(sock))
    assert [status for status, _ in answers] == [201, 200, 200, 200, 200]
    targets = [orjson.loads(body)["target"] for _, body in answers[1:]]
    assert targets == [f"/echo?n={n}" for n in range(4)]


@pytest.mark.parametrize("gateway", ["httptools"], indirect=True)
async def test_pipelined_heads_do_not_multiply_what_a_connection_holds(gateway, upstream, tenant):
    """Ten connections, each a keyed POST the upstream holds, then 256 KiB of small GETs
    pipelined behind it in one write. uvicorn's httptools protocol made a request of each
    (about 6,000 a connection, 13.5 MiB): now a connection parses a few beyond the request
    being answered, holds the rest as the bytes they are (or leaves them in the kernel), and
    closes after the owed answers."""
    release = threading.Event()
    path = b"/held-" + new_key().encode()
    upstream.routes[path] = held_order(release)
    gets = b"GET /echo HTTP/1.1\r\nHost: a\r\n\r\n" * (256 * 1024 // 32)
    before = memory_kib(gateway.pid)["VmRSS"]
    sockets = []
    try:
        for _ in range(10):
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=PATIENCE)
            sock.sendall(keyed_post(tenant, new_key(), path) + gets)
            sockets.append(sock)
        await asyncio.sleep(1.0)  # every connection has sent all it will, and the gateway read it
        grown = memory_kib(gateway.pid)["VmRSS"] - before
        release.set()
        answered = [responses(read_all(sock)) for sock in sockets]
    finally:
        release.set()
        for sock in sockets:
            sock.close()
    print(f"ten connections of pipelined heads: gateway VmRSS +{grown / 1024:.1f} MiB")
    assert grown < 20 * 1024, f"ten connections grew the gateway by {grown} KiB"
    for each in answered:
        assert each[0] == (201, b'{"id":"o-1"}')
        assert {status for status, _ in each[1:]} <= {200}


@pytest.mark.parametrize("between", [0, 1], ids=["alone", "behind-a-get"])
@pytest.mark.parametrize("gateway", ["h11", "httptools"], indirect=True)
async def test_a_malformed_pipelined_body_is_refused_after_the_owed_answer(
    gateway, upstream, db, tenant, between
):
    """One write: a keyed POST, whole, (maybe a GET,) and behind it a chunked POST whose first
    chunk size is not hexadecimal. The parser refuses the last while the first is still
    upstream: its 400 comes after the answers owed before it, never in their place. (Under
    httptools the 400 went out at once, and the client read it as the keyed POST's answer,
    which ran and was recorded all the same.)"""
    release = threading.Event()
    path = b"/held-" + new_key().encode()
    upstream.routes[path] = held_order(release)
    key = new_key()
    first = (
        b"POST " + path + b" HTTP/1.1\r\nHost: a\r\nX-Tenant: " + tenant.encode() + b"\r\n"
        b"Idempotency-Key: " + key.encode() + b"\r\nContent-Length: 1\r\n\r\nx"
    )
    get = b"GET /echo?between HTTP/1.1\r\nHost: a\r\n\r\n" * between
    last = b"POST /b HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=PATIENCE) as sock:
        sock.sendall(first + get + last)
        await asyncio.sleep(0.5)  # whatever the gateway answers early, it has answered by now
        release.set()
        got = read_all(sock)
    answers = responses(got)
    assert [status for status, _ in answers] == [201] + [200] * between + [400], got[:600]
    assert answers[0] == (201, b'{"id":"o-1"}')
    if between:
        assert orjson.loads(answers[1][1])["target"] == "/echo?between"
    assert orjson.loads(answers[-1][1])["type"].endswith(":malformed-request")
    row = await key_row(db, tenant, key)
    assert (row["state"], row["response_status"]) == ("completed", 201)
    assert upstream.count(path) == 1
    assert upstream.count(b"/b") == 0


@pytest.mark.parametrize("gateway", ["h11", "httptools"], indirect=True)
@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
async def test_a_malformed_body_is_refused_at_once(gateway, upstream, db, tenant, keyed):
    """A chunked POST whose first chunk size is not hexadecimal gets 400 `malformed-request`
    as soon as it is read, and nothing reaches the upstream. (Under h11 the parser's error
    was not taken for a body still unread: the refusal waited for an answer that came only
    at `body_timeout`, a 408.)"""
    key = new_key()
    path = b"/malformed-" + key.encode()
    head = b"POST " + path + b" HTTP/1.1\r\nHost: a\r\nX-Tenant: " + tenant.encode() + b"\r\n"
    if keyed:
        head += b"Idempotency-Key: " + key.encode() + b"\r\n"
    started = asyncio.get_running_loop().time()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=PATIENCE) as sock:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
        got = read_all(sock)
    took = asyncio.get_running_loop().time() - started
    answers = responses(got)
    assert [status for status, _ in answers] == [400], got[:600]
    assert orjson.loads(answers[0][1])["type"].endswith(":malformed-request")
    assert took < 3.0, f"refused after {took:.1f} s"
    assert upstream.count(path) == 0
    assert await key_row(db, tenant, key) is None
