"""`python -m bench.scale`: does the store stay flat as the table grows?

1. Claim latency (new keys and replays, one at a time) on an empty table, then with
   --rows (default 1,000,000) finished keys in it.
2. The reaper deleting all of those rows, once they are past retention, while 4 concurrent
   clients keep claiming and completing new keys: their p99 during the reaping against before.
3. Storage: table plus index bytes per key, with a 200-byte JSON response stored.

Prints a table and writes bench/scale.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

from examples.local_postgres import LocalPostgres
from idempotency_asgi import PostgresStore, migrate
from idempotency_asgi._records import StoredResponse
from idempotency_asgi.maintenance import Reaper

HERE = Path(__file__).resolve().parent
BODY = (
    b'{"id":"pay_0123456789abcdef01234567","amount":1250,"currency":"EUR",'
    + b'"x":"'
    + b"y" * 120
    + b'"}'
)
RESPONSE = StoredResponse(
    201, [(b"content-type", b"application/json"), (b"content-length", b"200")], BODY
)
FP = hashlib.sha256(b"request").digest()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def claim_latencies(
    store: PostgresStore, n: int, *, replay_key: str | None = None
) -> list[float]:
    out = []
    for _ in range(n):
        key = replay_key or uuid.uuid4().hex
        began = time.perf_counter()
        claim = await store.claim(
            tenant="scale",
            key=key,
            method="POST",
            path="/p",
            fingerprint=FP,
            lease_seconds=30,
            ttl_seconds=3600,
        )
        out.append((time.perf_counter() - began) * 1000)
        if claim.lease is not None and replay_key is None:
            await store.release(claim.lease)
    return out


async def fill(dsn: str, rows: int) -> float:
    conn = await asyncpg.connect(dsn)
    began = time.perf_counter()
    try:
        headers = b'[["content-type","application/json"],["content-length","200"]]'
        for start in range(0, rows, 100_000):
            await conn.execute(
                """
                INSERT INTO idempotency_keys (tenant_id, idempotency_key, method, path, fingerprint,
                    state, lease_token, lease_expires_at, format_version, response_status,
                    response_headers, response_body, completed_at, expires_at)
                SELECT 'tenant-' || (g % 1000), 'key-' || g, 'POST', '/payments',
                       sha256(('req' || g)::bytea), 'completed', g, now(), 1, 201, $3, $4,
                       now(), now() + interval '1 hour'
                FROM generate_series($1::bigint, $2::bigint) AS g
                """,
                start,
                min(rows, start + 100_000) - 1,
                headers,
                BODY,
            )
        await conn.execute("VACUUM ANALYZE idempotency_keys")
    finally:
        await conn.close()
    return time.perf_counter() - began


async def traffic(store: PostgresStore, stop: asyncio.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        claim = await store.claim(
            tenant="traffic",
            key=uuid.uuid4().hex,
            method="POST",
            path="/p",
            fingerprint=FP,
            lease_seconds=30,
            ttl_seconds=3600,
        )
        assert claim.lease is not None
        await store.complete(claim.lease, RESPONSE, ttl_seconds=3600)
        latencies.append((time.perf_counter() - began) * 1000)


CLIENTS = 4


async def run(dsn: str, rows: int, samples: int, pause: float) -> list[str]:
    await migrate(dsn)
    store = PostgresStore(dsn, min_size=4, max_size=20)
    lines = []
    try:
        done = (
            await store.claim(
                tenant="scale",
                key="replayed",
                method="POST",
                path="/p",
                fingerprint=FP,
                lease_seconds=30,
                ttl_seconds=3600,
            )
        ).lease
        await store.complete(done, RESPONSE, ttl_seconds=3600)
        await claim_latencies(store, 200)  # warm up
        empty_new = await claim_latencies(store, samples)
        empty_replay = await claim_latencies(store, samples, replay_key="replayed")
        filled_in = await fill(dsn, rows)
        full_new = await claim_latencies(store, samples)
        full_replay = await claim_latencies(store, samples, replay_key="replayed")

        conn = await asyncpg.connect(dsn)
        size = await conn.fetchval("SELECT pg_total_relation_size('idempotency_keys')")
        count = await conn.fetchval("SELECT count(*) FROM idempotency_keys")
        heap = await conn.fetchval("SELECT pg_relation_size('idempotency_keys')")
        await conn.execute(
            "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'"
            " WHERE tenant_id LIKE 'tenant-%'"
        )
        await conn.execute("VACUUM ANALYZE idempotency_keys")
        await conn.close()

        stop = asyncio.Event()
        before: list[float] = []
        clients = [asyncio.create_task(traffic(store, stop, before)) for _ in range(CLIENTS)]
        await asyncio.sleep(5)
        during: list[float] = []
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        clients = [asyncio.create_task(traffic(store, stop, during)) for _ in range(CLIENTS)]
        reaper = Reaper(store, batch_size=1000, pause_seconds=pause)
        reaped = 0
        began = time.perf_counter()
        while (batch := await reaper.run_once()) > 0:
            reaped += batch
            await asyncio.sleep(pause)  # what Reaper.run does between full batches
        reap_seconds = time.perf_counter() - began
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
    finally:
        await store.close()

    def row(name: str, values: list[float]) -> str:
        return (
            f"| {name} | {statistics.median(values):.3f} | {pct(values, 0.99):.3f} |"
            f" {len(values)} |"
        )

    lines += [
        f"Filled {rows:,} finished keys in {filled_in:.0f} s.",
        "",
        "| claim, one at a time | p50 ms | p99 ms | samples |",
        "| --- | ---: | ---: | ---: |",
        row("new key, empty table", empty_new),
        row(f"new key, {rows:,} rows", full_new),
        row("replay, empty table", empty_replay),
        row(f"replay, {rows:,} rows", full_replay),
        "",
        f"Reaper: {reaped:,} expired rows deleted in {reap_seconds:.1f} s "
        f"({reaped / reap_seconds:,.0f} rows/s, batches of 1,000, {pause * 1000:.0f} ms apart) "
        f"while {CLIENTS} clients claimed and completed new keys:",
        "",
        f"| claim + complete, {CLIENTS} clients | p50 ms | p99 ms | samples |",
        "| --- | ---: | ---: | ---: |",
        row("before the reaper", before),
        row("while the reaper ran", during),
        "",
        f"Storage: {size / count:,.0f} bytes per key with a {len(BODY)}-byte stored body "
        f"(heap {heap / count:,.0f}, indexes and TOAST the rest), {count:,} keys.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds between batches")
    args = parser.parse_args()
    database = LocalPostgres(
        Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-")) / "data", keep_data=False
    )
    dsn = os.environ.get("DATABASE_URL") or database.start()
    try:
        lines = asyncio.run(run(dsn, args.rows, args.samples, args.pause))
    finally:
        database.stop()
    text = "\n".join(lines)
    print(text)
    (HERE / "scale.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
