"""An HTTP/1.0 client cannot read a chunked body (chunks are HTTP/1.1's). uvicorn's httptools
writer chunks every answer without a Content-Length, whatever the client speaks: the gateway
holds such an answer until it is whole and sends it with its length, first run and replay
alike. The gateway is the real command, run directly, on each parser; the upstream a bare
socket answering in chunks."""

from __future__ import annotations

import socket

import orjson
import pytest

from idempotency_asgi.problems import TYPE_PREFIX
from tests.gateway_support import GatewayProcess, Received, raw_request, status_of
from tests.helpers import key_row, new_key

pytestmark = pytest.mark.parametrize("gateway", ["h11", "httptools"], indirect=True)

BODY = b'{"id":"o-1","note":"' + b"n" * 3000 + b'"}'

#: Past the gateway's bound on an answer's temporary file (`--response-spool-bytes`, below).
SPOOL_BYTES = 64 * 1024
LARGE = b"L" * (SPOOL_BYTES + 1)


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

    def large(conn: socket.socket, request: Received) -> bool:
        conn.sendall(
            b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%b\r\n" % (len(LARGE), LARGE)
            + b"0\r\n\r\n"
        )
        return True

    scripted_upstream.routes[b"/chunked"] = chunked
    scripted_upstream.routes[b"/large"] = large
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(request, upstream, schema):
    process = GatewayProcess(
        upstream.url,
        schema,
        "--tenant-header",
        "x-tenant",
        "--http",
        request.param,
        # An answer held for an HTTP/1.0 client goes to a file past 1 KiB (BODY does).
        "--response-buffer-bytes",
        "1024",
        "--response-spool-bytes",
        str(SPOOL_BYTES),
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


async def test_an_answer_held_for_an_http10_client_is_bounded_by_the_spool(
    gateway, upstream, db, tenant
):
    """The answer held until it is whole, for an HTTP/1.0 client, takes no more disk than
    `--response-spool-bytes` (it held up to 1 GiB whatever that said): one byte past it,
    nothing more is held, and the client gets a 502 problem saying so (not uvicorn's plain
    500). A keyed one ran once and is recorded all the same: its replay reaches an HTTP/1.1
    client whole."""
    key = new_key()
    keyed = (
        b"POST /large HTTP/1.0\r\nHost: a\r\nX-Tenant: " + tenant.encode() + b"\r\n"
        b"Idempotency-Key: " + key.encode() + b"\r\nContent-Length: 2\r\n\r\n{}"
    )
    before = upstream.count(b"/large")
    unkeyed = raw_request(gateway.url, b"GET /large HTTP/1.0\r\nHost: a\r\n\r\n")
    first = raw_request(gateway.url, keyed)
    eleven = raw_request(
        gateway.url, b"GET /large HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    )
    replay = raw_request(gateway.url, keyed.replace(b"HTTP/1.0", b"HTTP/1.1", 1))
    for refused in (unkeyed, first):
        assert status_of(refused) == 502, refused[:300]
        problem = orjson.loads(refused.partition(b"\r\n\r\n")[2])
        assert problem["type"] == TYPE_PREFIX + "answer-too-large-for-http10"
        assert (problem["upstream_status"], problem["limit"]) == (201, SPOOL_BYTES)
        assert b"L" * 1024 not in refused
    assert status_of(eleven) == 201 and eleven.endswith(b"0\r\n\r\n")
    assert status_of(replay) == 201 and LARGE in replay and replay.endswith(b"0\r\n\r\n")
    assert b"idempotent-replayed: true" in replay.lower()
    row = await key_row(db, tenant, key)
    assert (row["state"], row["response_status"]) == ("completed", 201)
    assert upstream.count(b"/large") == before + 3
