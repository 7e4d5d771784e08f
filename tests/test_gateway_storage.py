"""What anyone can make the gateway store: with the tenant taken from the credential, every
string is a tenant, so only answers to credentials the upstream accepts are kept (its 401
and 403 free the key); each tenant has a bound on the keys it stores (429 past it); and the
command runs the reaper and sweeper by default. The key table is the audit."""

from __future__ import annotations

import asyncio
import socket
import uuid

import asyncpg
import httpx
import pytest

from idempotency_asgi import PostgresStore, migrate
from idempotency_asgi._postgres import keybound as keybound
from idempotency_asgi._records import Outcome
from idempotency_asgi.gateway import build_gateway
from idempotency_asgi.gateway.settings import Settings
from idempotency_asgi.gateway.tenants import tenant_from_credential
from tests.gateway_support import GatewayProcess, Received, answer
from tests.helpers import assert_problem, client, eventually, fresh_database, key_row, new_key


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    def refusing(status: int):
        def route(conn: socket.socket, request: Received) -> bool:
            conn.sendall(
                answer(status, [(b"WWW-Authenticate", b"Bearer")], b'{"error":"who are you"}')
            )
            return True

        return route

    scripted_upstream.routes[b"/401"] = refusing(401)
    scripted_upstream.routes[b"/403"] = refusing(403)
    scripted_upstream.routes[b"/no-such-route"] = not_found
    return scripted_upstream


def not_found(conn: socket.socket, request: Received) -> bool:
    """What Express, Starlette and Django answer an unknown route, before any credential."""
    conn.sendall(answer(404, [(b"Content-Type", b"text/html")], b"Cannot POST /no-such-route"))
    return True


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(upstream.url, schema, "--tenant-from", "authorization")
    process.start(env={"IDEMPOTENCY_GATEWAY_MAX_KEYS_PER_TENANT": "3"})
    yield process
    process.stop()


def tenant_of(credential: str) -> str:
    resolve = tenant_from_credential()
    tenant = resolve({"headers": [(b"authorization", credential.encode())]})
    assert tenant is not None
    return tenant


@pytest.mark.parametrize("status", [401, 403])
async def test_an_upstream_refusing_the_credential_stores_nothing(gateway, upstream, db, status):
    """Thirty made-up credentials, each its own tenant: not one row, and the same key runs
    again (it was freed, not recorded) once the upstream answers otherwise."""
    credentials = [f"Bearer made-up-{uuid.uuid4().hex}" for _ in range(30)]
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        for credential in credentials:
            response = await http.post(
                f"/{status}", json={}, headers={"authorization": credential, "idempotency-key": key}
            )
            assert response.status_code == status
            assert "idempotent-replayed" not in response.headers
        before = len(upstream.requests)
        again = await http.post(
            f"/{status}", json={}, headers={"authorization": credentials[0], "idempotency-key": key}
        )
    assert again.status_code == status
    assert len(upstream.requests) == before + 1  # ran again: nothing was recorded
    tenants = [tenant_of(credential) for credential in credentials]
    rows = await db.fetchval(
        "SELECT count(*) FROM idempotency_keys WHERE tenant_id = ANY($1::text[])", tenants
    )
    assert rows == 0


async def test_made_up_credentials_store_nothing_where_the_upstream_routes_first(
    gateway, upstream, db
):
    """Fifty keyed POSTs with fifty made-up tokens to a route the upstream does not have: it
    answers 404 before looking at any credential. Each client gets that 404 as it came, and
    not one row is stored (each was a tenant of its own, able to store 100,000 keys)."""
    credentials = [f"Bearer invented-{uuid.uuid4().hex}" for _ in range(50)]
    before = len(upstream.requests)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        answers = [
            await http.post(
                "/no-such-route",
                json={},
                headers={"authorization": credential, "idempotency-key": new_key()},
            )
            for credential in credentials
        ]
    assert {(a.status_code, a.content) for a in answers} == {(404, b"Cannot POST /no-such-route")}
    assert len(upstream.requests) == before + 50
    tenants = [tenant_of(credential) for credential in credentials]
    rows = await db.fetchval(
        "SELECT count(*) FROM idempotency_keys WHERE tenant_id = ANY($1::text[])", tenants
    )
    assert rows == 0


