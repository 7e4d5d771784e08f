"""Answers whose framing is unusual, from an upstream of the test's own on a bare socket: a
body that ends where the connection does, a body framed twice. Each reaches the client whole
or not at all, and is recorded only when it is unambiguous. The gateway is the real command,
run directly (no nginx in front), on each of uvicorn's two parsers."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.gateway_support import GatewayProcess, Received, wait_until_delivered, writes
from tests.helpers import assert_problem, headers, key_row, new_key

pytestmark = pytest.mark.parametrize("gateway", ["h11", "httptools"], indirect=True)


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


async def test_an_answer_that_ends_at_the_close_arrives_whole(gateway, upstream, db, tenant):
    """No Content-Length, no chunks: the body ends where the connection does. The client gets
    all of it, framed so that it knows it is whole; the key is recorded as done (the request
    ran) without a body to replay, since an end at a close looks the same as a crash."""

    def ends_at_close(conn: socket.socket, request: Received) -> bool:
        conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\n\r\nall of it")
        wait_until_delivered(conn)
        conn.close()
        return False

    upstream.routes[b"/ends-at-close"] = ends_at_close
    key = new_key()
    before = upstream.count(b"/ends-at-close")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        passing = await http.get("/ends-at-close")
        first = await http.post("/ends-at-close", content=b"x", headers=headers(tenant, key))
        retry = await http.post("/ends-at-close", content=b"x", headers=headers(tenant, key))
    assert (passing.status_code, passing.content) == (201, b"all of it")
    assert (first.status_code, first.content) == (201, b"all of it")
    body = assert_problem(retry, 409, "response-not-replayable")
    assert body["original_status"] == 201
    row = await key_row(db, tenant, key)
    assert (row["state"], row["response_status"], row["response_body"]) == ("completed", 201, None)
    assert upstream.count(b"/ends-at-close") == before + 2  # the GET, the first POST: once each


async def test_an_answer_framed_twice_is_refused_and_never_recorded(gateway, upstream, db, tenant):
    """`Content-Length` and `Transfer-Encoding` together: where the body ends depends on who
    reads it, a response split in two maybe (RFC 9112, section 6.3). As nginx does, the
    client gets 502; the request ran, so its key is settled by the status (201: recorded as
    done, without a body), and a retry runs nothing."""
    upstream.routes[b"/framed-twice"] = writes(
        b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    key = new_key()
    before = upstream.count(b"/framed-twice")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        passing = await http.get("/framed-twice")
        first = await http.post("/framed-twice", content=b"x", headers=headers(tenant, key))
        retry = await http.post("/framed-twice", content=b"x", headers=headers(tenant, key))
    assert_problem(passing, 502, "upstream-answer-invalid")
    body = assert_problem(first, 502, "upstream-answer-invalid")
    assert "both Content-Length and Transfer-Encoding" in body["detail"]
    assert body["upstream_status"] == 201
    assert assert_problem(retry, 409, "response-not-replayable")["original_status"] == 201
    row = await key_row(db, tenant, key)
    assert (row["state"], row["response_status"], row["response_body"]) == ("completed", 201, None)
    assert upstream.count(b"/framed-twice") == before + 2


@pytest.mark.parametrize("status", [204, 304])
async def test_a_bodiless_status_that_declares_a_length_is_never_recorded(
    gateway, upstream, db, tenant, status
):
    """A 204 or 304 cannot have a body; one that declares `Content-Length: 5` says otherwise.
    Passed on (a GET) without the length, which uvicorn's httptools writer would wait for;
    keyed, its length is unlike its body, and it is not recorded (504 outcome-unknown)."""
    path = b"/bodiless-%d" % status
    upstream.routes[path] = writes(b"HTTP/1.1 %d Nothing\r\nContent-Length: 5\r\n\r\n" % status)
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        passing = await http.get(path.decode())
        first = await http.post(path.decode(), content=b"x", headers=headers(tenant, key))
    assert passing.status_code == status
    assert "content-length" not in passing.headers
    assert_problem(first, 504, "outcome-unknown")
    row = await key_row(db, tenant, key)
    assert (row["state"], row["response_body"]) == ("in_flight", None)
