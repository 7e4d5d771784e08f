"""Reconciliation: keys held after an unknown outcome, listed, settled with the answer a
provider confirmed, or released, in every mode, against real uvicorn servers and a real
PostgreSQL. Each handler run leaves a row in `effects`: a settled key's retries must not add
one, a released key's first retry adds exactly one."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from idempotency_asgi import (
    HeldReason,
    KeyCompleted,
    KeyNotFound,
    KeyRunning,
    PostgresStore,
    ReconciliationRefused,
)
from idempotency_asgi._postgres import sql
from idempotency_asgi._postgres.keyhash import key_lock, request_lock
from idempotency_asgi._records import Outcome
from tests import server
from tests.helpers import (
    assert_problem,
    effects,
    eventually,
    headers,
    key_locked,
    key_row,
    new_key,
    running,
)
from tests.test_maintenance import DONE, FP, claim

#: How long a key is held after an unknown outcome in these servers (their lease).
LEASE = 1.5

#: The body the "provider" confirmed, and its headers, as an operator settles them.
CONFIRMED = b'{"charge": "ch_confirmed", "status": "succeeded"}'
CONFIRMED_HEADERS = [("Content-Type", "application/json"), ("X-Settled-By", "reconciler")]

#: mode -> (which server, the path): /plain/ writes on a pool of its own (its effect
#: survives an unknown outcome), /tx/ through the request's transaction.
MODES = {
    "plain": ("leased", "/plain/charge"),
    "two-phase": ("leased", "/tx/charge"),
    "atomic": ("atomic", "/tx/charge"),
}


@pytest.fixture(scope="module")
def servers(schema):
    started = {}
    try:
        for name, atomic in (("leased", False), ("atomic", True)):
            started[name] = server.serve(
                schema, options={"atomic": atomic}, IDEMPOTENCY_LEASE_SECONDS=str(LEASE)
            )
        yield {name: process.url for name, process in started.items()}
    finally:
        for process in started.values():
            process.stop()


@pytest.fixture
async def store(schema):
    made = PostgresStore(schema)
    await made.open()
    yield made
    await made.close()


@pytest.fixture(params=sorted(MODES))
def mode(request, servers):
    which, path = MODES[request.param]
    return request.param, servers[which], path


async def post(url: str, path: str, tenant: str, key: str, **extra: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        return await http.post(path, json={"amount": 5}, headers=headers(tenant, key, **extra))


async def held_after_unknown(db, url, path, tenant, key) -> int:
    """A request whose handler wrote, then raised OutcomeUnknown: its key held. Returns the
    effects it left (plain mode's survive; the transactional modes' rolled back)."""
    unknown = await post(url, path, tenant, key, x_unknown="1")
    assert_problem(unknown, 504, "outcome-unknown")
    return await effects(db, tenant, key)


# -- held -------------------------------------------------------------------------------------


async def test_a_held_key_is_listed_with_why_and_until_when_and_a_running_one_is_not(
    mode, db, store, tenant
):
    name, url, path = mode
    held_key, busy_key = new_key(), new_key()
    before = datetime.now(timezone.utc)
    await held_after_unknown(db, url, path, tenant, held_key)
    # A request early in its lease, running: in flight too, but not held.
    slow = asyncio.create_task(post(url, path, tenant, busy_key, x_delay_ms="1000"))
    await running(db, tenant, busy_key)
    listed = await store.held(tenant=tenant)
    assert (await slow).status_code == 201
    assert [(h.key, h.reason, h.method, h.path) for h in listed] == [
        (held_key, "outcome-unknown", "POST", path)
    ], name
    assert before - timedelta(seconds=1) < listed[0].since <= listed[0].until
    # Held for the lease from when it was held: a retry before then gets 409.
    assert before + timedelta(seconds=LEASE * 0.5) < listed[0].until
    assert listed[0].until < datetime.now(timezone.utc) + timedelta(seconds=LEASE + 1)
    assert (await key_row(db, tenant, held_key))["held_reason"] == "outcome-unknown"
    assert await store.held(tenant=tenant, older_than=3600) == []
    assert held_key in {h.key for h in await store.held()}  # every tenant's


@pytest.mark.parametrize("name", ["two-phase", "atomic"])
async def test_a_key_whose_handler_ended_its_transaction_is_held_so(
    servers, db, store, tenant, name
):
    which, path = MODES[name]
    key = new_key()
    ended = await post(servers[which], path, tenant, key, x_end_transaction="COMMIT")
    assert_problem(ended, 500, "transaction-ended-by-handler")
    assert [(h.key, h.reason) for h in await store.held(tenant=tenant)] == [
        (key, "transaction-ended")
    ]


async def test_a_key_in_flight_past_its_lease_is_listed_as_lapsed(store, tenant):
    reserved = await claim(store, "dead-owner", lease=0.2, tenant=tenant)
    assert reserved.outcome is Outcome.CLAIMED
    assert await store.held(tenant=tenant) == []  # its lease is live: it runs
    await asyncio.sleep(0.4)
    [lapsed] = await store.held(tenant=tenant)
    assert (lapsed.key, lapsed.reason) == ("dead-owner", HeldReason.LEASE_LAPSED.value)
    assert lapsed.until < datetime.now(timezone.utc)


# -- settle -----------------------------------------------------------------------------------


async def test_a_settled_key_is_replayed_byte_for_byte_and_its_handler_never_runs_again(
    mode, db, store, tenant
):
    name, url, path = mode
    key = new_key()
    ran = await held_after_unknown(db, url, path, tenant, key)
    done = await store.settle(
        tenant=tenant, key=key, status=201, body=CONFIRMED, headers=CONFIRMED_HEADERS
    )
    assert (done.previous, done.state) == ("outcome-unknown", "completed")
    assert await store.held(tenant=tenant) == []
    retry = await post(url, path, tenant, key)
    assert retry.status_code == 201, (name, retry.text)
    assert retry.content == CONFIRMED
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.headers["content-type"] == "application/json"
    assert retry.headers["x-settled-by"] == "reconciler"
    assert retry.headers["content-length"] == str(len(CONFIRMED))
    assert "idempotency-key-expires" in retry.headers
    # Long past when the hold would have lapsed, the retry still gets the settled answer.
    await asyncio.sleep(LEASE + 0.3)
    again = await post(url, path, tenant, key)
    assert (again.status_code, again.content) == (201, CONFIRMED)
    assert again.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == ran  # the handler never ran again
    # A different request with the key is still a reuse: 422.
    async with httpx.AsyncClient(base_url=url) as http:
        other = await http.post(path, json={"amount": 6}, headers=headers(tenant, key))
    assert_problem(other, 422, "key-reused")


async def test_a_settled_record_is_kept_for_the_keys_own_retention_unless_told(store, tenant):
    lease = (await claim(store, "own-ttl", ttl=600.0, tenant=tenant)).lease
    assert await store.hold(lease, HeldReason.OUTCOME_UNKNOWN)
    done = await store.settle(tenant=tenant, key="own-ttl", status=200)
    left = (done.expires_at - datetime.now(timezone.utc)).total_seconds()
    assert 590 < left <= 601
    lease = (await claim(store, "told-ttl", ttl=600.0, tenant=tenant)).lease
    assert await store.hold(lease, HeldReason.OUTCOME_UNKNOWN)
    done = await store.settle(tenant=tenant, key="told-ttl", status=200, ttl_seconds=60)
    assert 50 < (done.expires_at - datetime.now(timezone.utc)).total_seconds() <= 61


async def test_a_lapsed_key_can_be_settled_and_its_dead_owner_cannot_complete(store, tenant):
    reserved = await claim(store, "lapsed", lease=0.2, tenant=tenant)
    await asyncio.sleep(0.4)
    done = await store.settle(tenant=tenant, key="lapsed", status=402, body=b"declined")
    assert done.previous == "lease-lapsed"
    assert not await store.complete(reserved.lease, DONE, ttl_seconds=60)
    replay = await claim(store, "lapsed", tenant=tenant)
    assert replay.outcome is Outcome.COMPLETED
    assert (replay.response.status, replay.response.body) == (402, b"declined")


# -- release ----------------------------------------------------------------------------------


async def test_a_released_key_runs_its_next_retry_once(mode, db, store, tenant):
    name, url, path = mode
    key = new_key()
    ran = await held_after_unknown(db, url, path, tenant, key)
    done = await store.release_key(tenant=tenant, key=key)
    assert (done.previous, done.state) == ("outcome-unknown", "released")
    assert await key_row(db, tenant, key) is None
    retry = await post(url, path, tenant, key)
    assert retry.status_code == 201, (name, retry.text)
    assert "idempotent-replayed" not in retry.headers
    again = await post(url, path, tenant, key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == retry.content
    assert await effects(db, tenant, key) == ran + 1


# -- refusals ---------------------------------------------------------------------------------


async def test_a_key_that_does_not_exist_is_refused(store, tenant):
    with pytest.raises(KeyNotFound) as refused:
        await store.settle(tenant=tenant, key="never-seen", status=201)
    assert refused.value.tenant == tenant and refused.value.key == "never-seen"
    assert "never-seen" not in str(refused.value)  # the message names a hash of it
    with pytest.raises(KeyNotFound):
        await store.release_key(tenant=tenant, key="never-seen")


async def test_a_completed_key_is_refused_unless_replaced(mode, db, store, tenant):
    name, url, path = mode
    key = new_key()
    first = await post(url, path, tenant, key)
    assert first.status_code == 201
    with pytest.raises(KeyCompleted) as refused:
        await store.settle(tenant=tenant, key=key, status=200, body=b"other")
    assert "201" in refused.value.reason
    with pytest.raises(KeyCompleted):
        await store.release_key(tenant=tenant, key=key)
    assert (await post(url, path, tenant, key)).content == first.content  # unchanged
    done = await store.settle(tenant=tenant, key=key, status=200, body=b"other", replace=True)
    assert done.previous == "completed"
    replaced = await post(url, path, tenant, key)
    assert (replaced.status_code, replaced.content) == (200, b"other")
    assert await effects(db, tenant, key) == 1, name
    # Freed all the same when told: its retry runs again.
    await store.release_key(tenant=tenant, key=key, completed=True)
    assert "idempotent-replayed" not in (await post(url, path, tenant, key)).headers
    assert await effects(db, tenant, key) == 2


async def test_a_running_request_is_never_raced(mode, db, store, tenant):
    """A live lease (plain, two-phase) or a transaction's lock with no row yet (atomic)."""
    name, url, path = mode
    key = new_key()
    slow = asyncio.create_task(post(url, path, tenant, key, x_delay_ms="1200"))
    await running(db, tenant, key)
    with pytest.raises(KeyRunning):
        await store.settle(tenant=tenant, key=key, status=201, body=CONFIRMED)
    with pytest.raises(KeyRunning):
        await store.release_key(tenant=tenant, key=key)
    answered = await slow
    assert answered.status_code == 201, name
    replay = await post(url, path, tenant, key)
    assert replay.content == answered.content  # the handler's answer, not an operator's
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize("name", sorted(MODES))
async def test_a_retry_running_a_key_whose_hold_lapsed_is_never_raced(
    servers, db, store, tenant, name
):
    """A retry took the key over (plain, two-phase: a live lease again, the hold's reason
    gone) or runs it in the atomic mode's transaction over the held row (its locks held)."""
    which, path = MODES[name]
    url = servers[which]
    key = new_key()
    ran = await held_after_unknown(db, url, path, tenant, key)
    await asyncio.sleep(LEASE + 0.2)
    retry = asyncio.create_task(post(url, path, tenant, key, x_delay_ms="1200"))

    async def taken() -> bool:
        if name == "atomic":
            return await key_locked(db, tenant, key)
        row = await key_row(db, tenant, key)
        return row is not None and row["held_reason"] is None

    await eventually(taken)
    with pytest.raises(KeyRunning):
        await store.settle(tenant=tenant, key=key, status=201, body=CONFIRMED)
    with pytest.raises(KeyRunning):
        await store.release_key(tenant=tenant, key=key)
    assert (await retry).status_code == 201
    assert await effects(db, tenant, key) == ran + 1
    assert (await key_row(db, tenant, key))["held_reason"] is None


