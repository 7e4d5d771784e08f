"""The request's path and target, before anything else: a path with a dot segment is refused
(it would reach another path upstream than the one the gateway checked), every other target
reaches the upstream byte for byte under its path prefix, and the health path is the
gateway's own whatever the methods it covers. The upstream is one of the test's own, on a
bare socket, so that it keeps every target exactly as it arrived; its log is the audit."""

from __future__ import annotations

import httpx
import orjson
import pytest

from idempotency_asgi.gateway.target import has_dot_segment, has_encoded_separator
from tests.gateway_support import (
    HEALTH,
    GatewayProcess,
    raw_request,
    status_of,
)
from tests.helpers import assert_problem, headers, new_key

PREFIX = b"/tenant-a"


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(
        upstream.url + PREFIX.decode(),
        schema,
        "--tenant-header",
        "x-tenant",
        "--exempt-paths",
        "/webhooks/*",
        "--required-paths",
        "/orders",
    ).start()
    yield process
    process.stop()


def send(
    gateway: GatewayProcess, method: bytes, target: bytes, *fields: bytes, body: bytes = b""
) -> bytes:
    """The request exactly as written (no client library normalizes the target on the way)."""
    head = [method + b" " + target + b" HTTP/1.1", b"Host: shop.example", *fields]
    head += [b"Content-Length: %d" % len(body), b"Connection: close"]
    return raw_request(gateway.url, b"\r\n".join(head) + b"\r\n\r\n" + body)


def as_response(raw: bytes) -> httpx.Response:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    fields = [tuple(line.split(b": ", 1)) for line in lines[1:]]
    return httpx.Response(status_of(raw), headers=fields, content=body)


# -- dot segments ----------------------------------------------------------------------------

DOT_SEGMENT_PATHS = [
    b"/../tenant-b/orders",
    b"/./../admin",
    b"/x/../../../__log",
    b"/orders/.",
    b"/orders/..",
    b"/%2e%2e/tenant-b/orders",
    b"/%2E%2E/tenant-b/orders",
    b"/.%2e/tenant-b/orders",
    b"/%2E./tenant-b/orders",
    b"/%2e/orders",
    b"/orders\\..\\..\\tenant-b",
    b"/orders\\%2e%2E\\tenant-b",
]


@pytest.mark.parametrize("path", DOT_SEGMENT_PATHS)
def test_a_dot_segment_is_refused_and_never_leaves_the_upstreams_prefix(gateway, upstream, path):
    before = len(upstream.requests)
    for method in (b"GET", b"DELETE", b"OPTIONS", b"POST"):
        raw = send(gateway, method, path)
        body = assert_problem(as_response(raw), 400, "path-not-normalized")
        assert "normalized path" in body["detail"]
    assert upstream.requests[before:] == []  # nothing reached the upstream, in any spelling


def test_a_dot_segment_does_not_slip_past_the_exempt_paths(gateway, upstream, tenant):
    """`/webhooks/../orders` matches `--exempt-paths /webhooks/*` as sent, and the upstream
    would resolve it to `/orders`: run once per retry, with nothing recorded."""
    key = new_key()
    before = len(upstream.requests)
    keyed = [b"X-Tenant: " + tenant.encode(), b"Idempotency-Key: " + key.encode()]
    for path in (b"/webhooks/../orders", b"/webhooks/%2e%2e/orders", b"/webhooks\\..\\orders"):
        for _ in range(2):
            raw = send(gateway, b"POST", path, *keyed, body=b"{}")
            assert_problem(as_response(raw), 400, "path-not-normalized")
    assert upstream.requests[before:] == []
    # The exempt path itself still passes through, unrecorded: each retry runs.
    for _ in range(2):
        assert status_of(send(gateway, b"POST", b"/webhooks/hook", *keyed, body=b"{}")) == 200
    assert [r.target for r in upstream.requests[before:]] == [PREFIX + b"/webhooks/hook"] * 2


