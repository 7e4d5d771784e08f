"""The example's outbox, worker, provider and reconciliation, audited after faults."""

from __future__ import annotations

import asyncio
import sys

import asyncpg
import httpx
import pytest

from examples.payments import reconcile
from examples.payments.app import create_app
from examples.payments.schema import bring_up_to_date
from examples.payments.worker import OutboxWorker
from tests.helpers import client, fresh_database, new_key
from tests.server import UvicornProcess
from tests.test_example_payments import ACME, GLOBEX, settings

PAYMENT = {"amount": 700, "currency": "USD", "customer_id": "cus_outbox"}


@pytest.fixture
async def ledger(schema):
    """A database of its own: the audits and the reconciliation see only this test's data."""
    async with fresh_database(schema) as url:
        pool = await asyncpg.create_pool(url, min_size=1, max_size=4)
        async with pool.acquire() as conn:
            await bring_up_to_date(conn, url)
        try:
            yield url, pool
        finally:
            await pool.close()


def provider(url: str, **faults: str) -> UvicornProcess:
    env = {"DATABASE_URL": url, **{f"PROVIDER_{k.upper()}": v for k, v in faults.items()}}
    return UvicornProcess("examples.payments.provider:app", env)


async def create_payments(url: str, count: int, **overrides) -> list[str]:
    ids = []
    async with client(create_app(settings(url))) as http:
        for n in range(count):
            headers = {**(ACME if n % 2 else GLOBEX), "idempotency-key": new_key()}
            response = await http.post("/payments", json={**PAYMENT, **overrides}, headers=headers)
            assert response.status_code == 201, response.text
            ids.append(response.json()["id"])
    return ids