async def test_of_concurrent_settles_exactly_one_wins(store, tenant):
    lease = (await claim(store, "contested", tenant=tenant)).lease
    assert await store.hold(lease, HeldReason.OUTCOME_UNKNOWN)
    bodies = [f"answer {n}".encode() for n in range(8)]
    results = await asyncio.gather(
        *(store.settle(tenant=tenant, key="contested", status=201, body=b) for b in bodies),
        return_exceptions=True,
    )
    won = [b for b, r in zip(bodies, results, strict=True) if not isinstance(r, BaseException)]
    assert len(won) == 1, results
    assert all(
        isinstance(r, (KeyCompleted, KeyRunning)) for r in results if isinstance(r, BaseException)
    ), results
    replay = await claim(store, "contested", tenant=tenant)
    assert replay.response.body == won[0]


async def test_a_change_is_made_only_to_the_row_that_was_read(db, store, tenant):
    """The compare-and-set: a settle that read the row before a retry took the key over
    (its token changed) writes nothing, and says so."""
    lease = (await claim(store, "cas", tenant=tenant)).lease
    assert await store.hold(lease, HeldReason.OUTCOME_UNKNOWN)
    locks = (request_lock(tenant, "cas", FP), key_lock(tenant, "cas"))
    args = (tenant, "cas", lease.token + 1, *locks, 7, 201, b"[]", b"x", None, 1, False)
    row = await db.fetchrow(sql.SETTLE, *args)
    assert (row["free"], row["expires_at"]) == (True, None)
    row = await db.fetchrow(sql.RELEASE_KEY, tenant, "cas", lease.token + 1, *locks, False)
    assert (row["free"], row["released"]) == (True, False)
    held = await key_row(db, tenant, "cas")
    assert (held["state"], held["held_reason"], held["lease_token"]) == (
        "in_flight",
        "outcome-unknown",
        lease.token,
    )


