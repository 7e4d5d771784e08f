"""Answers whose framing is unusual, from an upstream of the test's own on a bare socket: a
body that ends where the connection does, a body framed twice. Each reaches the client whole
or not at all, and is recorded only when it is unambiguous. The gateway is the real command,
run directly (no nginx in front), on each of uvicorn's two parsers."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.gateway_support import GatewayProcess, Received, wait_until_delivered
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


def sent(upstream, path: bytes) -> int:
    return len([r for r in upstream.requests if r.target == path])


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
    before = sent(upstream, b"/ends-at-close")
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
    assert sent(upstream, b"/ends-at-close") == before + 2  # the GET, the first POST: once each
