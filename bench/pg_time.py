"""`python -m bench.pg_time`: PostgreSQL's time per request, statement by statement, the
statements run inside the store's functions included, per mode.

bench/app.py's app is called in this process as `bench.inprocess` calls it (ten requests at
once unless `--at-once` says otherwise, a new key each); pg_stat_statements, with `track =
all` and `track_planning = on`, counts the time every statement spent executing and being
planned (wall time, its waits for locks included, not CPU), and each figure is divided by the
requests. A statement inside a function (the record's INSERT, the completion's UPDATE) is
listed apart and is part of its caller's figure too. The key table's updates, and how many
of them were HOT (the new row version on the same page, no index entry made), come after.

    python -m bench.pg_time [--modes tx,inline-tx] [--requests 3000] [--drop-indexes]
                            [--at-once 10]

`--drop-indexes` drops the key table's two partial indexes first (the reaper's and the
sweeper's): the most any change of them could save the requests, since nothing then reads
them. Measurement only, on a throwaway server.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import asyncpg
import uvloop

from bench import inprocess, statements

_SETTINGS = (
    "ALTER SYSTEM SET pg_stat_statements.track = 'all'",
    "ALTER SYSTEM SET pg_stat_statements.track_planning = on",
    "SELECT pg_reload_conf()",
)
_DROP = (
    "DROP INDEX idempotency_keys_expired_idx",
    "DROP INDEX idempotency_keys_in_flight_idx",
)
_READ = """
SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 72) AS query, calls,
       total_exec_time, total_plan_time
FROM pg_stat_statements
WHERE query !~* 'pg_stat_statements|pg_stat_user_tables'
ORDER BY total_exec_time + total_plan_time DESC
LIMIT $1
"""
#: The key table, and the hand-written floor's (bench/app.py).
_TABLES = ("idempotency_keys", "bench_inline_keys")
_RESET_TABLE = "SELECT pg_stat_reset_single_table_counters($1::regclass)"
_UPDATED = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = $1"


async def _execute(dsn: str, queries: tuple[str, ...]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for query in queries:
            await conn.execute(query)
    finally:
        await conn.close()


async def _measure(mode: str, dsn: str, requests: int, top: int, at_once: int) -> None:
    from bench.app import create_app

    conn = await asyncpg.connect(dsn)
    try:
        for table in _TABLES:
            await conn.execute(_RESET_TABLE, table)
        app = create_app(mode, dsn)
        stop = await inprocess._started(app)
        try:

            async def worker(count: int) -> None:
                for _ in range(count):
                    await inprocess._request(app)

            await asyncio.gather(*(worker(30) for _ in range(at_once)))  # warm
            await conn.execute("SELECT pg_stat_statements_reset()")
            each = requests // at_once
            await asyncio.gather(*(worker(each) for _ in range(at_once)))
            done = each * at_once
            rows = await conn.fetch(_READ, top)
        finally:
            await stop()  # its connections close, and their table statistics are flushed
        await asyncio.sleep(0.5)
        updated: list[Any] = [await conn.fetchrow(_UPDATED, table) for table in _TABLES]
    finally:
        await conn.close()
    print(f"\n{mode}: µs per request, one run of {done} requests")
    print("| executing | planning | calls | statement |")
    print("| ---: | ---: | ---: | --- |")
    for row in rows:
        print(
            f"| {1000 * row['total_exec_time'] / done:.1f} "
            f"| {1000 * row['total_plan_time'] / done:.1f} "
            f"| {row['calls'] / done:.2f} | `{row['query']}` |"
        )
    for table, (rows_updated, hot) in zip(_TABLES, updated, strict=True):
        if rows_updated:
            print(f"{table}, warm-up included: {rows_updated} rows updated, {hot} of them HOT")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="tx,inline-tx")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--drop-indexes", action="store_true")
    parser.add_argument("--at-once", type=int, default=inprocess.AT_ONCE, help="requests in flight")
    args = parser.parse_args()
    from bench.__main__ import statistics_server

    with statistics_server() as dsn:
        if not asyncio.run(statements.enable(dsn)):
            raise SystemExit("pg_stat_statements is not loaded in this server")
        asyncio.run(_execute(dsn, _SETTINGS))
        if args.drop_indexes:
            asyncio.run(_execute(dsn, _DROP))
        for mode in args.modes.split(","):
            uvloop.run(_measure(mode, dsn, args.requests, args.top, args.at_once))


if __name__ == "__main__":
    main()
