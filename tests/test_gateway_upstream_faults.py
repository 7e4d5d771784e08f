"""An upstream that sends what it should not: bytes after a whole response (a body on a HEAD,
a 204 or a 304, more than its Content-Length, a second response in the same write). None of it
may become another request's answer, and none of it is recorded (test_gateway_framing.py has
the answers framed oddly: at a close, twice). The gateway is the real command with one
upstream connection, so that every request reuses the one the bad answer came on; the
upstream is a bare socket that writes each answer exactly as scripted."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest

from idempotency_asgi.gateway import build_gateway
from tests.gateway_support import GatewayProcess, Received, writes
from tests.helpers import assert_problem, client, headers, key_row, new_key

#: A whole response of its own: what another client would get if these bytes were read as
#: the answer to its request.
FORGED = (
    b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 24\r\n\r\n"
    b'{"order":"someone-else"}'
)

BAD_ANSWERS = {
    # HEAD: the body is not the response's (RFC 9110 section 9.3.2).
    "head-with-body": (
        b"HEAD",
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(FORGED) + FORGED,
    ),
    "204-with-body": (b"GET", b"HTTP/1.1 204 No Content\r\n\r\n" + FORGED),
    "304-with-body": (b"GET", b'HTTP/1.1 304 Not Modified\r\nETag: "e"\r\n\r\n' + FORGED),
    "short-content-length": (b"GET", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokay, more"),
    "two-responses": (b"GET", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + FORGED),
}


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    for name, (_, answer) in BAD_ANSWERS.items():
        scripted_upstream.routes[b"/" + name.encode()] = writes(answer)
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(
        upstream.url, schema, "--tenant-header", "x-tenant", "--max-connections", "1"
    ).start()
    yield process
    process.stop()


@pytest.fixture
def fresh_gateway(upstream, schema):
    """A gateway of the test's own: its one upstream connection carries nothing left over
    from another test."""
    process = GatewayProcess(
        upstream.url, schema, "--tenant-header", "x-tenant", "--max-connections", "1"
    ).start()
    yield process
    process.stop()


async def sent_twice(
    gateway: GatewayProcess, path: str, sent: dict[str, str], **request: Any
) -> tuple[httpx.Response, httpx.Response]:
    """The same keyed POST, twice in a row (the body `x` unless `request` says otherwise)."""
    request = request or {"content": b"x"}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        first = await http.post(path, headers=sent, **request)
        again = await http.post(path, headers=sent, **request)
    return first, again


@pytest.mark.parametrize("bad", sorted(BAD_ANSWERS))
async def test_bytes_after_an_answer_never_become_the_next_requests_answer(
    gateway, upstream, db, tenant, bad
):
    method, _ = BAD_ANSWERS[bad]
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        await http.request(method.decode(), "/" + bad)  # whatever it gets, it is not ours
        mine = await http.post("/echo", json={"n": 1}, headers=headers(tenant, key))
        replay = await http.post("/echo", json={"n": 1}, headers=headers(tenant, key))
    # The keyed POST got the upstream's answer to it, not the leftover of someone else's.
    assert mine.status_code == 200, mine.content
    assert mine.json()["method"] == "POST"
    assert [v for n, v in mine.json()["headers"] if n == "idempotency-key"] == [key]
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == mine.content
    assert (await key_row(db, tenant, key))["response_body"] == mine.content


@pytest.mark.parametrize("bad", ["short-content-length", "two-responses"])
async def test_a_keyed_answer_followed_by_stray_bytes_is_never_recorded(
    fresh_gateway, upstream, db, tenant, bad
):
    """Its outcome is unknown: the answer may not be this request's at all. The key is left
    to its lease (a retry meanwhile gets 409), as for an upstream that never answered."""
    key = new_key()
    first, retry = await sent_twice(fresh_gateway, "/" + bad, headers(tenant, key), json={"n": 1})
    assert_problem(first, 504, "outcome-unknown")
    assert_problem(retry, 409, "request-in-progress")
    row = await key_row(db, tenant, key)
    assert row["state"] == "in_flight"
    assert row["response_body"] is None


async def test_an_answer_unlike_its_content_length_is_never_recorded(schema, db, tenant):
    """A transport of one's own hands over a body of 3 bytes under `Content-Length: 10`: the
    client is not told it succeeded, and nothing is stored to replay."""

    async def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(201, headers={"content-length": "10"}, content=b"abc")

    app = build_gateway(
        "http://up:9000",
        store=schema,
        tenant=lambda scope: tenant,
        transport=httpx.MockTransport(upstream),
    )
    key = new_key()
    async with client(app) as http:
        response = await http.post("/orders", content=b"{}", headers={"idempotency-key": key})
    assert_problem(response, 504, "outcome-unknown")
    assert (await key_row(db, tenant, key))["state"] == "in_flight"


async def test_a_keyed_answer_that_ends_at_a_close_is_passed_on_and_never_replayed(
    gateway, upstream, db, tenant
):
    """No `Content-Length`, no chunks: the body ends where the connection does, and a crash
    half way through it looks the same. The client gets what came; the key is recorded as
    done (the request ran), but without a body to replay: the retry gets 409
    `response-not-replayable`, never the part as if it were the whole."""

    def ends_at_close(conn: socket.socket, request: Received) -> bool:
        conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\n\r\nhalf an ans")
        conn.close()
        return False

    upstream.routes[b"/ends-at-close"] = ends_at_close
    key = new_key()
    first, retry = await sent_twice(gateway, "/ends-at-close", headers(tenant, key))
    assert (first.status_code, first.content) == (201, b"half an ans")
    body = assert_problem(retry, 409, "response-not-replayable")
    assert body["original_status"] == 201
    row = await key_row(db, tenant, key)
    assert row["state"] == "completed"
    assert row["response_body"] is None
    assert upstream.count(b"/ends-at-close") == 1


async def test_an_answer_head_past_its_bound_is_refused_even_in_one_read(
    gateway, upstream, db, tenant
):
    """A 100 KiB answer head (a header reflected from user data), written at once: it is
    past the 64 KiB bound however it arrives. (The bound was looked at only while no end of
    the head had been read: a head that came whole in a read or two was taken, whatever its
    size.) Unkeyed, 502; keyed, the upstream ran and the key is held (504), never released."""
    path = b"/big-head-" + new_key().encode()
    upstream.routes[path] = writes(
        b"HTTP/1.1 201 Created\r\nX-Big: " + b"v" * (100 * 1024) + b"\r\n"
        b"Content-Length: 2\r\n\r\nok"
    )
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        passing = await http.get(path.decode())
        first = await http.post(path.decode(), content=b"x", headers=headers(tenant, key))
        retry = await http.post(path.decode(), content=b"x", headers=headers(tenant, key))
    assert_problem(passing, 502, "upstream-failed")
    assert_problem(first, 504, "outcome-unknown")
    assert_problem(retry, 409, "request-in-progress")
    assert (await key_row(db, tenant, key))["state"] == "in_flight"
    assert upstream.count(path) == 2  # the GET, one POST


async def test_an_answer_whose_temporary_file_fails_is_held_in_memory_and_recorded(
    scripted_upstream, schema, db, tenant, tmp_path
):
    """The upstream ran a keyed POST and sent its answer fast; the gateway holds what its
    client has not taken yet in a temporary file, and making that file fails (the disk is
    full, or out of descriptors: here, `$TMPDIR` is gone). The answer was read whole and is
    within the storage limit: it is held in memory instead, recorded, and replayed; the
    upstream runs it once. (It used to end as 504 `outcome-unknown`, the key held to its
    lease: after the lease a retry ran the order a second time; and before that the key was
    released at once.)"""
    body = bytes(range(256)) * (2 * 1024)  # 512 KiB, in one write
    path = b"/spooled-" + new_key().encode()
    scripted_upstream.routes[path] = writes(
        b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    gateway = GatewayProcess(
        scripted_upstream.url,
        schema,
        "--tenant-header",
        "x-tenant",
        "--request-buffer-bytes",
        "1024",
        "--response-buffer-bytes",
        "1",
        "--lease-seconds",
        "30",
    ).start(env={"TMPDIR": str(spool_dir)})
    key = new_key()
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=15) as http:
            # A body past the memory buffer: the worker's temporary directory is now this one.
            warm = await http.post("/echo", content=b"w" * 4096)
            assert warm.status_code == 200 and warm.json()["body_bytes"] == 4096
            spool_dir.rmdir()
            first = await http.post(path.decode(), content=b"x", headers=headers(tenant, key))
            retry = await http.post(path.decode(), content=b"x", headers=headers(tenant, key))
    finally:
        gateway.stop()
    assert (first.status_code, first.content) == (201, body)
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == body
    assert scripted_upstream.count(path) == 1
    row = await key_row(db, tenant, key)
    assert row["state"] == "completed"


async def test_a_request_body_the_gateway_cannot_spool_is_a_503_problem(
    scripted_upstream, schema, db, tenant, tmp_path
):
    """A body past the request buffer goes to a temporary file before anything is forwarded;
    when making that file fails (here `$TMPDIR` is gone), the client gets 503
    `gateway-storage-failed` (it was uvicorn's bare 500), nothing reaches the upstream, and a
    keyed request holds no key: its retry, once the disk is back, runs."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    gateway = GatewayProcess(
        scripted_upstream.url,
        schema,
        "--tenant-header",
        "x-tenant",
        "--request-buffer-bytes",
        "1024",
    ).start(env={"TMPDIR": str(spool_dir)})
    key = new_key()
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=15) as http:
            warm = await http.post("/echo", content=b"w" * 4096)
            assert warm.status_code == 200 and warm.json()["body_bytes"] == 4096
            before = scripted_upstream.count(b"/echo")
            spool_dir.rmdir()
            unkeyed = await http.post("/echo", content=b"u" * 4096)
            keyed = await http.post("/echo", content=b"k" * 4096, headers=headers(tenant, key))
            after = scripted_upstream.count(b"/echo")
            spool_dir.mkdir()
            retry = await http.post("/echo", content=b"k" * 4096, headers=headers(tenant, key))
    finally:
        gateway.stop()
    assert_problem(unkeyed, 503, "gateway-storage-failed")
    assert_problem(keyed, 503, "gateway-storage-failed")
    assert after == before
    assert retry.status_code == 200 and retry.json()["body_bytes"] == 4096
