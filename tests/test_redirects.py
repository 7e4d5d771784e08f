"""A 307 or 308 says "send this request there": it is not what came of the request, so it is
passed on and not recorded, and a client that follows it (the library's own, through httpx)
gets its answer from where it was sent, once. The test app under uvicorn, in each mode, the
orders its handler wrote counted in the database; and the gateway, which passes an upstream's
307 or 308 on the same way."""

from __future__ import annotations

import httpx
import pytest

from idempotency_asgi.client import AsyncIdempotentTransport, attempts, replayed
from tests.gateway_support import GatewayProcess, writes
from tests.gateway_support import answer as scripted
from tests.helpers import assert_problem, effects, headers, key_row, new_key
from tests.server import UvicornProcess, serve

#: Each mode: the orders route, and the middleware's `atomic` option. The plain route writes
#: on the application's own pool; the others in the request's transaction.
MODES = {
    "plain": ("/plain/orders", False),
    "two-phase": ("/tx/orders", False),
    "atomic": ("/tx/orders", True),
}

#: Where a client first sends its order: Starlette answers `/orders/` with a 307 to `/orders`
#: (its router's redirect_slashes), and `/orders-old`, a route that moved, answers a 308.
FIRST_ASKED = {"307": "{path}/", "308": "{path}-old"}


@pytest.fixture(scope="module")
def servers(schema):
    started: dict[bool, UvicornProcess] = {}

    def server(atomic: bool) -> UvicornProcess:
        if atomic not in started:
            started[atomic] = serve(schema, options={"atomic": atomic})
        return started[atomic]

    yield server
    for process in started.values():
        process.stop()


@pytest.mark.parametrize("redirect", FIRST_ASKED)
@pytest.mark.parametrize("mode", MODES)
async def test_a_client_following_a_307_or_308_makes_one_order_per_logical_request(
    servers, db, tenant, mode, redirect
):
    path, atomic = MODES[mode]
    asked = FIRST_ASKED[redirect].format(path=path)
    transport = AsyncIdempotentTransport(max_elapsed=10.0, backoff=0.01)
    async with httpx.AsyncClient(
        transport=transport,
        base_url=servers(atomic).url,
        headers=headers(tenant),
        follow_redirects=True,
        timeout=10.0,
    ) as http:
        # Keys of the transport's making (one per call), and one of the caller's own.
        answers = [await http.post(asked, json={"sku": n}) for n in range(3)]
        answers.append(await http.post(asked, json={"sku": 3}, headers={"Idempotency-Key": "o-4"}))
        # The key now names the request that ran, the redirected one: the same key sent to
        # the first address again is another request (docs/client.md says to use the address
        # the redirect named), and nothing runs.
        reused = await http.post(asked, json={"sku": 3}, headers={"Idempotency-Key": "o-4"})
    assert_problem(reused, 422, "key-reused")
    for answer in answers:
        # The redirect was passed on, followed, and the order made where it pointed: at the
        # first attempt (the redirected request carries the same key).
        assert answer.status_code == 201, answer.text
        assert [step.status_code for step in answer.history] == [int(redirect)]
        assert answer.url.path == path and not replayed(answer) and attempts(answer) == 1
        key = answer.request.headers["idempotency-key"]
        assert answer.history[0].request.headers["idempotency-key"] == key
        assert await effects(db, tenant, key) == 1
        # The key's record is the order's answer, not the redirect's.
        row = await key_row(db, tenant, key)
        assert row["state"] == "completed" and row["response_status"] == 201
    assert await effects(db, tenant) == 4


@pytest.mark.parametrize("mode", MODES)
async def test_a_303_is_still_the_keys_recorded_outcome(servers, db, tenant, mode):
    # A 303 (and a 301 or 302) turns the POST into a GET: it is the answer, and replayed.
    path, atomic = MODES[mode]
    key = new_key()
    async with httpx.AsyncClient(base_url=servers(atomic).url, timeout=10.0) as http:
        sent = headers(tenant, key)
        first = await http.post(f"{path}-old", params={"status": 303}, json={}, headers=sent)
        again = await http.post(f"{path}-old", params={"status": 303}, json={}, headers=sent)
    assert first.status_code == 303 and first.headers["location"] == path
    assert again.status_code == 303 and again.headers["idempotent-replayed"] == "true"
    assert (await key_row(db, tenant, key))["response_status"] == 303


@pytest.fixture(scope="module")
def redirecting_upstream(scripted_upstream):
    for status in (303, 307, 308):
        location = [(b"Location", b"/orders")]
        scripted_upstream.routes[b"/moved-%d" % status] = writes(scripted(status, location, b""))
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(redirecting_upstream, schema):
    process = GatewayProcess(redirecting_upstream.url, schema, "--tenant-header", "x-tenant")
    process.start()
    yield process
    process.stop()


@pytest.mark.parametrize("status", [307, 308, 303])
async def test_the_gateway_passes_a_307_or_308_on_and_frees_its_key(
    gateway, redirecting_upstream, db, tenant, status
):
    # Through the gateway the same rule holds: the upstream's 307 or 308 is passed on and
    # the key freed, so the same request goes upstream again (and follows it to its new
    # address, where it would run); a 303 is recorded and replayed.
    key = new_key()
    path = f"/moved-{status}"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10.0) as http:
        first = await http.post(path, json={}, headers=headers(tenant, key))
        before = len(redirecting_upstream.requests)
        again = await http.post(path, json={}, headers=headers(tenant, key))
    assert first.status_code == status and first.headers["location"] == "/orders"
    assert again.status_code == status
    if status == 303:
        assert again.headers["idempotent-replayed"] == "true"
        assert len(redirecting_upstream.requests) == before  # nothing went upstream
    else:
        assert "idempotent-replayed" not in again.headers
        assert len(redirecting_upstream.requests) == before + 1
        assert await key_row(db, tenant, key) is None
