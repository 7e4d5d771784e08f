"""An upstream's answer is passed on, and recorded, only if both of uvicorn's writers can
write it as it came: a field value with a control character (httptools' writer raises on
one, after the answer was recorded: every replay ended in an empty close) and a status past
599 become a 502 problem, never an empty close. The gateway is the real command, run
directly, on each parser; the upstream a bare socket, whose log is the audit."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway_support import GatewayProcess, raw_request, status_of, writes
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


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        (b'Content-Disposition: attachment; filename="a\x01b.pdf"', "a control character"),
        (b"X-Ctl: a\x7fb", "a control character"),
        (b"Bad Name: x", "a line that is not a field"),
        (b"X-Folded: one\r\n two", "a field folded over two lines"),
    ],
    ids=["control", "del", "name", "folded"],
)
async def test_an_answer_the_server_cannot_write_is_a_502_and_runs_once(
    gateway, upstream, db, tenant, field, reason
):
    """The upstream made the order (201) and reflected something into a header that cannot
    be written on. The client gets a 502 problem saying so, not an empty close; the key is
    recorded as done without a body, so a retry gets 409 response-not-replayable (with the
    status) and the upstream never sees the request twice."""
    path = b"/unwritable-" + str(abs(hash(field))).encode()
    body = b'{"id":"o-1"}'
    upstream.routes[path] = writes(
        b"HTTP/1.1 201 Created\r\n" + field + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    key = new_key()
    before = upstream.count(path)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        passing = await http.get(path.decode())
        first = await http.post(path.decode(), content=b"x", headers=headers(tenant, key))
        retry = await http.post(path.decode(), content=b"x", headers=headers(tenant, key))
        after = await http.get("/echo")  # and the gateway goes on serving
    assert_problem(passing, 502, "upstream-answer-invalid")
    problem = assert_problem(first, 502, "upstream-answer-invalid")
    assert reason in problem["detail"] and problem["upstream_status"] == 201
    assert assert_problem(retry, 409, "response-not-replayable")["original_status"] == 201
    row = await key_row(db, tenant, key)
    assert (row["state"], row["response_status"], row["response_body"]) == ("completed", 201, None)
    assert upstream.count(path) == before + 2  # the GET and the first POST
    assert after.status_code == 200


@pytest.mark.parametrize("status", [600, 999, 101])
async def test_a_status_that_is_not_https_is_a_502_or_an_unknown_outcome(
    gateway, upstream, db, tenant, status
):
    """RFC 9110: a status outside 100..599 is not HTTP's, and a client treats it as a 5xx
    (a 101 nobody asked for is no answer either). Unkeyed: 502. Keyed: the upstream did act,
    and there is no final status to settle the key by, so its outcome is unknown (504) and
    the key is held: a retry gets 409 (freeing it, as for a 5xx, let the retry run again)."""
    path = b"/status-%d" % status
    upstream.routes[path] = writes(b"HTTP/1.1 %d Odd\r\nContent-Length: 2\r\n\r\nok" % status)
    key = new_key()
    before = upstream.count(path)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        passing = await http.get(path.decode())
        first = await http.post(path.decode(), content=b"x", headers=headers(tenant, key))
        again = await http.post(path.decode(), content=b"x", headers=headers(tenant, key))
    assert (
        "send it with an Idempotency-Key"
        in assert_problem(passing, 502, "upstream-answer-invalid")["detail"]
    )
    assert_problem(first, 504, "outcome-unknown")
    assert again.status_code == 409, again.text
    assert (await key_row(db, tenant, key)) is not None
    assert upstream.count(path) == before + 2  # held: the retry ran nothing


async def test_the_upstreams_own_replay_headers_never_reach_the_client(gateway, upstream, tenant):
    """`Idempotent-Replayed` and `Idempotency-Key-Expires` are the gateway's to say: from the
    upstream, a first run looked like a replay, and a replay carried two of each."""
    upstream.routes[b"/says-replayed"] = writes(
        b"HTTP/1.1 201 Created\r\nIdempotent-Replayed: true\r\n"
        b"Idempotency-Key-Expires: Thu, 01 Jan 2099 00:00:00 GMT\r\nContent-Length: 2\r\n\r\nok"
    )
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        passing = await http.get("/says-replayed")
        first = await http.post("/says-replayed", content=b"x", headers=headers(tenant, key))
        replay = await http.post("/says-replayed", content=b"x", headers=headers(tenant, key))
    assert "idempotent-replayed" not in passing.headers
    assert "idempotency-key-expires" not in passing.headers
    assert "idempotent-replayed" not in first.headers
    assert len(first.headers.get_list("idempotency-key-expires")) == 1
    assert "2099" not in first.headers["idempotency-key-expires"]
    assert replay.headers.get_list("idempotent-replayed") == ["true"]
    assert len(replay.headers.get_list("idempotency-key-expires")) == 1


@pytest.mark.parametrize(
    "lengths",
    [b"Content-Length: 5, 5", b"Content-Length: 5\r\nContent-Length: 5"],
    ids=["list", "repeated"],
)
async def test_a_length_said_twice_alike_reaches_the_client_once(
    gateway, upstream, db, tenant, lengths
):
    """RFC 9110 lets a recipient take `Content-Length: 5, 5` (or the field twice, alike) as
    5. It passed the checks as it came, was recorded, and then uvicorn's httptools writer
    raised on it (int(b"5, 5")): the first run and every replay ended in an empty close.
    Now the answer goes on, and is recorded, with one `content-length: 5`."""
    path = b"/twice-" + new_key().encode()
    upstream.routes[path] = writes(b"HTTP/1.1 201 Created\r\n" + lengths + b"\r\n\r\nhello")
    key = new_key()
    request = (
        b"POST " + path + b" HTTP/1.1\r\nHost: a\r\nX-Tenant: " + tenant.encode() + b"\r\n"
        b"Idempotency-Key: " + key.encode() + b"\r\nContent-Length: 1\r\n"
        b"Connection: close\r\n\r\nx"
    )
    passing = raw_request(
        gateway.url, b"GET " + path + b" HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    )
    first = raw_request(gateway.url, request)
    replay = raw_request(gateway.url, request)
    for got in (passing, first, replay):
        head, _, body = got.partition(b"\r\n\r\n")
        fields = [line.lower() for line in head.split(b"\r\n")[1:]]
        assert status_of(got) == 201, got[:300]
        assert [f for f in fields if f.startswith(b"content-length")] == [b"content-length: 5"]
        assert body == b"hello"
    assert b"idempotent-replayed: true" in replay.lower()
    row = await key_row(db, tenant, key)
    assert (row["state"], row["response_status"]) == ("completed", 201)
    assert upstream.count(path) == 2  # the GET and the first POST


async def test_the_replay_headers_configured_are_the_gateways_own(
    gateway, upstream, schema, tenant
):
    """With `--replay-headers Idempotency-Replayed`, that is the header only the gateway says:
    the upstream's own `Idempotency-Replayed: true` made a first run look like a replay, and
    a replay carry it twice. (Only the default names were dropped.)"""
    upstream.routes[b"/says-replayed-too"] = writes(
        b"HTTP/1.1 201 Created\r\nIdempotency-Replayed: true\r\nContent-Length: 2\r\n\r\nok"
    )
    other = GatewayProcess(
        upstream.url,
        schema,
        "--tenant-header",
        "x-tenant",
        "--replay-headers",
        "Idempotency-Replayed",
        *gateway.args[-2:],  # the same --http
    ).start()
    key = new_key()
    try:
        async with httpx.AsyncClient(base_url=other.url, timeout=10) as http:
            passing = await http.get("/says-replayed-too")
            first = await http.post(
                "/says-replayed-too", content=b"x", headers=headers(tenant, key)
            )
            replay = await http.post(
                "/says-replayed-too", content=b"x", headers=headers(tenant, key)
            )
    finally:
        other.stop()
    assert "idempotency-replayed" not in passing.headers
    assert (first.status_code, first.text) == (201, "ok")
    assert "idempotency-replayed" not in first.headers
    assert (replay.status_code, replay.text) == (201, "ok")
    assert replay.headers.get_list("idempotency-replayed") == ["true"]


async def test_the_omitted_replay_header_is_the_gateways_own(gateway, upstream, schema, tenant):
    """With `--omitted-replay-header Idempotency-Replay`, that header is the gateway's to say
    (on the replay of an answer too large to store): the upstream's own never reaches a
    client."""
    upstream.routes[b"/says-omitted"] = writes(
        b"HTTP/1.1 201 Created\r\nIdempotency-Replay: omitted\r\nContent-Length: 2\r\n\r\nok"
    )
    other = GatewayProcess(
        upstream.url,
        schema,
        "--tenant-header",
        "x-tenant",
        "--omitted-replay-header",
        "Idempotency-Replay",
        *gateway.args[-2:],  # the same --http
    ).start()
    key = new_key()
    try:
        async with httpx.AsyncClient(base_url=other.url, timeout=10) as http:
            passing = await http.get("/says-omitted")
            first = await http.post("/says-omitted", content=b"x", headers=headers(tenant, key))
    finally:
        other.stop()
    assert (first.status_code, first.text) == (201, "ok")
    assert "idempotency-replay" not in passing.headers
    assert "idempotency-replay" not in first.headers
