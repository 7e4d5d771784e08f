"""Reaper, sweeper, background maintenance and the CLI, on real PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys

import asyncpg
import pytest

from idempotency_asgi import PostgresStore, migrate
from idempotency_asgi._records import Outcome, StoredResponse
from idempotency_asgi.maintenance import MAINTENANCE_LOCK_ID, BackgroundMaintenance, Reaper, Sweeper
from tests.helpers import fresh_database
from tests.server import ROOT

FP = hashlib.sha256(b"r").digest()
DONE = StoredResponse(201, [], b"{}")


@pytest.fixture
async def empty(schema):
    """A store on a database of its own, so counts are exact."""
    async with fresh_database(schema) as url:
        await migrate(url)
        store = PostgresStore(url)
        conn = await asyncpg.connect(url)
        try:
            yield url, store, conn
        finally:
            await conn.close()
            await store.close()


def claim(store, key, *, lease=30.0, ttl=3600.0, tenant="t"):
    return store.claim(
        tenant=tenant,
        key=key,
        method="POST",
        path="/p",
        fingerprint=FP,
        lease_seconds=lease,
        ttl_seconds=ttl,
    )


async def add(store, key, *, completed=True, lease=30.0, ttl=3600.0, tenant="t"):
    reserved = await claim(store, key, lease=lease, ttl=ttl, tenant=tenant)
    assert reserved.outcome is Outcome.CLAIMED
    if completed:
        assert await store.complete(reserved.lease, DONE, ttl_seconds=ttl)
    return reserved.lease


async def keys(conn) -> set[str]:
    return {
        r["idempotency_key"]
        for r in await conn.fetch("SELECT idempotency_key FROM idempotency_keys")
    }


async def age(conn, key, *, expires=None, lease=None):
    if expires is not None:
        await conn.execute(
            "UPDATE idempotency_keys SET expires_at = now() - make_interval(secs => $2)"
            " WHERE idempotency_key = $1",
            key,
            expires,
        )
    if lease is not None:
        await conn.execute(
            "UPDATE idempotency_keys SET lease_expires_at = now() - make_interval(secs => $2)"
            " WHERE idempotency_key = $1",
            key,
            lease,
        )


async def test_reaper_no_ops_on_an_empty_database(empty):
    _, store, _ = empty
    assert await Reaper(store).run_once() == 0


async def test_reaper_deletes_only_finished_keys_past_retention(empty):
    _, store, conn = empty
    await add(store, "expired")
    await add(store, "fresh")
    await add(store, "running", completed=False)
    await age(conn, "expired", expires=1)
    # An in-flight row is never reaped, even with its retention in the past.
    await age(conn, "running", expires=1)
    assert await Reaper(store).run_once() == 1
    assert await keys(conn) == {"fresh", "running"}


async def test_reaper_works_in_bounded_batches(empty):
    _, store, conn = empty
    for n in range(5):
        await add(store, f"k{n}")
    await conn.execute("UPDATE idempotency_keys SET expires_at = now() - interval '1 minute'")
    reaper = Reaper(store, batch_size=2)
    assert [await reaper.run_once() for _ in range(4)] == [2, 2, 1, 0]


async def test_reaper_also_reaps_old_consumer_records_when_asked(empty):
    _, store, conn = empty
    await conn.execute(
        "INSERT INTO idempotency_processed_messages (consumer, message_id, processed_at) VALUES"
        " ('c', 'old', now() - interval '2 days'), ('c', 'new', now())"
    )
    assert await Reaper(store).run_once() == 0  # not asked: left alone
    assert await Reaper(store, processed_retention_seconds=86400).run_once() == 1
    left = await conn.fetch("SELECT message_id FROM idempotency_processed_messages")
    assert [r["message_id"] for r in left] == ["new"]


async def test_sweeper_releases_only_leases_that_lapsed_long_ago(empty, caplog):
    _, store, conn = empty
    await add(store, "dead", completed=False)
    await add(store, "just-lapsed", completed=False)
    await add(store, "live", completed=False)
    await add(store, "finished")
    await age(conn, "dead", lease=600)
    await age(conn, "just-lapsed", lease=10)
    await age(conn, "finished", lease=600)
    with caplog.at_level("WARNING", logger="idempotency_asgi.maintenance"):
        assert await Sweeper(store, grace_seconds=300).run_once() == 1
    assert await keys(conn) == {"just-lapsed", "live", "finished"}
    assert "sweeper released tenant=t key_hash=" in caplog.text
    assert "dead" not in caplog.text.split("key_hash=")[1]  # the raw key is never logged
    # The released key is free: the next retry runs afresh.
    assert (await claim(store, "dead", ttl=60)).outcome is Outcome.CLAIMED


async def test_a_swept_stale_owner_cannot_complete(empty):
    _, store, conn = empty
    stale = await add(store, "k", completed=False)
    await age(conn, "k", lease=600)
    assert await Sweeper(store, grace_seconds=300).run_once() == 1
    assert not await store.complete(stale, DONE, ttl_seconds=60)
    assert await keys(conn) == set()


async def test_sweeper_forgets_lease_rows_long_past_and_keeps_live_ones(empty):
    _, store, conn = empty
    finished = await add(store, "finished-slow", completed=False)
    live = await add(store, "live-slow", completed=False)
    for lease in (finished, live):
        assert await store.renew(lease)  # a slow request: its renewal has a row of its own
    assert await store.complete(finished, DONE, ttl_seconds=60)  # which completion leaves
    await conn.execute(
        "UPDATE idempotency_leases SET lease_expires_at = now() - interval '600 seconds'"
        " WHERE idempotency_key = 'finished-slow'"
    )
    assert await Sweeper(store, grace_seconds=300).run_once() == 0  # no key swept
    left = await conn.fetch("SELECT idempotency_key FROM idempotency_leases ORDER BY 1")
    assert [row["idempotency_key"] for row in left] == ["live-slow"]


async def test_a_renewed_lease_is_not_swept_though_its_claim_lapsed_long_ago(empty):
    _, store, conn = empty
    lease = await add(store, "renewed", completed=False)
    await age(conn, "renewed", lease=600)  # the claim's own lease, long gone
    assert await store.renew(lease)  # but its owner renews: alive
    assert await Sweeper(store, grace_seconds=300).run_once() == 0
    retry = await claim(store, "renewed", ttl=60)
    assert retry.outcome is Outcome.IN_FLIGHT and 25 < retry.lease_remaining <= 30  # not taken
    assert await store.complete(lease, DONE, ttl_seconds=60)


async def test_background_maintenance_elects_one_runner(empty):
    url, store, conn = empty
    other_store = PostgresStore(url)
    runners = [
        BackgroundMaintenance(
            Reaper(s, idle_seconds=0.05), Sweeper(s, idle_seconds=0.05), idle_seconds=0.05
        )
        for s in (store, other_store)
    ]
    try:
        for runner in runners:
            runner.start()
        await add(store, "expired")
        await age(conn, "expired", expires=1)
        for _ in range(100):
            if not await keys(conn):
                break
            await asyncio.sleep(0.02)
        assert await keys(conn) == set()
        holders = await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = $1 AND granted",
            MAINTENANCE_LOCK_ID,
        )
        assert holders == 1
    finally:
        for runner in runners:
            await runner.stop()
        await other_store.close()


def cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "idempotency_asgi", *args],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_cli_reap_sweep_inspect_stats(empty):
    url, store, conn = empty
    await add(store, "expired", tenant="acme")
    await add(store, "dead", completed=False, tenant="acme")
    await add(store, "kept", tenant="acme")
    await age(conn, "expired", expires=1)
    await age(conn, "dead", lease=900)

    stats = cli("stats", url=url)
    assert stats.returncode == 0, stats.stderr
    assert "completed         2" in stats.stdout and "in_flight         1" in stats.stdout
    assert "expired_waiting   1" in stats.stdout

    shown = cli("inspect", "--tenant", "acme", "kept", url=url)
    assert shown.returncode == 0
    assert "state             completed" in shown.stdout
    assert f"fingerprint       {FP.hex()}" in shown.stdout
    assert "response_status   201" in shown.stdout
    assert cli("inspect", "--tenant", "globex", "kept", url=url).returncode == 3

    reaped = cli("reap", "--once", url=url)
    assert (reaped.returncode, reaped.stdout.strip()) == (0, "reaped 1")
    swept = cli("sweep", "--once", "--grace", "600", url=url)
    assert (swept.returncode, swept.stdout.strip()) == (0, "swept 1")
    assert await keys(conn) == {"kept"}


def test_cli_says_clearly_when_the_database_is_unreachable():
    for command in (["stats"], ["reap", "--once"], ["inspect", "--tenant", "t", "k"]):
        result = cli(*command, url="postgresql://postgres@127.0.0.1:1/postgres")
        assert result.returncode == 1
        assert "database unavailable" in result.stderr and "Traceback" not in result.stderr


def test_cli_help_lists_the_commands():
    result = subprocess.run(
        [sys.executable, "-m", "idempotency_asgi", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    for command in ("migrate", "reap", "sweep", "inspect", "stats"):
        assert command in result.stdout
