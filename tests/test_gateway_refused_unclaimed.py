"""A request the gateway refuses is refused before its key is claimed: nothing is stored, and
the corrected retry runs. A control byte in a header value and an absolute-form target (both
let through by h11), and `POST *` (both parsers), used to get their 400 `cannot-forward` from
the proxy, after the middleware had claimed the key: the 400 was recorded and replayed to the
corrected retry, and made-up credentials stored one row each, with no upstream request at all.
The key table and the bare-socket upstream's log are the audit."""

from __future__ import annotations

import uuid

import pytest

from tests.gateway_support import GatewayProcess, raw_request, status_of
from tests.helpers import assert_problem, key_row, new_key
from tests.test_gateway_paths import as_response
from tests.test_gateway_storage import tenant_of


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    return scripted_upstream


@pytest.fixture(scope="module", params=["h11", "httptools"])
def gateway(request, upstream, schema):
    process = GatewayProcess(
        upstream.url, schema, "--tenant-from", "authorization", "--http", request.param
    ).start()
    process.parser = request.param  # type: ignore[attr-defined]
    yield process
    process.stop()


def post(
    gateway: GatewayProcess, target: bytes, credential: bytes, key: str, *extra: bytes
) -> bytes:
    head = [
        b"POST " + target + b" HTTP/1.1",
        b"Host: shop.example",
        b"Authorization: " + credential,
        b"Idempotency-Key: " + key.encode(),
        *extra,
        b"Content-Type: application/json",
        b"Content-Length: 2",
        b"Connection: close",
    ]
    return raw_request(gateway.url, b"\r\n".join(head) + b"\r\n\r\n{}")


#: (what is wrong, the request line's target, an extra header line); each refused with 400.
REFUSED = {
    "control-byte": (b"/orders", b"X-Note: a\x01b"),
    "absolute-form": (b"http://shop.example/orders", b"X-Note: fine"),
    "asterisk": (b"*", b"X-Note: fine"),
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_a_refused_request_stores_nothing_and_its_corrected_retry_runs(
    gateway, upstream, db, case
):
    target, extra = REFUSED[case]
    credential = b"Bearer accepted-" + uuid.uuid4().hex.encode()
    key = new_key()
    before = len(upstream.requests)
    refused = post(gateway, target, credential, key, extra)
    if case == "absolute-form" and gateway.parser == "httptools":
        # httptools reads an absolute-form target as its path, as RFC 9112 lets a server:
        # the request is forwarded as /orders, and nothing is refused.
        assert status_of(refused) == 200
        return
    if case == "control-byte" and gateway.parser == "httptools":
        # httptools refuses the byte while parsing: before the app, so before any key.
        assert_problem(as_response(refused), 400, "malformed-request")
    else:
        assert_problem(as_response(refused), 400, "cannot-forward")
    assert upstream.requests[before:] == []
    assert await key_row(db, tenant_of(credential.decode()), key) is None
    # The same key on the corrected request: it runs (it used to get the replayed 400).
    fixed = post(gateway, b"/orders", credential, key, b"X-Note: fine")
    assert status_of(fixed) == 200, fixed
    assert b"idempotent-replayed" not in fixed.lower()
    assert [r.target for r in upstream.requests[before:]] == [b"/orders"]


async def test_made_up_credentials_store_no_refusal(gateway, upstream, db):
    """Fifty made-up credentials, each sending `POST *` with a key: fifty 400s, no upstream
    request, and no row in any of the fifty tenants (each used to store its 400)."""
    credentials = [b"Bearer invented-" + uuid.uuid4().hex.encode() for _ in range(50)]
    before = len(upstream.requests)
    for credential in credentials:
        assert_problem(
            as_response(post(gateway, b"*", credential, new_key())), 400, "cannot-forward"
        )
    assert upstream.requests[before:] == []
    tenants = [tenant_of(credential.decode()) for credential in credentials]
    rows = await db.fetchval(
        "SELECT count(*) FROM idempotency_keys WHERE tenant_id = ANY($1::text[])", tenants
    )
    assert rows == 0
