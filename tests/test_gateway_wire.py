"""The gateway over the wire: the Node upstream, the gateway under uvicorn, PostgreSQL, all
real processes. Every test audits the upstream's own count of what it did."""

from __future__ import annotations

import asyncio
import collections
import importlib.util

import httpx
import orjson
import pytest
from starlette.types import Scope

from idempotency_asgi.gateway import build_gateway, tenant_from_credential
from tests.gateway_support import HEALTH, GatewayProcess, NodeUpstream, raw_request, status_of
from tests.helpers import assert_problem, client, headers, key_row, new_key
from tests.server import UvicornProcess

ORDER = {"sku": "A-1", "quantity": 2}


@pytest.fixture(scope="module")
def upstream():
    node = NodeUpstream().start()
    yield node
    node.stop()


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(
        upstream.url, schema, "--tenant-header", "x-tenant", "--client-timeout", "20"
    ).start()
    yield process
    process.stop()


def wire_client(url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=30)


async def test_fifty_concurrent_duplicates_reach_the_upstream_once(gateway, upstream, tenant):
    key = new_key()
    request_headers = headers(tenant, key)
    async with wire_client(gateway.url) as http:
        responses = await asyncio.gather(
            *(
                http.post("/orders?delay_ms=1000", json=ORDER, headers=request_headers)
                for _ in range(50)
            )
        )
    kinds = collections.Counter(
        "replay" if r.headers.get("idempotent-replayed") else str(r.status_code) for r in responses
    )
    assert upstream.counts(key) == {"created": 1, "deliveries": 1}, kinds
    assert kinds["201"] == 1, kinds
    assert kinds["201"] + kinds["409"] + kinds["replay"] == 50, kinds
    assert kinds["409"] >= 1, kinds  # they really overlapped
    first = next(r for r in responses if r.status_code == 201)
    for response in responses:
        if response.status_code == 409:
            assert_problem(response, 409, "request-in-progress")
        else:
            assert response.status_code == 201
            assert response.content == first.content


async def test_a_retry_gets_the_recorded_answer_byte_for_byte(gateway, upstream, db, tenant):
    key = new_key()
    async with wire_client(gateway.url) as http:
        first = await http.post("/orders", json=ORDER, headers=headers(tenant, key))
        retry = await http.post("/orders", json=ORDER, headers=headers(tenant, key))
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    # Every end-to-end header comes back as it was, except those the middleware never
    # replays (Date, Set-Cookie: see DEFAULT_EXCLUDED_HEADERS).
    markers = (b"idempotent-replayed",)
    replayable = [(n, v) for n, v in first.headers.raw if n not in (b"date", b"set-cookie")]
    assert [(n, v) for n, v in retry.headers.raw if n not in markers] == replayable
    assert b"idempotency-key-expires" in dict(replayable)
    order_id = first.json()["id"]
    assert first.headers.get_list("set-cookie") == [
        f"last_order={order_id}; Path=/",
        "seen=1; Path=/; HttpOnly",
    ]
    assert upstream.counts(key) == {"created": 1, "deliveries": 1}
    assert (await key_row(db, tenant, key))["state"] == "completed"


async def test_a_key_reused_for_another_body_is_refused(gateway, upstream, tenant):
    key = new_key()
    async with wire_client(gateway.url) as http:
        first = await http.post("/orders", json=ORDER, headers=headers(tenant, key))
        other = await http.post("/orders", json={"sku": "B-2"}, headers=headers(tenant, key))
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")
    assert upstream.created(key) == 1


async def test_a_keyed_request_without_a_tenant_is_refused_before_the_upstream(gateway, upstream):
    key = new_key()
    async with wire_client(gateway.url) as http:
        response = await http.post("/orders", json=ORDER, headers=headers(None, key))
    assert_problem(response, 401, "unauthenticated")
    assert upstream.counts(key) == {"created": 0, "deliveries": 0}


async def test_tenants_are_independent(gateway, upstream, tenant):
    key = new_key()
    other = tenant + "-other"
    async with wire_client(gateway.url) as http:
        mine = await http.post("/orders", json=ORDER, headers=headers(tenant, key))
        theirs = await http.post("/orders", json=ORDER, headers=headers(other, key))
        mine_again = await http.post("/orders", json=ORDER, headers=headers(tenant, key))
    assert mine.status_code == theirs.status_code == 201
    assert "idempotent-replayed" not in theirs.headers  # no bleed, no hint
    assert mine.json()["id"] != theirs.json()["id"]
    assert mine_again.content == mine.content
    assert upstream.created(key) == 2