async def test_an_answer_that_cannot_be_replayed_is_refused_before_anything_changes(
    db, store, tenant
):
    lease = (await claim(store, "bad", tenant=tenant)).lease
    assert await store.hold(lease, HeldReason.OUTCOME_UNKNOWN)
    for status, headers_given in (
        (500, []),
        (199, []),
        (200, [("Bad Name", "x")]),
        (200, [("X-Split", "a\r\nb")]),
        (200, [("Transfer-Encoding", "chunked")]),
        (200, [("Content-Length", "99")]),
    ):
        with pytest.raises(ValueError):
            await store.settle(tenant=tenant, key="bad", status=status, headers=headers_given)
    assert (await key_row(db, tenant, "bad"))["state"] == "in_flight"
    assert isinstance(KeyRunning("r", tenant="t", key="k"), ReconciliationRefused)


# -- telling -----------------------------------------------------------------------------------


async def test_each_change_is_logged_without_the_key_and_counted(store, tenant, caplog):
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.REGISTRY

    def counted(action: str) -> float:
        labels = {"action": action, "previous": "outcome-unknown"}
        return registry.get_sample_value("idempotency_reconciliations_total", labels) or 0.0

    settled_before, released_before = counted("settle"), counted("release")
    for key in ("secret-key-1", "secret-key-2"):
        lease = (await claim(store, key, tenant=tenant)).lease
        assert await store.hold(lease, HeldReason.OUTCOME_UNKNOWN)
    with caplog.at_level("WARNING", logger="idempotency_asgi.maintenance"):
        await store.settle(tenant=tenant, key="secret-key-1", status=201)
        await store.release_key(tenant=tenant, key="secret-key-2")
    lines = [r.getMessage() for r in caplog.records if r.name == "idempotency_asgi.maintenance"]
    assert len(lines) == 2 and all(r.levelname == "WARNING" for r in caplog.records)
    assert lines[0].startswith(f"operator settled tenant={tenant} key_hash=")
    assert "from=outcome-unknown to=completed status=201" in lines[0]
    assert lines[1].startswith(f"operator released tenant={tenant} key_hash=")
    assert "from=outcome-unknown to=released" in lines[1]
    assert "secret-key" not in caplog.text
    assert counted("settle") == settled_before + 1
    assert counted("release") == released_before + 1
