"""The gateway's upstream connections: kept alive, reused, closed when idle, bounded."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from idempotency_asgi.gateway import build_gateway
from tests.gateway_support import NodeUpstream
from tests.helpers import assert_problem, client, eventually


@pytest.fixture(scope="module")
def upstream():
    node = NodeUpstream().start()
    yield node
    node.stop()


async def total_orders(upstream: NodeUpstream) -> int:
    return int(
        (await asyncio.to_thread(httpx.get, upstream.url + "/orders/count")).json()["created"]
    )


async def more_orders_than(upstream: NodeUpstream, count: int) -> bool:
    return await total_orders(upstream) > count


def gateway(upstream: NodeUpstream, dsn: str, **options):
    return build_gateway(upstream.url, store=dsn, tenant=lambda scope: "t", **options)


async def test_a_connection_is_reused_then_closed_after_its_keepalive_expiry(upstream, schema):
    app = gateway(upstream, schema, keepalive_expiry=1.0)
    async with client(app) as http:
        first = (await http.get("/echo")).json()["peer_port"]
        second = (await http.get("/echo")).json()["peer_port"]
        await asyncio.sleep(1.5)
        third = (await http.get("/echo")).json()["peer_port"]
    assert first == second  # kept alive
    assert third != first  # expired, not reused: the upstream may be closing it


async def test_a_connection_the_upstream_closed_is_not_reused(upstream, schema):
    app = gateway(upstream, schema)
    async with client(app) as http:
        assert (await http.get("/items")).status_code == 200
        upstream.stop()
        upstream.start()
        # The pooled connection died with the old process; the gateway sees it and dials anew.
        assert (await http.get("/items")).status_code == 200


async def test_no_free_connection_in_time_is_a_502_and_nothing_is_sent(upstream, schema):
    app = gateway(upstream, schema, max_connections=1, connect_timeout=0.3)
    async with client(app) as http:
        before = await total_orders(upstream)
        slow = asyncio.create_task(
            http.post("/orders", json={"sku": "slow"}, headers={"x-delay-ms": "1500"})
        )
        # The order is made (the one connection is busy with its slow answer).
        await eventually(lambda: more_orders_than(upstream, before))
        waiting = await http.get("/items")
        assert (await slow).status_code == 201
        after = await http.get("/items")
    body = assert_problem(waiting, 502, "upstream-unavailable")
    assert "no free connection" in body["detail"]
    assert after.status_code == 200


async def test_a_store_that_is_down_fails_keyed_requests_closed_and_passes_the_rest(
    upstream, caplog
):
    app = build_gateway(
        upstream.url, store="postgresql://127.0.0.1:1/nowhere", tenant=lambda scope: "t"
    )
    key = "store-down-" + str(id(app))
    async with client(app) as http:  # starts although the schema could not be applied
        keyed = await http.post("/orders", json={"sku": "X"}, headers={"idempotency-key": key})
        passing = await http.get("/items")
    assert_problem(keyed, 503, "store-unavailable")
    assert upstream.counts(key) == {"created": 0, "deliveries": 0}
    assert passing.status_code == 200
    assert "could not apply the schema" in caplog.text


async def test_a_header_the_upstream_connection_cannot_carry_is_a_400(upstream, schema):
    app = gateway(upstream, schema)
    sent: list[dict[str, object]] = []
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/items",
        "raw_path": b"/items",
        "query_string": b"",
        "headers": [(b"x-bad", b"a\x00b")],
        "scheme": "http",
        "client": ("127.0.0.1", 1),
    }

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    await app.proxy.aclose()
    assert sent[0]["status"] == 400
    assert b"cannot-forward" in sent[1]["body"]


async def test_a_keyed_request_on_an_exempt_path_is_not_promised_a_recorded_answer(
    upstream, schema
):
    app = gateway(upstream, schema, exempt_paths=["/orders"], client_timeout=0.3)
    key = "exempt-" + str(id(app))
    async with client(app) as http:
        slow = await http.post(
            "/orders", json={"sku": "E"}, headers={"idempotency-key": key, "x-delay-ms": "1000"}
        )
    # Not "upstream-still-running": nothing records an exempt request, so no retry gets it.
    assert_problem(slow, 504, "upstream-timeout")