async def test_an_upstream_5xx_is_passed_through_and_frees_the_key(gateway, upstream, db, tenant):
    key = new_key()
    async with wire_client(gateway.url) as http:
        failed = await http.post("/orders?status=503", json=ORDER, headers=headers(tenant, key))
        assert failed.status_code == 503
        assert failed.headers["content-type"] == "application/json"  # the upstream's, as is
        assert await key_row(db, tenant, key) is None
        again = await http.post("/orders?status=503", json=ORDER, headers=headers(tenant, key))
    assert again.status_code == 503
    assert "idempotent-replayed" not in again.headers
    assert upstream.created(key) == 2  # released, so the retry ran afresh


async def test_upstream_down_is_a_502_and_the_retry_runs_once_it_is_back(
    gateway, upstream, db, tenant
):
    key = new_key()
    upstream.stop()
    try:
        async with wire_client(gateway.url) as http:
            down = await http.post("/orders", json=ORDER, headers=headers(tenant, key))
            passing = await http.get("/items")
    finally:
        upstream.start()
    assert_problem(down, 502, "upstream-unavailable")
    assert_problem(passing, 502, "upstream-unavailable")
    assert await key_row(db, tenant, key) is None  # released: nothing was sent
    async with wire_client(gateway.url) as http:
        retry = await http.post("/orders", json=ORDER, headers=headers(tenant, key))
    assert retry.status_code == 201
    assert upstream.counts(key) == {"created": 1, "deliveries": 1}


async def test_bad_keys_and_large_bodies_get_problems_and_never_reach_the_upstream(
    gateway, upstream, tenant
):
    async with wire_client(upstream.url) as http:
        before = (await http.get("/orders/count")).json()["created"]
    async with wire_client(gateway.url) as http:
        spaced = await http.post("/orders", json=ORDER, headers=headers(tenant, "a b"))
        long = await http.post("/orders", json=ORDER, headers=headers(tenant, "k" * 256))
        large = await http.post(
            "/orders", content=b"x" * (1024 * 1024 + 1), headers=headers(tenant, new_key())
        )
    assert_problem(spaced, 400, "invalid-key")
    assert_problem(long, 400, "invalid-key")
    assert_problem(large, 413, "body-too-large")
    async with wire_client(upstream.url) as http:
        assert (await http.get("/orders/count")).json()["created"] == before


async def test_unkeyed_requests_pass_through_every_time(gateway, upstream):
    async with wire_client(upstream.url) as http:
        before = (await http.get("/orders/count")).json()["created"]
    async with wire_client(gateway.url) as http:
        for _ in range(3):
            assert (await http.post("/orders", json=ORDER)).status_code == 201
    async with wire_client(upstream.url) as http:
        assert (await http.get("/orders/count")).json()["created"] == before + 3


async def test_response_headers_pass_byte_for_byte(gateway, upstream):
    async with wire_client(upstream.url) as http:
        direct = await http.get("/items")
    async with wire_client(gateway.url) as http:
        proxied = await http.get("/items")
    assert proxied.content == direct.content
    hop = {b"connection", b"keep-alive"}
    expected = [(n.lower(), v) for n, v in direct.headers.raw if n.lower() not in hop]
    # One Date, the upstream's (uvicorn adds none of its own), possibly a second later.
    assert [n for n, _ in proxied.headers.raw] == [n for n, _ in expected]
    assert [(n, v) for n, v in proxied.headers.raw if n != b"date"] == [
        (n, v) for n, v in expected if n != b"date"
    ]
    assert b"server" not in dict(proxied.headers.raw)


async def test_hop_by_hop_response_headers_are_dropped(gateway):
    async with wire_client(gateway.url) as http:
        response = await http.get("/hop")
    names = {name for name, _ in response.headers.raw}
    assert response.text == "hop\n"
    assert response.headers["x-end-to-end"] == "kept"
    for name in (b"x-hop-secret", b"keep-alive", b"proxy-authenticate", b"upgrade"):
        assert name not in names


