"""Requests the gateway refuses before anything reaches the upstream: a body framed twice (a
request smuggled behind it must never arrive), a tenant header sent twice, `Connection`
naming a header the request is keyed by, a header section too large; and forwarding headers
a client claims. Raw sockets toward the real command on uvicorn's default parser (h11), and
the scripted upstream on a bare socket, whose log of every request it read is the audit."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import threading

import httpx
import orjson
import pytest

from idempotency_asgi.gateway import build_gateway, tenant_from_header
from idempotency_asgi.problems import TYPE_PREFIX
from tests.gateway_support import GatewayProcess, ScriptedUpstream, raw_request, status_of
from tests.helpers import key_row, new_key


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(upstream.url, schema, "--tenant-header", "x-tenant").start()
    yield process
    process.stop()


def problem_of(response: bytes) -> tuple[int, str, dict[bytes, bytes]]:
    """The status, the problem's type name and the headers of the one response in `response`."""
    head, _, body = response.partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    fields = {name.lower(): value for name, value in fields.items()}
    assert fields[b"content-type"] == b"application/problem+json", response
    document = orjson.loads(body[: int(fields[b"content-length"])])
    return status_of(response), document["type"].removeprefix(TYPE_PREFIX), fields


def targets(upstream: ScriptedUpstream) -> list[bytes]:
    return [request.target for request in upstream.requests]


def carrying(upstream: ScriptedUpstream, value: bytes) -> list[bytes]:
    """The targets of every request the upstream read with `value` in any header."""
    return [r.target for r in upstream.requests if any(value in v for _, v in r.headers)]


# -- 6: Content-Length together with Transfer-Encoding ---------------------------------------

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"


@pytest.mark.parametrize(
    "head",
    [
        # The gateway's own health path: 405 before, and then the smuggled request's answer.
        b"POST /_idempotency/health HTTP/1.1\r\nHost: a\r\n",
        # A keyed request without a tenant: 401 before.
        b"POST /orders HTTP/1.1\r\nHost: a\r\nIdempotency-Key: k-1\r\n",
        # A keyed request with a bad key: 400 before.
        b"POST /orders HTTP/1.1\r\nHost: a\r\nX-Tenant: t\r\nIdempotency-Key: a b\r\n",
        # A request that is forwarded: it reached the upstream with the client's length.
        b"POST /upload HTTP/1.1\r\nHost: a\r\n",
    ],
    ids=["health", "unauthenticated", "bad-key", "forwarded"],
)
def test_a_body_framed_twice_is_refused_and_nothing_behind_it_is_read(gateway, upstream, head):
    chunked = b"5\r\nhello\r\n0\r\n\r\n"
    request = (
        head
        + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(chunked + SMUGGLED)
        + chunked
        + SMUGGLED
    )
    before = len(upstream.requests)
    response = raw_request(gateway.url, request)  # until the gateway closes the connection
    status, name, fields = problem_of(response)
    # The gateway's refusal under h11; httptools refuses it while parsing, before the app.
    assert (status, name) in ((400, "ambiguous-framing"), (400, "malformed-request"))
    assert fields[b"connection"] == b"close"
    assert response.count(b"HTTP/1.1 ") == 1, response  # one answer: nothing else was read
    assert upstream.requests[before:] == []
    assert b"/smuggled" not in targets(upstream)


# -- 7: the tenant header twice ----------------------------------------------------------------