async def run_reconcile(url: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.payments.reconcile",
        "--database-url",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    return process.returncode, out.decode(), err.decode()


async def drain(worker: OutboxWorker, pool, *, rounds: int = 200) -> None:
    for _ in range(rounds):
        await worker.run_once()
        if not await pool.fetchval("SELECT count(*) FROM outbox WHERE state = 'pending'"):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the outbox did not drain")


async def charges_per_payment(pool) -> dict[str, int]:
    rows = await pool.fetch("SELECT payment_id, count(*) AS n FROM provider.charges GROUP BY 1")
    return {row["payment_id"]: row["n"] for row in rows}


async def test_every_payment_is_charged_once_although_acks_are_lost(ledger):
    url, pool = ledger
    ids = await create_payments(url, 12)
    downstream = provider(url, drop_acks="1").start(ready_path="/healthz")
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            worker = OutboxWorker(
                pool, http, downstream_url=downstream.url + "/charges", base_backoff=0.01
            )
            await drain(worker, pool)
    finally:
        downstream.stop()
    assert await charges_per_payment(pool) == dict.fromkeys(ids, 1)
    # Each event really was delivered twice (the first acknowledgement was lost)...
    deliveries = await pool.fetch(
        "SELECT idempotency_key, count(*) AS n, count(*) FILTER (WHERE first) AS firsts"
        " FROM provider.deliveries GROUP BY 1"
    )
    assert len(deliveries) == 12
    assert all(row["n"] == 2 and row["firsts"] == 1 for row in deliveries)
    # ...with the payment's own key forwarded, scoped by tenant.
    keys = await pool.fetch(
        "SELECT p.tenant_id || ':' || p.idempotency_key AS forwarded, c.idempotency_key"
        " FROM payments p JOIN provider.charges c ON c.payment_id = p.id"
    )
    assert all(row["forwarded"] == row["idempotency_key"] for row in keys)
    outbox = await pool.fetch("SELECT state, attempts FROM outbox")
    assert {(row["state"], row["attempts"]) for row in outbox} == {("delivered", 2)}
    code, report, _ = await run_reconcile(url)
    assert code == 0 and "ledger and provider agree" in report


async def test_refused_events_are_retried_with_backoff_then_dead_lettered(ledger):
    url, pool = ledger
    [dead_id] = await create_payments(url, 1, customer_id="cus_refused")
    downstream = provider(url, fail_customers="cus_refused").start(ready_path="/healthz")
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            worker = OutboxWorker(
                pool,
                http,
                downstream_url=downstream.url + "/charges",
                max_attempts=4,
                base_backoff=0.2,
            )
            await worker.run_once()
            first = await pool.fetchrow("SELECT * FROM outbox")
            assert first["state"] == "pending" and first["attempts"] == 1
            assert "500" in first["last_error"]
            # Backed off: not due again at once.
            assert (await worker.run_once()).claimed == 0
            await drain(worker, pool)
    finally:
        downstream.stop()
    dead = await pool.fetchrow("SELECT * FROM outbox")
    assert dead["state"] == "dead" and dead["attempts"] == 4
    assert await charges_per_payment(pool) == {}
    code, report, _ = await run_reconcile(url)
    assert code == 1
    assert "missing downstream: 1" in report and dead_id in report and "outbox dead" in report


def test_backoff_doubles_with_jitter_and_is_capped():
    worker = OutboxWorker(None, None, downstream_url="", base_backoff=1.0, max_backoff=10.0)
    for attempts, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (30, 10.0)]:
        delays = [worker.backoff(attempts) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1


@pytest.mark.slow
async def test_worker_killed_mid_batch_and_restarted_charges_each_payment_once(ledger):
    url, pool = ledger
    ids = await create_payments(url, 30)
    downstream = provider(url, delay_ms="60").start(ready_path="/healthz")
    env = {
        "DATABASE_URL": url,
        "PAYMENTS_DOWNSTREAM_URL": downstream.url + "/charges",
        "OUTBOX_BATCH_SIZE": "10",
        "OUTBOX_BASE_BACKOFF_SECONDS": "0.05",
    }
    command = [sys.executable, "-m", "examples.payments.worker"]
    try:
        first = await asyncio.create_subprocess_exec(*command, env=env)
        # Kill it in the middle of a batch: some deliveries made, none of them marked.
        while await pool.fetchval("SELECT count(*) FROM provider.deliveries") < 4:
            await asyncio.sleep(0.01)
        first.kill()
        await first.wait()
        booked = await pool.fetchval("SELECT count(*) FROM provider.charges")
        marked = await pool.fetchval("SELECT count(*) FROM outbox WHERE state = 'delivered'")
        assert booked > marked  # the provider has charges the outbox never heard back about

        second = await asyncio.create_subprocess_exec(*command, env=env)
        try:
            for _ in range(600):
                if not await pool.fetchval(
                    "SELECT count(*) FROM outbox WHERE state <> 'delivered'"
                ):
                    break
                await asyncio.sleep(0.05)
        finally:
            second.terminate()
            assert await second.wait() == 0  # a graceful stop on SIGTERM
    finally:
        downstream.stop()
    assert await charges_per_payment(pool) == dict.fromkeys(ids, 1)
    deliveries = await pool.fetchval("SELECT count(*) FROM provider.deliveries")
    assert deliveries > len(ids)  # redelivered after the kill, deduplicated by the provider
    report = await reconcile.reconcile(pool)
    assert report.clean


async def test_reconciliation_names_orphans_duplicates_and_mismatches(ledger):
    url, pool = ledger
    [paid, other] = await create_payments(url, 2)
    await pool.execute(
        "INSERT INTO provider.charges (id, idempotency_key, payment_id, tenant_id, amount,"
        " currency) VALUES"
        " ('ch_1', 'k1', $1, (SELECT tenant_id FROM payments WHERE id = $1), 700, 'USD'),"
        " ('ch_2', 'k1b', $1, (SELECT tenant_id FROM payments WHERE id = $1), 700, 'USD'),"
        " ('ch_3', 'k2', $2, (SELECT tenant_id FROM payments WHERE id = $2), 999, 'USD'),"
        " ('ch_orphan', 'k3', 'pay_nowhere', 'acme', 5, 'USD')",
        paid,
        other,
    )
    code, report, _ = await run_reconcile(url)
    assert code == 1
    assert "charges without a payment: 1" in report and "ch_orphan" in report
    assert "payments charged more than once: 1" in report and paid in report
    assert "amount or currency differs: 1" in report and "999" in report
    assert "missing downstream: 0" in report


async def test_reconciliation_explains_an_unreachable_database():
    code, _, err = await run_reconcile("postgresql://postgres@127.0.0.1:1/x")
    assert code == 2 and "cannot read the ledger" in err and "Traceback" not in err