async def test_compressed_bodies_pass_raw(gateway, upstream):
    async with wire_client(upstream.url) as http, http.stream("GET", "/gzip") as direct:
        raw_direct = b"".join([chunk async for chunk in direct.aiter_raw()])
    async with wire_client(gateway.url) as http, http.stream("GET", "/gzip") as proxied:
        raw_proxied = b"".join([chunk async for chunk in proxied.aiter_raw()])
        assert proxied.headers["content-encoding"] == "gzip"
    assert raw_proxied == raw_direct
    assert raw_direct[:2] == b"\x1f\x8b"


def echoed_headers(response: bytes) -> list[list[str]]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    headers: list[list[str]] = orjson.loads(body)["headers"]
    return headers


def test_the_upstream_sees_the_clients_headers_and_only_those(gateway):
    response = raw_request(
        gateway.url,
        b"GET /echo?x=1 HTTP/1.1\r\n"
        b"Host: shop.example\r\n"
        b"X-Custom: one\r\n"
        b"X-Custom: two\r\n"
        b"Connection: close, X-Private\r\n"
        b"X-Private: for the gateway only\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"TE: trailers\r\n"
        b"Proxy-Authorization: Basic Zm9vOmJhcg==\r\n"
        b"Proxy-Connection: keep-alive\r\n"
        b"X-Forwarded-For: 203.0.113.7\r\n"
        b"X-Forwarded-Proto: https\r\n"
        b"Idempotency-Key: not-used-on-a-get\r\n"
        b"\r\n",
    )
    seen = echoed_headers(response)
    names = [name.lower() for name, _ in seen]
    # Nothing of httpx's own: no User-Agent, Accept or Accept-Encoding the client did not send.
    assert "user-agent" not in names and "accept" not in names
    assert "accept-encoding" not in names
    for dropped in ("connection", "x-private", "keep-alive", "te", "proxy-authorization"):
        assert dropped not in names
    assert "proxy-connection" not in names
    values = {name.lower(): value for name, value in seen}
    assert [v for n, v in seen if n.lower() == "x-custom"] == ["one", "two"]
    assert values["idempotency-key"] == "not-used-on-a-get"
    assert values["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
    assert values["x-forwarded-proto"] == "http"  # what the gateway saw, not what was claimed
    assert values["x-forwarded-host"] == "shop.example"
    assert values["host"] == gateway_upstream_host(gateway)


def test_every_proxy_header_is_dropped_both_ways(gateway):
    """Proxy-* headers are about one proxy hop (credentials for it, its challenge): neither
    the upstream nor the client gets them, whichever ones they are."""
    response = raw_request(
        gateway.url,
        b"GET /echo HTTP/1.1\r\n"
        b"Host: shop.example\r\n"
        b"Proxy-Authorization: Basic Zm9vOmJhcg==\r\n"
        b"Proxy-Authentication-Info: nextnonce=1\r\n"
        b"Proxy-Foo: bar\r\n"
        b"X-Kept: 1\r\n"
        b"Connection: close\r\n"
        b"\r\n",
    )
    names = [name.lower() for name, _ in echoed_headers(response)]
    assert "x-kept" in names
    assert [name for name in names if name.startswith("proxy-")] == []
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        answer = http.get("/hop")
    assert answer.headers["x-end-to-end"] == "kept"
    assert [name for name, _ in answer.headers.raw if name.startswith(b"proxy-")] == []


@pytest.fixture(scope="module")
def h11_gateway(upstream, schema):
    """The gateway from its uvicorn factory, on h11: httptools refuses a lowercase method
    itself, so it would never reach the gateway."""
    env = {
        "IDEMPOTENCY_GATEWAY_UPSTREAM": upstream.url,
        "DATABASE_URL": schema,
        "IDEMPOTENCY_GATEWAY_TENANT_HEADER": "x-tenant",
    }
    args = ("--factory", "--http", "h11")
    process = UvicornProcess("idempotency_asgi.gateway.settings:create_app", env, extra_args=args)
    yield process.start(ready_path=HEALTH)
    process.stop()


async def test_a_lowercase_method_is_not_covered_and_is_forwarded_as_it_came(
    h11_gateway, upstream, db, tenant
):
    """Methods are case-sensitive (RFC 9110): a keyed `post` is not a POST the gateway covers,
    and it must not become one on the way. Node refuses it (400) and makes no order."""
    key = new_key()
    body = orjson.dumps(ORDER)
    for method in (b"post", b"post", b"pOST"):
        response = raw_request(
            h11_gateway.url,
            method + b" /orders HTTP/1.1\r\nHost: shop.example\r\n"
            b"X-Tenant: " + tenant.encode() + b"\r\nIdempotency-Key: " + key.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n"
            % len(body)
            + b"Connection: close\r\n\r\n"
            + body,
        )
        # Node's own answer to the method it received, not a problem of the gateway's.
        assert status_of(response) == 400, response
        assert b"problem+json" not in response.partition(b"\r\n\r\n")[0]
    assert upstream.counts(key) == {"created": 0, "deliveries": 0}
    assert await key_row(db, tenant, key) is None  # the middleware never saw it


def gateway_upstream_host(gateway: GatewayProcess) -> str:
    upstream = gateway.args[gateway.args.index("--upstream") + 1]
    return upstream.removeprefix("http://")


def test_a_client_user_agent_is_passed_as_sent(gateway):
    response = raw_request(
        gateway.url,
        b"GET /echo HTTP/1.1\r\nHost: a\r\nUser-Agent: mine/1.0\r\nAccept: text/plain\r\n"
        b"Connection: close\r\n\r\n",
    )
    seen = dict((name.lower(), value) for name, value in echoed_headers(response))
    assert seen["user-agent"] == "mine/1.0"
    assert seen["accept"] == "text/plain"


async def test_the_key_is_forwarded_as_the_gateway_reads_it(gateway, tenant):
    """A key sent as an RFC 8941 string ("abc") is the key abc: the upstream, which may
    dedupe on the header, gets abc, as it does from a client that sends it bare."""
    key = "k-" + new_key()
    async with wire_client(gateway.url) as http:
        quoted = await http.post("/echo", json=ORDER, headers=headers(tenant, f'"{key}"'))
        bare = await http.post("/echo", json=ORDER, headers=headers(tenant, "b" + key))
    for response, sent in ((quoted, key), (bare, "b" + key)):
        assert response.status_code == 200
        seen = {name.lower(): value for name, value in response.json()["headers"]}
        assert seen["idempotency-key"] == sent
        assert seen["x-tenant"] == tenant


async def test_health_is_the_gateways_own(gateway, upstream):
    async with wire_client(gateway.url) as http:
        health = await http.get(HEALTH)
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    async with wire_client(upstream.url) as http:
        assert (await http.get(HEALTH)).status_code == 404  # the upstream never saw it


def authorization(scope: Scope) -> str | None:
    return tenant_from_credential()(scope)


async def test_tenant_from_the_credential_scopes_keys_to_whoever_presented_it(upstream, schema):
    # In process this time: build_gateway as a user would, wrapped in nothing.
    app = build_gateway(upstream.url, store=schema, tenant=tenant_from_credential())
    key = new_key()
    alice = {"authorization": "Bearer alice-token", "idempotency-key": key}
    bob = {"authorization": "Bearer bob-token", "idempotency-key": key}
    async with client(app) as http:
        first = await http.post("/orders", json=ORDER, headers=alice)
        replay = await http.post("/orders", json=ORDER, headers=alice)
        other = await http.post("/orders", json=ORDER, headers=bob)
        anonymous = await http.post("/orders", json=ORDER, headers={"idempotency-key": key})
    assert first.status_code == other.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content
    assert other.json()["id"] != first.json()["id"]
    assert_problem(anonymous, 401, "unauthenticated")
    assert upstream.created(key) == 2


def test_the_request_target_reaches_the_upstream_byte_for_byte(gateway):
    target = b"/echo/a%2Fb/%C3%A9?x=1&y=%20&x=2&z"
    response = raw_request(
        gateway.url, b"GET " + target + b" HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    )
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert orjson.loads(body)["target"] == target.decode()


def test_the_command_serves_on_uvloop_and_on_httptools_when_installed(gateway):
    """uvloop comes with the `gateway` extra; httptools is the user's choice. The benchmark's
    figures say which ran."""
    with open(f"/proc/{gateway.pid}/maps") as maps:
        loaded = maps.read()
    assert "/uvloop/" in loaded
    assert ("/httptools/" in loaded) == (importlib.util.find_spec("httptools") is not None)