async def test_a_tenant_header_sent_twice_is_refused(gateway, upstream, db):
    """The layer in front appends its own X-Tenant; the client sent one first. Neither is
    taken: the request is refused, and no key is stored under either tenant."""
    key = new_key()
    claimed, real = "t-claimed-" + key[:8], "t-front-" + key[:8]
    response = raw_request(
        gateway.url,
        b"POST /echo HTTP/1.1\r\nHost: a\r\nX-Tenant: " + claimed.encode() + b"\r\n"
        b"X-Tenant: " + real.encode() + b"\r\nIdempotency-Key: " + key.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    status, name, _ = problem_of(response)
    assert (status, name) == (400, "repeated-header")
    assert carrying(upstream, key.encode()) == []
    assert await key_row(db, claimed, key) is None
    assert await key_row(db, real, key) is None


# -- 8: Connection naming what the request is keyed by -----------------------------------------


@pytest.mark.parametrize(
    "named",
    [
        b"authorization",
        b"idempotency-key",
        b"X-Tenant",
        # Part of the fingerprint (it says how to read the body): the upstream would get a
        # gzip body without it.
        b"Content-Encoding",
        # Part of the fingerprint too (below).
        b"X-HTTP-Method-Override",
    ],
)
async def test_connection_naming_a_header_the_request_is_keyed_by_is_refused(
    gateway, upstream, db, tenant, named
):
    key = new_key()
    response = raw_request(
        gateway.url,
        b"POST /echo HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer secret\r\n"
        b"X-Tenant: " + tenant.encode() + b"\r\nIdempotency-Key: " + key.encode() + b"\r\n"
        b"Connection: close, " + named + b"\r\n"
        b"Content-Encoding: identity\r\nX-HTTP-Method-Override: PUT\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    )
    status, name, _ = problem_of(response)
    assert (status, name) == (400, "connection-names-end-to-end-header")
    # Before, the upstream got the request without the header (and the key was recorded).
    assert carrying(upstream, key.encode()) == []
    assert carrying(upstream, tenant.encode()) == []
    assert await key_row(db, tenant, key) is None


@pytest.mark.parametrize(
    "override", [b"X-HTTP-Method-Override", b"X-HTTP-Method", b"X-Method-Override"]
)
async def test_a_method_override_is_part_of_the_request_a_key_stands_for(
    gateway, upstream, db, tenant, override
):
    """A POST that says DELETE, then the same key on a POST that says PUT: two requests the
    upstream runs differently, so the second is refused (422 key-reused), not answered with
    the DELETE's answer."""
    key = new_key()
    sent = []
    for method in (b"DELETE", b"PUT"):
        response = raw_request(
            gateway.url,
            b"POST /echo HTTP/1.1\r\nHost: a\r\nX-Tenant: " + tenant.encode() + b"\r\n"
            b"Idempotency-Key: " + key.encode() + b"\r\n" + override + b": " + method + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        )
        sent.append(response)
    assert status_of(sent[0]) == 200
    status, name, _ = problem_of(sent[1])
    assert (status, name) == (422, "key-reused")
    assert carrying(upstream, key.encode()) == [b"/echo"]


# -- 9: forwarding headers a client claims -----------------------------------------------------

CLAIMED = [
    (b"Forwarded", b"for=198.51.100.1;proto=https;host=admin.example"),
    (b"X-Real-IP", b"198.51.100.1"),
    (b"X-Forwarded-Port", b"443"),
    (b"X-Forwarded-Prefix", b"/admin"),
]


def test_forwarding_headers_from_the_client_are_not_passed_on(gateway, upstream):
    marker = new_key().encode()
    fields = b"".join(name + b": " + value + b"\r\n" for name, value in CLAIMED)
    response = raw_request(
        gateway.url,
        b"GET /echo?"
        + marker
        + b" HTTP/1.1\r\nHost: a\r\n"
        + fields
        + b"Connection: close\r\n\r\n",
    )
    assert status_of(response) == 200
    (seen,) = [r for r in upstream.requests if marker in r.target]
    names = {name.lower() for name, _ in seen.headers}
    for name, _ in CLAIMED:
        assert name.lower() not in names
    assert (b"x-forwarded-proto", b"http") in seen.headers  # the gateway's own observation


async def test_a_proxy_in_front_may_set_them_with_trust_forwarded():
    seen: list[httpx.Request] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    app = build_gateway(
        "http://up:9000",
        store="postgresql://127.0.0.1:1/none",
        tenant=tenant_from_header("x-tenant"),
        apply_schema=False,
        trust_forwarded=True,
        transport=httpx.MockTransport(upstream),
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://g"
    ) as http:
        assert (await http.get("/x", headers=[(n, v) for n, v in CLAIMED])).status_code == 200
    for name, value in CLAIMED:
        assert seen[0].headers[name.decode()] == value.decode()


# -- header section bounds ---------------------------------------------------------------------


def test_more_header_fields_than_the_limit_get_431_and_are_not_forwarded(gateway, upstream):
    marker = new_key().encode()
    fields = b"".join(b"X-Field-%d: v\r\n" % i for i in range(150))  # about 2 KiB: h11 takes it
    response = raw_request(
        gateway.url,
        b"GET /echo?"
        + marker
        + b" HTTP/1.1\r\nHost: a\r\n"
        + fields
        + b"Connection: close\r\n\r\n",
    )
    status, name, _ = problem_of(response)
    assert (status, name) == (431, "headers-too-large")
    assert [r for r in upstream.requests if marker in r.target] == []


async def test_the_app_refuses_a_large_header_section_under_any_server():
    """Under a server of the user's own (here none: ASGI in process) the app's own check
    holds: 40 KiB of headers are refused, not forwarded."""
    seen: list[httpx.Request] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    app = build_gateway(
        "http://up:9000",
        store="postgresql://127.0.0.1:1/none",
        tenant=tenant_from_header("x-tenant"),
        apply_schema=False,
        transport=httpx.MockTransport(upstream),
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://g"
    ) as http:
        large = await http.get("/x", headers={"x-large": "v" * (40 * 1024)})
        fine = await http.get("/x", headers={"x-large": "v" * (20 * 1024)})
    assert large.status_code == 431
    assert large.json()["type"] == TYPE_PREFIX + "headers-too-large"
    assert fine.status_code == 200
    assert len(seen) == 1


@pytest.mark.skipif(
    importlib.util.find_spec("httptools") is None,
    reason="httptools is not installed (the gateway command uses it when it is)",
)
def test_under_httptools_a_large_head_is_cut_off_before_the_app(upstream, schema):
    process = GatewayProcess(upstream.url, schema, "--tenant-header", "x-tenant").start()
    try:
        marker = new_key().encode()
        response = raw_request(
            process.url,
            b"GET /echo?"
            + marker
            + b" HTTP/1.1\r\nHost: a\r\nX-Large: "
            + b"v" * (1024 * 1024)
            + b"\r\nConnection: close\r\n\r\n",
        )
    finally:
        process.stop()
    status, name, _ = problem_of(response)
    assert (status, name) == (431, "headers-too-large")
    assert [r for r in upstream.requests if marker in r.target] == []


class _Recorder:
    """An upstream that reads what comes on each connection until it closes, and answers
    nothing: what reached it is `received`."""

    def __init__(self) -> None:
        self.received = b""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._listener.accept()
                with conn:
                    while chunk := conn.recv(65536):
                        self.received += chunk

    def close(self) -> None:
        self._listener.close()


async def test_a_streamed_body_that_stalls_says_part_of_it_went_upstream(schema):
    """With `--request-spool-bytes 0` the body goes upstream as it comes: when it stalls, the
    upstream has the request and part of its body already. The 408 says so (it said nothing
    was forwarded)."""
    upstream = _Recorder()
    gateway = GatewayProcess(
        upstream.url,
        schema,
        "--tenant-header",
        "x-tenant",
        "--request-spool-bytes",
        "0",
        "--request-buffer-bytes",
        "1024",
        "--body-timeout",
        "1",
    ).start()
    try:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
            sock.sendall(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 10000\r\n\r\n")
            sock.sendall(b"b" * 4000)
            chunks = []
            while chunk := await asyncio.to_thread(sock.recv, 65536):
                chunks.append(chunk)
        answer = b"".join(chunks)
    finally:
        gateway.stop()
        upstream.close()
    status, name, _ = problem_of(answer)
    assert (status, name) == (408, "request-body-timeout")
    detail = orjson.loads(answer.partition(b"\r\n\r\n")[2])["detail"]
    assert "nothing was forwarded" not in detail
    assert "went on to the upstream" in detail
    assert upstream.received.startswith(b"POST /upload HTTP/1.1\r\n")
    assert upstream.received.count(b"b") >= 1024


# -- a head's end, however its last line ends --------------------------------------------------


@pytest.mark.parametrize("parser", ["h11", "httptools"])
def test_a_head_ending_in_a_bare_line_feed_then_crlf_is_no_large_head(upstream, schema, parser):
    """h11 ends a head at `\\n\\r\\n` (the last field's line ended by a bare LF); httptools
    refuses the bare LF. The server's head guard did not see the end, and counted the body
    after it as head: a 40 KiB body got a false 431 `headers-too-large` on both."""
    process = GatewayProcess(
        upstream.url, schema, "--tenant-header", "x-tenant", "--http", parser
    ).start()
    marker = new_key().encode()
    body = b"b" * (40 * 1024)
    try:
        response = raw_request(
            process.url,
            b"POST /echo?" + marker + b" HTTP/1.1\r\nHost: a\r\nConnection: close\r\n"
            b"Content-Length: %d\n\r\n" % len(body) + body,
        )
    finally:
        process.stop()
    if parser == "httptools":
        status, name, _ = problem_of(response)
        assert (status, name) == (400, "malformed-request")  # the parser's own refusal
        return
    assert status_of(response) == 200, response[:300]
    (seen,) = [r for r in upstream.requests if marker in r.target]
    assert seen.body == body