def test_a_dot_segment_does_not_slip_past_the_required_paths(gateway, upstream):
    """`/x/../orders` is not `--required-paths /orders` as sent, and would be upstream."""
    before = len(upstream.requests)
    for path in (b"/x/../orders", b"/x/%2E%2E/orders", b"/x\\..\\orders"):
        assert_problem(as_response(send(gateway, b"POST", path)), 400, "path-not-normalized")
    plain = send(gateway, b"POST", b"/orders", b"X-Tenant: t-required")
    assert_problem(as_response(plain), 400, "missing-key")
    assert upstream.requests[before:] == []


@pytest.mark.parametrize(
    "path",
    [b"/orders/", b"/ORDERS", b"/Orders", b"//orders", b"/orders;x=1", b"/orders//", b"/orders\\"],
)
def test_another_spelling_of_a_required_path_still_requires_a_key(gateway, upstream, path):
    """`--required-paths /orders`: Express and Spring read `/ORDERS` and `/orders/` as
    `/orders`, most routers `//orders`, servlet containers `/orders;x=1`. Each is refused
    without a key, as `/orders` is; other paths still pass."""
    before = len(upstream.requests)
    refused = send(gateway, b"POST", path, b"X-Tenant: t-required")
    assert_problem(as_response(refused), 400, "missing-key")
    assert upstream.requests[before:] == []
    assert status_of(send(gateway, b"POST", b"/orders-archive", b"X-Tenant: t")) == 200
    assert status_of(send(gateway, b"POST", b"/webhooks/ORDERS", b"X-Tenant: t")) == 200


@pytest.mark.parametrize(
    ("path", "dotted"),
    [
        (b"/a/./b", True),
        (b"/a/../b", True),
        (b"/a/..", True),
        (b"/a/.", True),
        (b"/.", True),
        (b"/a/%2e%2E/b", True),
        (b"/a/%2E/b", True),
        (b"/a\\.\\b", True),
        (b"/a\\..", True),
        (b"/a/.well-known/b", False),
        (b"/a/...", False),
        (b"/a/..b/c", False),
        (b"/v1.2/items.json", False),
        # A separator to a server that decodes %2F or %5C (nginx does, and resolves `..`
        # across it), `;params` dropped by servlet containers: each is `..` to someone.
        (b"/a/%2e%2e%2f", True),
        (b"/a%2F..%2Fb", True),
        (b"/a%5c..%5cb", True),
        (b"/a/..;/b", True),
        (b"/a/.;x=1/b", True),
        (b"/a/..%3Bx/b", True),
        (b"/a/..x;/b", False),
        (b"/a/;../b", False),
        (b"/a%2Fb", False),
        # Escaped twice: `..` to a chain of servers that decode one after the other.
        (b"/a/%252e%252e/b", True),
        (b"/a%252F..%252Fb", True),
        (b"/a/%252E/b", True),
        (b"/a/%25%32%65%25%32%65/b", True),  # partly escaped twice
        (b"/a/%252%65%252%65/b", True),
        (b"/a%25%32%46..%25%32%46b", True),
        (b"/a/%25252e%25252e/b", True),  # three times
        (b"/a/%2E%2Ehidden/b", False),
        (b"/search/100%2525off", False),
        (b"/a/%25/b", False),  # a percent sign, encoded, and nothing after it to decode
        (b"/a/%2525/b", False),
        (b"/", False),
        (b"//", False),
    ],
)
def test_what_counts_as_a_dot_segment(path, dotted):
    assert has_dot_segment(path) is dotted


@pytest.mark.parametrize(
    ("path", "separated"),
    [
        (b"/a%2Fb", True),
        (b"/a%5cb", True),
        (b"/a%252Fb", True),  # escaped twice: a separator to a chain that decodes twice
        (b"/a%25%32%66b", True),
        (b"/a/b", False),
        (b"/a%20b", False),
        (b"/a%252", False),
        (b"/a%2525b", False),
    ],
)
def test_what_counts_as_an_encoded_separator(path, separated):
    assert has_encoded_separator(path) is separated


# -- the request target ----------------------------------------------------------------------