async def test_once_the_upstream_accepted_a_tenant_its_4xx_answers_are_stored(
    gateway, upstream, db
):
    """A 2xx to a tenant's keyed request tells the gateway the upstream accepts it: from
    then on its 4xx answers are stored and replayed like any other (a decline stays one)."""
    credential = f"Bearer accepted-{uuid.uuid4().hex}"
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:

        async def post(path: str, key: str) -> httpx.Response:
            return await http.post(
                path, json={}, headers={"authorization": credential, "idempotency-key": key}
            )

        assert (await post("/echo", new_key())).status_code == 200
        first = await post("/no-such-route", key)
        before = len(upstream.requests)
        replay = await post("/no-such-route", key)
    assert first.status_code == replay.status_code == 404
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content
    assert len(upstream.requests) == before  # replayed, not run again
    assert (await key_row(db, tenant_of(credential), key))["response_status"] == 404


async def test_an_operator_may_name_statuses_stored_for_strangers_too(schema, db):
    """`unverified_statuses`: a 402 (a decline) stored and replayed even for a tenant the
    upstream never accepted; another 4xx not."""
    seen = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(402 if request.url.path == "/pay" else 422, content=b"no")

    app = build_gateway(
        "http://up:9000",
        store=schema,
        tenant=tenant_from_credential(),
        transport=httpx.MockTransport(upstream),
        unverified_statuses={402},
    )
    credential = f"Bearer new-{uuid.uuid4().hex}"
    keys = {"/pay": new_key(), "/other": new_key()}
    async with client(app) as http:
        for _ in range(2):
            for path, key in keys.items():
                sent = {"authorization": credential, "idempotency-key": key}
                assert (await http.post(path, content=b"{}", headers=sent)).status_code in (
                    402,
                    422,
                )
    assert seen == ["/pay", "/other", "/other"]  # the 402 replayed, the 422 ran again
    assert await key_row(db, tenant_of(credential), keys["/other"]) is None


async def test_a_tenant_stores_at_most_its_bound_of_keys(gateway, upstream, db):
    """A process counts a tenant's keys at most once a second (keybound.py): past that, a
    new key is refused, and so is the next one without a count, while stored keys replay."""
    credential = f"Bearer busy-{uuid.uuid4().hex}"
    other = f"Bearer quiet-{uuid.uuid4().hex}"
    keys = [new_key() for _ in range(4)]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:

        async def post(key: str, who: str = credential) -> httpx.Response:
            return await http.post(
                "/echo", json={"k": key}, headers={"authorization": who, "idempotency-key": key}
            )

        made = [await post(key) for key in keys[:3]]
        await asyncio.sleep(keybound.RECHECK_SECONDS)  # the next new key is counted again
        before = len(upstream.requests)
        over = await post(keys[3])
        still_over = await post(new_key())
        replay = await post(keys[0])
        elsewhere = await post(keys[3], who=other)
    assert [r.status_code for r in made] == [200, 200, 200]
    body = assert_problem(over, 429, "too-many-keys")
    assert "3" in body["detail"]
    assert_problem(still_over, 429, "too-many-keys")
    assert len(upstream.requests) == before + 1  # only the other tenant's request
    assert replay.headers["idempotent-replayed"] == "true"  # stored keys still answer
    assert elsewhere.status_code == 200  # another tenant has its own bound
    tenant = tenant_of(credential)
    assert await key_row(db, tenant, keys[3]) is None
    stored = await db.fetchval("SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1", tenant)
    assert stored == 3


async def test_the_store_bounds_keys_and_keys_in_flight_together(schema, tenant, monkeypatch):
    monkeypatch.setattr(keybound, "RECHECK_SECONDS", 0.0)  # count on every new key
    store = PostgresStore(schema)
    await store.open()
    try:

        async def claim(key: str, **bounds: int):
            return await store.claim(
                tenant=tenant,
                key=key,
                method="POST",
                path="/x",
                fingerprint=b"f",
                lease_seconds=10,
                ttl_seconds=60,
                **bounds,
            )

        first = await claim("a", max_keys=2, max_in_flight=1)
        assert first.outcome is Outcome.CLAIMED
        # One in flight already: the in-flight cap refuses a second new key.
        assert (await claim("b", max_keys=2, max_in_flight=1)).outcome is Outcome.OVER_LIMIT
        assert (await claim("b", max_keys=2)).outcome is Outcome.CLAIMED
        # Two stored: the key bound refuses a third, and says which bound it was.
        assert (await claim("c", max_keys=2)).outcome is Outcome.OVER_QUOTA
        assert (await claim("c", max_keys=2, max_in_flight=5)).outcome is Outcome.OVER_QUOTA
        # A key the tenant holds is never refused by either bound.
        assert (await claim("a", max_keys=1, max_in_flight=1)).outcome is Outcome.IN_FLIGHT
        assert (await claim("c", max_keys=3)).outcome is Outcome.CLAIMED
    finally:
        await store.close()


