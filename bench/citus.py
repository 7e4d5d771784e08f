"""`python -m bench.citus`: the same load on one PostgreSQL and on a Citus cluster (a
coordinator and two workers, all on this machine), and what the coordinator's hop costs.

Both are started here from the embedded PostgreSQL 18 with the same settings (fsync off: what
is compared is the statements' path, not the disk); the cluster is tests/citus_cluster.py's,
its schema distributed by `idempotency-asgi migrate --distribute`, and the tests' app
(tests/apps.py) serves in each mode with uvicorn (one worker). Three measurements:

1. HTTP: wrk, new keys spread over 64 tenants (bench/citus_new_keys.lua), in the plain,
   two-phase and atomic modes: requests/s, p50, p99.
2. One statement, one at a time (a replay's whole cost: PEEK), on one PostgreSQL, through
   the coordinator, and on the worker itself against the shard: the hop is the difference.
3. Batching: 32 rows of 32 tenants in one array statement (PEEK_MANY) against the same 32 as
   one-row statements (one at a time, and four at once): what a batch across shards costs.

Prints a table and writes bench/citus.md and bench/citus.json. Needs the Citus build beside
the checkout (see tests/citus_cluster.py).

    python -m bench.citus [--seconds 8] [--connections 16]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from bench.__main__ import run_wrk, stop, wait_http
from idempotency_asgi._postgres import sql
from idempotency_asgi._postgres.keyhash import key_lock, request_lock
from tests.citus_cluster import available, distributed, running_cluster
from tests.server import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = {"plain": "/plain/charge", "two-phase": "/tx/charge", "atomic": "/tx/charge"}
FINGERPRINT = hashlib.sha256(b"bench").digest()
PLAIN_EFFECTS = """
CREATE TABLE effects (
    id bigserial, tenant text NOT NULL, idempotency_key text, path text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (tenant, id)
)"""


def serve(dsn: str, mode: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": dsn,
        "TEST_APP_SERVE": "1",
        "TEST_STORE_OPTIONS": json.dumps({"min_size": 10, "max_size": 10}),
        "TEST_APP_OPTIONS": json.dumps({"atomic": mode == "atomic"}),
    }
    process = subprocess.Popen(
        [
            sys.executable, "-m", "uvicorn", "tests.apps:app", "--port", str(port),
            "--workers", "1", "--loop", "uvloop",
            "--no-access-log", "--log-level", "warning",
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/read")
    return process, url


def http_rows(dsn: str, seconds: float, connections: int) -> dict[str, dict[str, float]]:
    rows = {}
    for mode, path in MODES.items():
        process, url = serve(dsn, mode)
        try:
            run_wrk(
                url + path, "citus_new_keys.lua", 2, connections, f"w{uuid.uuid4().hex[:6]}", path
            )
            rows[mode] = run_wrk(
                url + path, "citus_new_keys.lua", seconds, connections,
                f"r{uuid.uuid4().hex[:6]}", path,
            )  # fmt: skip
        finally:
            stop(process)
    return rows


async def timed(call: Any, repeat: int) -> float:
    """Median milliseconds of `await call()`."""
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def peek_args(tenant: str, key: str) -> tuple[Any, ...]:
    return (
        tenant, key, FINGERPRINT, key_lock(tenant, key), request_lock(tenant, key, FINGERPRINT)
    )  # fmt: skip


async def hop(single: str, coordinator: str, worker_url: str, repeat: int) -> dict[str, float]:
    """A replay's one statement (PEEK), one at a time."""
    found: dict[str, float] = {}
    args = peek_args("tenant-1", "missing")
    for name, url in (("one PostgreSQL", single), ("Citus coordinator", coordinator)):
        conn = await asyncpg.connect(url)
        try:
            found[name] = await timed(lambda c=conn: c.fetch(sql.PEEK, *args), repeat)
        finally:
            await conn.close()
    # The same on the worker that holds tenant-1's shard, against the shard itself.
    conn = await asyncpg.connect(coordinator)
    try:
        shard = await conn.fetchval(
            "SELECT shard_name('idempotency_keys'::regclass,"
            " get_shard_id_for_distribution_column('idempotency_keys', 'tenant-1'::text))"
        )
        leases = await conn.fetchval(
            "SELECT shard_name('idempotency_leases'::regclass,"
            " get_shard_id_for_distribution_column('idempotency_leases', 'tenant-1'::text))"
        )
        port = await conn.fetchval(
            "SELECT n.nodeport FROM pg_dist_placement AS p JOIN pg_dist_node AS n"
            " USING (groupid) WHERE p.shardid ="
            " get_shard_id_for_distribution_column('idempotency_keys', 'tenant-1'::text)"
        )
    finally:
        await conn.close()
    direct = await asyncpg.connect(worker_url.replace("PORT", str(port)))
    try:
        text = sql.qualified(sql.PEEK, shard, leases)
        found["the worker, on its shard"] = await timed(lambda: direct.fetch(text, *args), repeat)
    finally:
        await direct.close()
    return found


