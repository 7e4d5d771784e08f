"""A slow upstream and one that never answers, against the client's deadline (1 s), the
gateway's own deadline on the upstream (4 s) and a short lease (2 s)."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from tests.gateway_support import GatewayProcess, NodeUpstream
from tests.helpers import assert_problem, headers, key_row, new_key

pytestmark = pytest.mark.slow

ORDER = {"sku": "A-1", "quantity": 1}
CLIENT_TIMEOUT = 1.0
UPSTREAM_TIMEOUT = 4.0
LEASE = 2.0


@pytest.fixture(scope="module")
def upstream():
    node = NodeUpstream().start()
    yield node
    node.stop()


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(
        upstream.url,
        schema,
        "--tenant-header",
        "x-tenant",
        "--client-timeout",
        str(CLIENT_TIMEOUT),
        "--upstream-timeout",
        str(UPSTREAM_TIMEOUT),
        "--lease-seconds",
        str(LEASE),
    ).start()
    yield process
    process.stop()


async def retry_until_answered(
    http: httpx.AsyncClient, key_headers: dict[str, str], deadline: float = 30.0
) -> tuple[httpx.Response, list[int]]:
    """Retry the same request (without the slowness header) until it is not a 409."""
    statuses = []
    give_up = time.monotonic() + deadline
    while time.monotonic() < give_up:
        response = await http.post("/orders", json=ORDER, headers=key_headers)
        statuses.append(response.status_code)
        if response.status_code != 409:
            return response, statuses
        await asyncio.sleep(0.1)
    raise AssertionError(f"still 409 after {deadline} s: {statuses}")


async def test_a_slow_upstream_answers_the_retry_and_runs_once(gateway, upstream, db, tenant):
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        first = await http.post(
            "/orders", json=ORDER, headers=headers(tenant, key, x_delay_ms="3000")
        )
        body = assert_problem(first, 504, "upstream-still-running")
        assert int(first.headers["retry-after"]) == LEASE
        assert "retry with the same Idempotency-Key" in body["detail"]
        # The client has its 504; the upstream is still working, and the key is in flight.
        assert (await key_row(db, tenant, key))["state"] == "in_flight"
        retry, statuses = await retry_until_answered(http, headers(tenant, key))
    assert statuses[0] == 409  # the first retry came while the upstream still worked
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"  # the recorded answer
    assert retry.json()["key"] == key
    assert upstream.counts(key) == {"created": 1, "deliveries": 1}


async def test_an_unkeyed_request_to_a_slow_upstream_gets_a_504_at_the_deadline(gateway):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        started = time.monotonic()
        response = await http.post("/orders", json=ORDER, headers={"x-delay-ms": "3000"})
        elapsed = time.monotonic() - started
    assert_problem(response, 504, "upstream-timeout")
    assert elapsed >= CLIENT_TIMEOUT


async def test_an_upstream_that_never_answers_leaves_the_key_to_its_lease(
    gateway, upstream, db, tenant
):
    """Past upstream_timeout the outcome is unknown: the key is neither recorded nor freed
    until its lease lapses, and then the retry runs again. An upstream that dedupes on the
    forwarded key closes that window itself."""
    plain, deduped = new_key(), new_key()

    async def first_then_retries(key: str, **extra: str) -> tuple[float, httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            started = time.monotonic()
            first = await http.post(
                "/orders", json=ORDER, headers=headers(tenant, key, x_delay_ms="8000", **extra)
            )
            assert_problem(first, 504, "upstream-still-running")
            retry, statuses = await retry_until_answered(http, headers(tenant, key, **extra))
            assert set(statuses[:-1]) == {409}
            return time.monotonic() - started, retry

    (plain_after, plain_retry), (deduped_after, deduped_retry) = await asyncio.gather(
        first_then_retries(plain), first_then_retries(deduped, x_dedupe="1")
    )
    # Nothing could run again before the gateway gave up on the upstream.
    assert plain_after >= UPSTREAM_TIMEOUT
    assert deduped_after >= UPSTREAM_TIMEOUT
    # The plain upstream ran the order twice: the window a gateway alone cannot close.
    assert plain_retry.status_code == 201
    assert "idempotent-replayed" not in plain_retry.headers
    assert upstream.counts(plain) == {"created": 2, "deliveries": 2}
    # The deduping upstream saw the key again and answered with its first order.
    assert deduped_retry.status_code == 201
    assert upstream.counts(deduped) == {"created": 1, "deliveries": 2}
    for key in (plain, deduped):
        assert (await key_row(db, tenant, key))["state"] == "completed"


async def test_a_client_that_gives_up_still_gets_the_recorded_answer(gateway, upstream, tenant):
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=0.3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post(
                "/orders", json=ORDER, headers=headers(tenant, key, x_delay_ms="800")
            )
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        retry, _ = await retry_until_answered(http, headers(tenant, key))
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert upstream.counts(key) == {"created": 1, "deliveries": 1}


async def test_a_keyed_upload_slower_than_the_client_timeout_runs_and_is_answered(
    gateway, upstream, db, tenant
):
    """The client's deadline runs from the moment the request goes upstream, not from its
    arrival: an upload that pauses longer than the client timeout is not a slow upstream, and
    it gets the upstream's answer (a 504 "the request goes on" would be false: nothing was
    forwarded or reserved yet)."""
    key = new_key()
    body = orjson.dumps(ORDER)
    paused = asyncio.Event()

    async def slow_upload():
        yield body[:5]
        paused.set()
        await asyncio.sleep(CLIENT_TIMEOUT * 2.5)
        yield body[5:]

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        response = await http.post(
            "/orders",
            content=slow_upload(),
            headers=headers(
                tenant, key, content_type="application/json", content_length=str(len(body))
            ),
        )
    assert paused.is_set()
    assert response.status_code == 201, response.text
    assert "idempotent-replayed" not in response.headers
    assert response.json()["key"] == key
    assert upstream.counts(key) == {"created": 1, "deliveries": 1}
    assert (await key_row(db, tenant, key))["state"] == "completed"
