"""An HTTP/1.0 client cannot read a chunked body (chunks are HTTP/1.1's). uvicorn's httptools
writer chunks every answer without a Content-Length, whatever the client speaks: the gateway
holds such an answer until it is whole and sends it with its length, first run and replay
alike. The gateway is the real command, run directly, on each parser; the upstream a bare
socket answering in chunks."""

from __future__ import annotations

import socket

import pytest

from tests.gateway_support import GatewayProcess, Received, raw_request, status_of
from tests.helpers import new_key

pytestmark = pytest.mark.parametrize("gateway", ["h11", "httptools"], indirect=True)

BODY = b'{"id":"o-1","note":"' + b"n" * 3000 + b'"}'


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    def chunked(conn: socket.socket, request: Received) -> bool:
        parts = [BODY[:1000], BODY[1000:]]
        conn.sendall(
            b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%b\r\n" % (len(part), part) for part in parts)
            + b"0\r\n\r\n"
        )
        return True

    scripted_upstream.routes[b"/chunked"] = chunked
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(request, upstream, schema):
    process = GatewayProcess(
        upstream.url, schema, "--tenant-header", "x-tenant", "--http", request.param
    ).start()
    yield process
    process.stop()


def http10(gateway: GatewayProcess, head: bytes, body: bytes = b"") -> tuple[dict, bytes]:
    """One HTTP/1.0 exchange: the answer's fields (lowercased names) and its body as read
    by an HTTP/1.0 client: everything after the head, to the close."""
    answer = raw_request(gateway.url, head + b"\r\n\r\n" + body)
    top, _, rest = answer.partition(b"\r\n\r\n")
    assert status_of(answer) == 201, answer[:300]
    fields = dict(line.split(b": ", 1) for line in top.split(b"\r\n")[1:])
    return {name.lower(): value for name, value in fields.items()}, rest


def test_an_answer_in_chunks_reaches_an_http10_client_with_its_length(gateway, tenant):
    fields, body = http10(gateway, b"GET /chunked HTTP/1.0\r\nHost: a")
    assert b"transfer-encoding" not in fields
    assert fields[b"content-length"] == b"%d" % len(BODY)
    assert body == BODY


def test_a_keyed_answer_and_its_replay_reach_an_http10_client_whole(gateway, tenant):
    request = (
        b"POST /chunked HTTP/1.0\r\nHost: a\r\nX-Tenant: " + tenant.encode() + b"\r\n"
        b"Idempotency-Key: " + new_key().encode() + b"\r\nContent-Length: 2"
    )
    for replayed in (False, True):
        fields, body = http10(gateway, request, b"{}")
        assert (b"idempotent-replayed" in fields) is replayed
        assert b"transfer-encoding" not in fields
        assert fields[b"content-length"] == b"%d" % len(BODY)
        assert body == BODY