async def batching(url: str, repeat: int) -> dict[str, float | None]:
    """32 first looks of 32 tenants: one array statement, or one statement each."""
    tenants = [f"tenant-{n}" for n in range(32)]
    rows = [peek_args(t, f"k-{n}") for n, t in enumerate(tenants)]
    columns = [list(column) for column in zip(*rows, strict=True)]
    pool = await asyncpg.create_pool(url, min_size=4, max_size=4)
    tenant_ids, keys = [row[0] for row in rows], [row[1] for row in rows]
    try:
        try:
            many: float | None = await timed(lambda: pool.fetch(sql.PEEK_MANY, *columns), repeat)
        except asyncpg.FeatureNotSupportedError:
            many = None  # Citus: "cannot push down this subquery" (a LATERAL ... LIMIT 1)
        # What any statement over several tenants' rows costs there: the 32 rows read by one
        # plain SELECT (on Citus, a task per shard the tenants fall in, run in parallel).
        spanning = await timed(
            lambda: pool.fetch(
                "SELECT tenant_id, idempotency_key, state FROM idempotency_keys"
                " WHERE tenant_id = ANY($1::text[]) AND idempotency_key = ANY($2::text[])",
                tenant_ids,
                keys,
            ),
            repeat,
        )

        async def each() -> None:
            for row in rows:
                await pool.fetch(sql.PEEK, *row)

        async def four_at_once() -> None:
            await asyncio.gather(*(pool.fetch(sql.PEEK, *row) for row in rows))

        one_by_one = await timed(each, max(1, repeat // 8))
        gathered = await timed(four_at_once, max(1, repeat // 4))
    finally:
        await pool.close()
    return {"one array statement": many, "one SELECT of the 32 rows": spanning,
            "32 one-row, in turn": one_by_one, "32 one-row, 4 connections": gathered}  # fmt: skip


async def prepare_single(url: str) -> None:
    from idempotency_asgi import migrate

    await migrate(url)
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(PLAIN_EFFECTS)
    finally:
        await conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.citus")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=400)
    args = parser.parse_args(argv)
    reason = available()
    if reason:
        print(f"bench.citus: {reason}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"http": {}, "hop": {}, "batching": {}}
    with running_cluster(citus=False) as single, running_cluster() as cluster:
        asyncio.run(prepare_single(single.coordinator))
        distributed(cluster)
        for name, url in (("one PostgreSQL", single.coordinator), ("Citus", cluster.coordinator)):
            results["http"][name] = http_rows(url, args.seconds, args.connections)
        worker_url = "postgresql://postgres@127.0.0.1:PORT/postgres"
        results["hop"] = asyncio.run(
            hop(single.coordinator, cluster.coordinator, worker_url, args.repeat)
        )
        for name, url in (("one PostgreSQL", single.coordinator), ("Citus", cluster.coordinator)):
            results["batching"][name] = asyncio.run(batching(url, args.repeat // 4))
    results["machine"] = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    (HERE / "citus.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results, args)
    (HERE / "citus.md").write_text(text)
    print(text)
    return 0


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "# One PostgreSQL and a Citus cluster, the same load",
        "",
        f"`python -m bench.citus --seconds {args.seconds:g} --connections {args.connections}`"
        f" on {results['machine']}: every server on this one machine (fsync off on all),"
        " the app one uvicorn worker, new keys over 64 tenants.",
        "",
        "| server | mode | requests/s | p50 ms | p99 ms | non-2xx |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for server, rows in results["http"].items():
        for mode, row in rows.items():
            lines.append(
                f"| {server} | {mode} | {row['rps']:.0f} | {row['p50']:.1f} | {row['p99']:.1f}"
                f" | {row['non_2xx']} |"
            )
    lines += ["", "A replay's one statement (PEEK), one at a time, median:", "",
              "| where | ms |", "| --- | ---: |"]  # fmt: skip
    for where, ms in results["hop"].items():
        lines.append(f"| {where} | {ms:.3f} |")
    columns = list(next(iter(results["batching"].values())))
    lines += ["", "32 first looks of 32 tenants, median ms for all 32 (the array statement is"
              " the store's batched PEEK_MANY; refused: Citus will not run it):", "",
              "| server | " + " | ".join(columns) + " |",
              "| --- |" + " ---: |" * len(columns)]  # fmt: skip
    for server, row in results["batching"].items():
        cells = ["refused" if row[c] is None else f"{row[c]:.2f}" for c in columns]
        lines.append(f"| {server} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
