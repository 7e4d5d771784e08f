"""The gateway's upstream connections: kept alive, reused, closed when idle, bounded."""

from __future__ import annotations

import asyncio

import pytest

from idempotency_asgi.gateway import build_gateway
from tests.gateway_support import NodeUpstream
from tests.helpers import assert_problem, client


@pytest.fixture(scope="module")
def upstream():
    node = NodeUpstream().start()
    yield node
    node.stop()


def gateway(upstream: NodeUpstream, dsn: str, **options):
    return build_gateway(upstream.url, store=dsn, tenant=lambda scope: "t", **options)


async def test_a_connection_is_reused_then_closed_after_its_keepalive_expiry(upstream, schema):
    app = gateway(upstream, schema, keepalive_expiry=0.3)
    async with client(app) as http:
        first = (await http.get("/echo")).json()["peer_port"]
        second = (await http.get("/echo")).json()["peer_port"]
        await asyncio.sleep(0.6)
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
        slow = asyncio.create_task(
            http.post("/orders", json={"sku": "slow"}, headers={"x-delay-ms": "1500"})
        )
        await asyncio.sleep(0.3)
        waiting = await http.get("/items")
        assert (await slow).status_code == 201
        after = await http.get("/items")
    body = assert_problem(waiting, 502, "upstream-unavailable")
    assert "no free connection" in body["detail"]
    assert after.status_code == 200
