"""One meaning for a path: the path the gateway's checks judge (`--required-paths`,
`--exempt-paths`, the upstream's path prefix) is the path the upstream will resolve.

Servers decode more than the gateway's checks used to: nginx in front of a service decodes
`%2F` and resolves `..` across it (`/x%2F..%2Forders` is `/orders` there), servlet containers
drop `;params` before resolving (`..;` is `..`), and Node and nginx route `/orders#x` as
`/orders`. Each of those spellings passed the checks as another path. Now a path with a dot
segment in any reading gets 400 `path-not-normalized`, a fragment 400 `cannot-forward`, on
both of uvicorn's parsers, before any key is claimed and before anything is forwarded. The
upstream is a bare socket whose log of every request it read is the audit."""

from __future__ import annotations

import pytest

from tests.gateway_support import GatewayProcess, raw_request, status_of
from tests.helpers import assert_problem, key_row, new_key
from tests.test_gateway_paths import as_response

PREFIX = b"/api"

pytestmark = pytest.mark.parametrize("gateway", ["h11", "httptools"], indirect=True)


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(request, upstream, schema):
    process = GatewayProcess(
        upstream.url + PREFIX.decode(),
        schema,
        "--tenant-header",
        "x-tenant",
        "--exempt-paths",
        "/webhooks/*",
        "--required-paths",
        "/orders",
        "--http",
        request.param,
    ).start()
    yield process
    process.stop()


def send(gateway: GatewayProcess, method: bytes, target: bytes, *fields: bytes) -> bytes:
    head = [method + b" " + target + b" HTTP/1.1", b"Host: shop.example", *fields]
    head += [b"Content-Type: application/json", b"Content-Length: 2", b"Connection: close"]
    return raw_request(gateway.url, b"\r\n".join(head) + b"\r\n\r\n{}")


#: Each resolves to /orders (or out of the prefix) in some server's reading.
HIDDEN_DOT_SEGMENTS = [
    b"/x%2F..%2Forders",
    b"/x%2f..%2forders",
    b"/x%5C..%5Corders",
    b"/x%2F%2e%2e%2Forders",
    b"/x/..;/orders",
    b"/x/%2e%2e;/orders",
    b"/x/..;jsessionid=1/orders",
    b"/x/..%3B/orders",
    b"/x/.;/orders",
    b"/x%252F..%252Forders",
    b"/x/%252e%252e/orders",
    b"/x/%25%32%65%25%32%65/orders",
    b"/x%25%32%46..%25%32%46orders",
]


@pytest.mark.parametrize("path", HIDDEN_DOT_SEGMENTS)
def test_a_dot_segment_behind_an_encoded_separator_or_params_never_skips_a_required_key(
    gateway, upstream, path
):
    """`--required-paths /orders`: each of these is `/orders` to nginx or a servlet
    container, and went through without a key."""
    before = len(upstream.requests)
    refused = send(gateway, b"POST", path, b"X-Tenant: t-dots")
    assert_problem(as_response(refused), 400, "path-not-normalized")
    assert upstream.requests[before:] == []


async def test_a_hidden_dot_segment_never_makes_a_keyed_request_exempt(
    gateway, upstream, db, tenant
):
    """`POST /webhooks%2F..%2Forders` matched `--exempt-paths /webhooks/*` as sent and ran
    `/orders` unrecorded, once per retry: three times with one key."""
    key = new_key()
    before = len(upstream.requests)
    keyed = [b"X-Tenant: " + tenant.encode(), b"Idempotency-Key: " + key.encode()]
    for path in (b"/webhooks%2F..%2Forders", b"/webhooks/..;/orders", b"/webhooks/%2e%2e;/orders"):
        for _ in range(2):
            assert_problem(
                as_response(send(gateway, b"POST", path, *keyed)), 400, "path-not-normalized"
            )
    assert upstream.requests[before:] == []
    assert await key_row(db, tenant, key) is None


def test_the_upstreams_prefix_can_never_be_escaped(gateway, upstream):
    """With `--upstream http://host/api`, `GET /x%2F..%2F..%2Finternal/users` reached the
    upstream's `/internal/users` through nginx."""
    before = len(upstream.requests)
    for target in (
        b"/x%2F..%2F..%2Finternal/users",
        b"/%2e%2e%2Finternal/users",
        b"/..;/internal/users",
        b"/x/..%3B/..%3B/internal/users",
    ):
        for method in (b"GET", b"DELETE", b"POST"):
            assert_problem(as_response(send(gateway, method, target)), 400, "path-not-normalized")
    assert upstream.requests[before:] == []


def test_an_encoded_separator_on_an_exempt_path_is_refused(gateway, upstream):
    """`/webhooks%2Fhook` is exempt read with its `%2F` decoded (as the gateway's checks
    read it) and another path to an upstream that does not decode it: which one the upstream
    runs cannot be known, so neither is assumed."""
    before = len(upstream.requests)
    keyed = [b"X-Tenant: t-exempt", b"Idempotency-Key: " + new_key().encode()]
    refused = send(gateway, b"POST", b"/webhooks%2Fhook", *keyed)
    assert_problem(as_response(refused), 400, "path-not-normalized")
    assert upstream.requests[before:] == []
    # Elsewhere an encoded slash is just a byte of the path, passed on as it came.
    assert status_of(send(gateway, b"GET", b"/files/a%2Fb")) == 200
    assert [r.target for r in upstream.requests[before:]] == [PREFIX + b"/files/a%2Fb"]


@pytest.mark.parametrize("target", [b"/orders#x", b"/orders#", b"/orders?a=1#x", b"/x#/../../y"])
def test_a_fragment_is_refused_under_either_parser(gateway, upstream, target):
    """`POST /orders#x` without a key was forwarded under h11 (nginx and Node route it as
    `/orders`); httptools dropped the fragment, and the two parsers judged two paths. A
    request target never carries a fragment (RFC 9112, section 3.2): refused on both."""
    before = len(upstream.requests)
    for method in (b"POST", b"GET"):
        refused = send(gateway, method, target, b"X-Tenant: t-fragment")
        assert_problem(as_response(refused), 400, "cannot-forward")
    assert upstream.requests[before:] == []
