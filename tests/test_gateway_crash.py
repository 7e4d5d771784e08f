"""kill -9 of the gateway while the upstream works: the window a gateway cannot close.

The gateway is plain mode by necessity: it cannot commit the upstream's writes and its key
record together. When it dies after forwarding, the upstream may finish (here it does), but
nobody records its answer; the key stays in flight until its lease lapses, and then a retry
runs the request again. An upstream that dedupes on the forwarded Idempotency-Key closes that
window itself."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.gateway_support import GatewayProcess, NodeUpstream
from tests.helpers import eventually, headers, key_row, new_key

pytestmark = pytest.mark.slow

ORDER = {"sku": "A-1", "quantity": 1}
LEASE = 2.0


@pytest.fixture(scope="module")
def upstream():
    node = NodeUpstream().start()
    yield node
    node.stop()


def gateway_for(upstream: NodeUpstream, dsn: str) -> GatewayProcess:
    return GatewayProcess(
        upstream.url, dsn, "--tenant-header", "x-tenant", "--lease-seconds", str(LEASE)
    )


async def test_kill_9_mid_request_then_the_retry_through_another_gateway(
    upstream, schema, db, tenant, capsys
):
    doomed, survivor = gateway_for(upstream, schema), gateway_for(upstream, schema)
    doomed.start()
    survivor.start()
    plain, deduped = new_key(), new_key()
    try:
        async with httpx.AsyncClient(base_url=doomed.url, timeout=30) as http:
            in_flight = [
                asyncio.create_task(
                    http.post("/orders", json=ORDER, headers=headers(tenant, key, **extra))
                )
                for key, extra in (
                    (plain, {"x_delay_ms": "1500"}),
                    (deduped, {"x_delay_ms": "1500", "x_dedupe": "1"}),
                )
            ]
            # Both reached the upstream (which has made the orders and is still answering).
            await eventually(
                lambda: asyncio.to_thread(
                    lambda: all(upstream.counts(k)["deliveries"] for k in (plain, deduped))
                )
            )
            doomed.kill()
            killed_at = time.monotonic()
            for request in in_flight:
                with pytest.raises(httpx.TransportError):
                    await request
        for key in (plain, deduped):
            assert (await key_row(db, tenant, key))["state"] == "in_flight"

        async def retry(key: str, **extra: str) -> tuple[httpx.Response, int, float]:
            conflicts = 0
            async with httpx.AsyncClient(base_url=survivor.url, timeout=30) as http:
                while True:
                    response = await http.post(
                        "/orders", json=ORDER, headers=headers(tenant, key, **extra)
                    )
                    if response.status_code != 409:
                        return response, conflicts, time.monotonic() - killed_at
                    conflicts += 1
                    await asyncio.sleep(0.05)

        (
            (plain_retry, plain_409s, plain_after),
            (deduped_retry, _, deduped_after),
        ) = await asyncio.wait_for(
            asyncio.gather(retry(plain), retry(deduped, x_dedupe="1")), timeout=30
        )
    finally:
        doomed.stop()
        survivor.stop()

    with capsys.disabled():
        print(
            f"\nkill -9: retries got 409 for {plain_after:.2f} s (lease {LEASE} s, "
            f"{plain_409s} conflicts), then ran; plain upstream {upstream.counts(plain)}, "
            f"deduping upstream {upstream.counts(deduped)} (after {deduped_after:.2f} s)"
        )
    # The killed gateway never recorded anything: the key waited out its lease, then ran again.
    assert plain_409s >= 1
    assert plain_retry.status_code == 201
    assert upstream.counts(plain) == {"created": 2, "deliveries": 2}
    # The upstream that dedupes on the forwarded key answered with its first order.
    assert deduped_retry.status_code == 201
    assert deduped_retry.json()["key"] == deduped
    assert upstream.counts(deduped) == {"created": 1, "deliveries": 2}
