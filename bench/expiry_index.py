"""`python -m bench.expiry_index`: what the key table's expiry index costs an atomic new key.

The index is dropped and created again between runs of `bench.cpu`'s measurement (atomic
mode, new keys), `--rounds` times each, on one throwaway PostgreSQL: dropping it is the most
any change of it could save. Prints each run's throughput and CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import asyncpg

from bench import statements
from bench.__main__ import statistics_server
from bench.cpu import measure

DROP = "DROP INDEX IF EXISTS idempotency_keys_expired_idx"
CREATE = (
    "CREATE INDEX IF NOT EXISTS idempotency_keys_expired_idx"
    " ON idempotency_keys (expires_at) WHERE state = 'completed'"
)


async def _run(dsn: str, statement: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--warmup", type=float, default=2)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.profile = args.native = False
    with statistics_server() as dsn:
        asyncio.run(statements.enable(dsn))
        log = Path(tempfile.mkdtemp(prefix="bench-index-")) / "server.log"
        variants = [("with the index", CREATE), ("without", DROP)]
        for round_ in range(args.rounds):
            # Each round in the other order: the table grows, and vacuum comes, as it runs.
            for name, statement in variants if round_ % 2 == 0 else variants[::-1]:
                asyncio.run(_run(dsn, statement))
                row = measure("atomic", "new_keys.lua", dsn, args, log)
                print(
                    f"{round_} {name:14} {row.requests_per_second:7,.0f} req/s, server "
                    f"{row.server_us:4.0f} µs, PostgreSQL {row.postgres_us:4.0f} µs",
                    flush=True,
                )


if __name__ == "__main__":
    main()