#: Targets passed on byte for byte (the rows of the review's tables that a server lets through).
UNCHANGED = [
    b"/echo/a%2Fb%20c%3F?x=1",
    b"/echo/%E2%9C%93/%zz?q=%ZZ",
    b"/echo/.well-known/x",
    b"/echo//double//slash/",
    b"/echo?q=a|b",
    b'/echo?q={x}&r=[1]&s=^&t=`&u="&v=<>&w=\\',
    b"/echo?q=a%7Cb",
    b"/echo?a=1&a=2&&b=&=c&d",
    b"/echo/with;matrix=1;x?y=z",
    b"/echo?q=hello+world&p=%2B",
    b'/echo/a"b',
    b"/echo/<x>",
    b"/echo/a|b",
    b"/echo/{id}",
    b"/echo/a^b",
    b"/echo/a`b",
    b"/echo/a\\b",
    b"/echo/a%2Fb..%2Fc",
    b"/echo/a/..b;/c",
    b'/echo?x="1"',
    b"/echo?x=a'b",
    b"/echo?q=%",
    b"/echo/%",
    b"/echo/" + b"a" * 9000,
]


@pytest.mark.parametrize("target", UNCHANGED, ids=lambda target: target[:40].decode())
def test_the_target_reaches_the_upstream_byte_for_byte_under_its_prefix(gateway, upstream, target):
    before = len(upstream.requests)
    raw = send(gateway, b"GET", target)
    assert status_of(raw) == 200
    (received,) = upstream.requests[before:]
    assert received.target == PREFIX + target
    assert orjson.loads(raw.partition(b"\r\n\r\n")[2])["target"] == (PREFIX + target).decode()


def test_an_empty_query_is_no_query(gateway, upstream):
    """ASGI gives no way to tell `/echo?` from `/echo`: both reach the upstream as `/echo`."""
    before = len(upstream.requests)
    assert status_of(send(gateway, b"GET", b"/echo?")) == 200
    assert [r.target for r in upstream.requests[before:]] == [PREFIX + b"/echo"]


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        (b"/echo/a/./b/../c", "path-not-normalized"),
        (b"/echo/%2e%2e/x", "path-not-normalized"),
        (b"/echo/..", "path-not-normalized"),
        (b"/echo/.", "path-not-normalized"),
        (b"/echo/a%2F..%2Fb", "path-not-normalized"),
        (b"/echo/a/..;/b", "path-not-normalized"),
        (b"/echo#x", "cannot-forward"),
        (b"*", "cannot-forward"),  # not a path: joined to the prefix it would be another
    ],
)
def test_targets_the_gateway_refuses_never_reach_the_upstream(gateway, upstream, target, problem):
    before = len(upstream.requests)
    assert_problem(as_response(send(gateway, b"GET", target)), 400, problem)
    assert upstream.requests[before:] == []


# -- the health path -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def covering_gets(upstream, schema):
    """GET, POST and HEAD covered by keys: the health path is still the gateway's own."""
    process = GatewayProcess(
        upstream.url, schema, "--tenant-header", "x-tenant", "--methods", "GET,POST,HEAD"
    ).start()
    yield process
    process.stop()


def test_the_health_path_is_answered_whatever_the_methods_covered(covering_gets, upstream, tenant):
    before = len(upstream.requests)
    with httpx.Client(base_url=covering_gets.url, timeout=10) as http:
        got = http.get(HEALTH)
        keyed = http.get(HEALTH, headers=headers(tenant, new_key()))
        head = http.head(HEALTH)
        refused = {method: http.request(method, HEALTH) for method in ("POST", "DELETE", "PUT")}
    for response in (got, keyed):
        assert response.status_code == 200
        assert response.json() == {"status": "ok"}
        assert response.headers["cache-control"] == "no-store"
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["content-length"] == got.headers["content-length"]
    for response in refused.values():
        assert_problem(response, 405, "health-method-not-allowed")
        assert response.headers["allow"] == "GET, HEAD"
    assert upstream.requests[before:] == []  # never forwarded