async def test_between_two_counts_a_process_remembers_what_it_found(schema, tenant, monkeypatch):
    """Counting walks the tenant's keys; a process does it at most once per RECHECK_SECONDS
    for a tenant. Under the bound it then claims without counting (so the bound may be
    overshot by what one interval adds); over it, it refuses new keys without counting."""
    monkeypatch.setattr(keybound, "RECHECK_SECONDS", 3600.0)
    store = PostgresStore(schema)
    await store.open()
    try:

        async def claim(key: str) -> Outcome:
            result = await store.claim(
                tenant=tenant,
                key=key,
                method="POST",
                path="/x",
                fingerprint=b"f",
                lease_seconds=10,
                ttl_seconds=60,
                max_keys=1,
            )
            return result.outcome

        assert await claim("a") is Outcome.CLAIMED  # counted: 0 of 1
        assert await claim("b") is Outcome.CLAIMED  # remembered as under: overshoots by one
        monkeypatch.setattr(keybound, "RECHECK_SECONDS", 0.0)
        assert await claim("c") is Outcome.OVER_QUOTA  # counted: 2 of 1
        monkeypatch.setattr(keybound, "RECHECK_SECONDS", 3600.0)
        assert await claim("d") is Outcome.OVER_QUOTA  # remembered as over: no count
        assert await claim("a") is Outcome.IN_FLIGHT  # a key it holds still answers
    finally:
        await store.close()


def test_what_a_process_remembers_is_bounded_and_forgets_the_oldest_count_first(monkeypatch):
    """Every string can be a tenant: past the bound, the oldest count is forgotten (that
    tenant is counted again), one at a time, not by sweeping all of them on every count."""
    monkeypatch.setattr(keybound, "RECHECK_SECONDS", 3600.0)
    bounds = keybound.KeyBounds()
    limit = keybound._MAX_REMEMBERED
    for n in range(limit + 5):
        bounds.counted(f"t{n}", over=n % 2 == 1)
    assert [bounds.bound_for(f"t{n}", 7) for n in range(6)] == [7] * 5 + [0]
    assert bounds.bound_for(f"t{limit + 4}", 7) is None  # the newest: under, remembered
    bounds.counted("t5", over=False)  # counted again: now the newest, and under
    bounds.counted("new", over=True)
    assert bounds.bound_for("t5", 7) is None
    assert bounds.bound_for("t6", 7) == 7  # the oldest gave way
    assert len(bounds._seen) == limit


def test_the_command_runs_maintenance_by_default():
    env = {
        "IDEMPOTENCY_GATEWAY_UPSTREAM": "http://127.0.0.1:9000",
        "DATABASE_URL": "postgresql://localhost/db",
        "IDEMPOTENCY_GATEWAY_TENANT_HEADER": "X-Consumer-Id",
    }
    settings = Settings.from_environment(env)
    assert settings.maintenance is True
    assert settings.config.max_keys_per_tenant == 100_000
    assert (
        Settings.from_environment({**env, "IDEMPOTENCY_GATEWAY_MAINTENANCE": "0"}).maintenance
        is False
    )


@pytest.mark.slow
async def test_expired_keys_are_reaped_by_a_gateway_started_with_no_options(upstream, schema):
    """In a database of its own: the one maintenance runner among gateways is whichever holds
    the lock, and here that is this one. A finished key a day past its retention is gone
    soon after it starts, with no option asking for it."""
    async with fresh_database(schema) as url:
        await migrate(url)
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(
                "INSERT INTO idempotency_keys (tenant_id, idempotency_key, method, path,"
                " fingerprint, state, lease_token, lease_expires_at, format_version, expires_at,"
                " completed_at, response_status, response_headers, response_body)"
                " VALUES ('t', 'k', 'POST', '/x', '\\x00', 'completed', 1,"
                " now() - interval '2 days', 1, now() - interval '1 day',"
                " now() - interval '2 days', 200, '[]', '')"
            )
            process = GatewayProcess(upstream.url, url, "--tenant-header", "x-tenant").start()
            try:

                async def reaped() -> bool:
                    return not await conn.fetchval("SELECT count(*) FROM idempotency_keys")

                await eventually(reaped, timeout=15)
            finally:
                process.stop()
        finally:
            await conn.close()
