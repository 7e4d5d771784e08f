"""The tested deployment: nginx in front (examples/gateway/nginx.conf, as shipped, on ports of
the test's own), the gateway command behind it with --trust-forwarded, and the Node service.
Only a request with an Idempotency-Key on a covered method goes through the gateway; nginx
bounds the clients. The service's own counts, and the hops it sees in X-Forwarded-For (one
for nginx, two when the gateway appended its own), are the audit."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from examples.gateway import nginx
from tests.gateway_support import GatewayProcess, NodeUpstream, raw_request, status_of
from tests.helpers import headers, new_key
from tests.server import free_port

pytestmark = pytest.mark.skipif(
    not nginx.available(),
    reason="nginx is not installed (apt-get install nginx-light; .ci/run installs it)",
)

ORDER = {"sku": "A-1", "quantity": 1}


@pytest.fixture(scope="module")
def upstream():
    node = NodeUpstream().start()
    yield node
    node.stop()


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(
        upstream.url, schema, "--tenant-header", "x-tenant", "--trust-forwarded"
    ).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def front(gateway, upstream):
    server = nginx.Nginx(
        listen=free_port(),
        gateway=gateway.port,
        service=upstream.port,
        # Short enough to watch; the shipped values are 10 s.
        replace={"client_header_timeout 10s;": "client_header_timeout 1s;"},
    )
    with server:
        yield server


def hops(echoed: httpx.Response) -> list[str]:
    forwarded = [v for n, v in echoed.json()["headers"] if n.lower() == "x-forwarded-for"]
    assert len(forwarded) == 1, echoed.json()["headers"]
    return [hop.strip() for hop in forwarded[0].split(",")]


async def test_a_keyed_post_goes_through_the_gateway_and_its_retry_is_replayed(
    front, upstream, tenant
):
    key = new_key()
    async with httpx.AsyncClient(base_url=front.url, timeout=10) as http:
        first = await http.post("/orders", json=ORDER, headers=headers(tenant, key))
        retry = await http.post("/orders", json=ORDER, headers=headers(tenant, key))
    assert first.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    assert upstream.counts(key) == {"created": 1, "deliveries": 1}


@pytest.mark.parametrize(
    ("method", "keyed", "through_gateway"),
    [
        ("POST", True, True),
        ("PATCH", True, True),
        ("POST", False, False),
        ("GET", True, False),
        ("GET", False, False),
        ("DELETE", True, False),
    ],
)
async def test_only_keyed_requests_on_covered_methods_reach_the_gateway(
    front, tenant, method, keyed, through_gateway
):
    request_headers = headers(tenant, new_key() if keyed else None)
    async with httpx.AsyncClient(base_url=front.url, timeout=10) as http:
        content = b"{}" if method in ("POST", "PATCH") else None
        echoed = await http.request(method, "/echo", content=content, headers=request_headers)
    assert echoed.status_code == 200
    assert hops(echoed) == (["127.0.0.1", "127.0.0.1"] if through_gateway else ["127.0.0.1"])


async def test_nginx_sets_the_forwarding_headers_and_the_gateway_keeps_them(front, tenant):
    claimed = {
        "forwarded": "for=203.0.113.9;proto=https",
        "x-forwarded-proto": "https",
        "x-real-ip": "203.0.113.9",
        "x-forwarded-port": "443",
    }
    async with httpx.AsyncClient(base_url=front.url, timeout=10) as http:
        echoed = await http.post(
            "/echo", content=b"{}", headers={**headers(tenant, new_key()), **claimed}
        )
    seen = {name.lower(): value for name, value in echoed.json()["headers"]}
    assert seen["x-forwarded-proto"] == "http"  # nginx's $scheme, kept by the gateway
    assert seen["x-real-ip"] == "127.0.0.1"
    assert "forwarded" not in seen and "x-forwarded-port" not in seen
    assert hops(echoed)[0] == "127.0.0.1"  # the client's own claim went nowhere


async def test_a_header_section_past_nginx_caps_reaches_nothing(front, upstream, tenant):
    key = new_key()
    async with httpx.AsyncClient(base_url=front.url, timeout=10) as http:
        response = await http.post(
            "/orders", json=ORDER, headers=headers(tenant, key, x_large="v" * (16 * 1024))
        )
    assert response.status_code in (400, 431, 494)
    assert upstream.counts(key) == {"created": 0, "deliveries": 0}


def test_a_body_framed_twice_is_refused_and_nothing_behind_it_is_read(front, upstream, tenant):
    smuggled_key = new_key()
    body = orjson.dumps(ORDER)
    smuggled = (
        b"POST /orders HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        b"X-Tenant: " + tenant.encode() + b"\r\nIdempotency-Key: " + smuggled_key.encode() + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    chunked = b"2\r\n{}\r\n0\r\n\r\n"
    response = raw_request(
        front.url,
        b"POST /orders HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n"
        % len(chunked + smuggled)
        + chunked
        + smuggled,
    )
    assert status_of(response) == 400
    assert response.count(b"HTTP/1.1 ") == 1
    assert upstream.counts(smuggled_key) == {"created": 0, "deliveries": 0}


def test_a_head_that_trickles_is_cut_by_nginx(front):
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(b"GET /items HTTP/1.1\r\nHost: a\r\n")
        started = time.monotonic()
        closed = False
        for byte in b"X-Slow: " + b"y" * 30:
            try:
                sock.sendall(bytes([byte]))
                sock.settimeout(0.2)
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        took = time.monotonic() - started
    assert closed
    assert took < 1 + 1.5
