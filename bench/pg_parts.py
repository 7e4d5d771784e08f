"""`python -m bench.pg_parts`: where the atomic mode's PostgreSQL time per new key goes, part
by part, beside the hand-written transaction's.

No HTTP and no middleware: ten connections run the store's own statements for a new key as
the atomic mode sends them (BEGIN and the claim; the handler's INSERT; the record, COMMIT,
the locks and the reset), and each variant takes one part away or swaps it for what the
hand-written transaction does in its place. Every PostgreSQL process's CPU time (from /proc)
is divided by the keys run. The variants are measurement only: their functions are made from
the installed ones, in this throwaway server.

    python -m bench.pg_parts [--rounds 3] [--seconds 4]

- `hand`: bench/app.py's hand-written transaction (pool reset included, as asyncpg's pool
  runs it);
- `store`: the store's statements as they are;
- `asyncpg-reset`: asyncpg's pool reset (four statements) in place of the store's (seven,
  after the locks);
- `no-marks`: the claim without the run's two marks, the record without their check;
- `xact-locks`: the locks the transaction's own (let go of by its COMMIT) and no unlock;
- `narrow-row`: the record into the hand-written table (four columns, its primary key
  alone) in place of the key table's row (sixteen columns, two indexes, two checks);
- `prepared`: the claim and the record sent as prepared statements (parsed and planned once
  per connection, their values bound) in round trips of their own, in place of calls
  written out in the simple queries (parsed and planned on every request);
- `all-of-these`: `asyncpg-reset`, `xact-locks` and `narrow-row` together;
- `record-inline`: the record's INSERT written out in the COMMIT's simple query in place of
  the call of the record function (without the function's check of the run's mark): what a
  PL/pgSQL call costs around the one statement it runs;
- `execute`: the claim and the record prepared once per connection (SQL `PREPARE`), and
  run by `EXECUTE` in the same simple queries as the calls they replace: planned once, with
  no round trip more;
- `claim-inline`: a new key's claim written out in BEGIN's simple query in place of the
  call of the claim function: the locks tried in one statement, the key's row read in the
  next (its outcome as its row count), the marks set; what the function costs around them.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

from bench.app import INLINE_LOCK, INLINE_READ, INLINE_RECORD, INSERT
from bench.cpu import postgres_ns, postmaster_of, spent
from idempotency_asgi._postgres.sql import onecommit as short
from idempotency_asgi._postgres.sql.literals import literal
from idempotency_asgi._postgres.sql.session import reset_unlocking
from idempotency_asgi._records import FORMAT_VERSION, encode_headers

#: What asyncpg's pool runs on a connection given back (as the hand-written code's is).
POOL_RESET = "SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL;"
HEADERS = encode_headers([(b"content-type", b"application/json"), (b"content-length", b"32")])
ANSWER = b'{"id":12345,"status":"accepted"}'
PAYLOAD = b'{"amount": 100}'
CONNECTIONS = 10
#: The `execute` variant's statements, prepared once per connection by SQL.
EXECUTE_PREPARES = (
    "PREPARE parts_claim(text, text, bytea, bigint, bigint, bigint, text) AS"
    " SELECT FROM generate_series(1, public.idempotency_asgi_claim($1, $2, $3, $4, $5, $6, $7));"
    " PREPARE parts_record(text, text, text, text, bytea, bigint, integer, integer, bytea,"
    " bytea, bigint, boolean, text) AS SELECT public.idempotency_asgi_record($1, $2, $3, $4,"
    " $5, $6, $7, $8, $9, $10, $11, $12, $13)"
)

Run = Callable[[Any], Awaitable[None]]


async def install(dsn: str) -> None:
    """The variants' functions, made from the installed claim and record."""
    conn = await asyncpg.connect(dsn)
    try:
        claim: str = await conn.fetchval(
            "SELECT pg_get_functiondef('idempotency_asgi_claim'::regproc)"
        )
        record: str = await conn.fetchval(
            "SELECT pg_get_functiondef('idempotency_asgi_record'::regproc)"
        )
        marks = claim[claim.index("PERFORM set_config(") :]
        marks = marks[: marks.index(";") + 1]
        unmarked = claim.replace(marks, "NULL;")
        await conn.execute(unmarked.replace("idempotency_asgi_claim(", "parts_claim_unmarked("))
        await conn.execute(
            claim.replace("idempotency_asgi_claim(", "parts_claim_xact(").replace(
                "pg_try_advisory_lock(", "pg_try_advisory_xact_lock("
            )
        )
        start = record.index("INSERT INTO")
        end = record.index(";", record.index("VALUES", start))
        narrow = (
            record[:start]
            + "INSERT INTO bench_inline_keys (idempotency_key, fingerprint, status, body) "
            "VALUES (p_key, p_fingerprint, p_status, p_body)" + record[end:]
        )
        await conn.execute(narrow.replace("idempotency_asgi_record(", "parts_record_narrow("))
    finally:
        await conn.close()


def store(
    *,
    claim: str = "idempotency_asgi_claim",
    record: str = "idempotency_asgi_record",
    marked: bool = True,
    unlock: bool = True,
    reset: str = "store",
    prepared: bool = False,
    inline: tuple[str, ...] = (),
    execute: bool = False,
) -> Run:
    """A new key as the atomic mode runs it, with the parts named swapped."""
    ready: set[tuple[int, int]] = set()  # (object, backend): a closed one's id comes back

    async def run(conn: Any) -> None:
        if execute and (id(conn), conn.get_server_pid()) not in ready:
            await conn.execute(EXECUTE_PREPARES)
            ready.add((id(conn), conn.get_server_pid()))
        key = f"key-{random.getrandbits(64):x}"
        fingerprint = hashlib.sha256(key.encode()).digest()
        key_lock, request_lock, mark = (random.getrandbits(62) for _ in range(3))
        begin = short.claim(
            "public",
            "BEGIN",
            tenant="bench",
            key=key,
            fingerprint=fingerprint,
            key_lock=key_lock,
            request_lock=request_lock,
            bound=None,
            run=mark,
        )
        if prepared:  # BEGIN, then the same call as a prepared statement: a round trip more
            await conn.execute("BEGIN")
            found = await conn.fetchval(
                f"SELECT {claim}($1, $2, $3, $4, $5, $6, $7)",
                "bench",
                key,
                fingerprint,
                key_lock,
                request_lock,
                None,
                str(mark),
            )
            status = f"SELECT {found}"
        elif "claim" in inline:
            lit = literal
            status = await conn.execute(
                f"BEGIN; SELECT pg_try_advisory_lock({request_lock}),"
                f" pg_try_advisory_lock({key_lock});"
                f" SELECT set_config('idempotency_asgi.txn', '{mark}', true),"
                f" set_config('idempotency_asgi.run', '{mark}', false);"
                " SELECT FROM generate_series(1, 1) WHERE NOT EXISTS (SELECT FROM"
                f" public.idempotency_keys WHERE tenant_id = 'bench' AND idempotency_key ="
                f" {lit(key)} AND fingerprint = {lit(fingerprint)})"
            )
        elif execute:
            values = ", ".join(
                map(literal, ("bench", key, fingerprint, key_lock, request_lock, None, str(mark)))
            )
            status = await conn.execute(f"BEGIN; EXECUTE parts_claim({values})")
        else:
            status = await conn.execute(begin.replace("idempotency_asgi_claim(", f"{claim}("))
        if status != "SELECT 1":
            raise RuntimeError(f"the claim said {status}")
        await conn.fetchval(INSERT, PAYLOAD)
        args = (
            "bench",
            key,
            "POST",
            "/orders",
            fingerprint,
            mark,
            FORMAT_VERSION,
            201,
            HEADERS,
            ANSWER,
            round(time.time() * 1e6) + 86_400_000_000,
            False,
            str(mark) if marked else None,
        )
        before = short.record("public", key_lock, request_lock, args).before
        if "record" in inline:
            values = ", ".join(map(literal, args[:5]))
            tail = ", ".join(map(literal, args[6:10]))
            before = (
                "INSERT INTO public.idempotency_keys (tenant_id, idempotency_key, method, path,"
                " fingerprint, lease_token, format_version, response_status, response_headers,"
                " response_body, state, lease_expires_at, created_at, completed_at, expires_at)"
                f" VALUES ({values}, {int(args[5])}, {tail}, 'completed', statement_timestamp(),"
                " now(), statement_timestamp(), timestamptz 'epoch' +"
                f" {int(args[10])} * interval '1 microsecond'); "
            )
        if prepared:
            placeholders = ", ".join(f"${n}" for n in range(1, len(args) + 1))
            await conn.execute(f"SELECT {record}({placeholders})", *args)
            before = ""
        if execute:
            before = f"EXECUTE parts_record({', '.join(map(literal, args))}); "
        if reset == "store":
            after = reset_unlocking(*((key_lock, request_lock) if unlock else ()))
        else:
            unlocks = f"SELECT pg_advisory_unlock({key_lock}), pg_advisory_unlock({request_lock}); "
            after = (unlocks if unlock else "") + POOL_RESET
        await conn.execute(
            before.replace("idempotency_asgi_record(", f"{record}(") + "COMMIT; " + after
        )

    return run


async def hand(conn: Any) -> None:
    """bench/app.py's hand-written transaction, and the pool's reset after it."""
    key = f"key-{random.getrandbits(64):x}"
    fingerprint = hashlib.sha256(key.encode()).digest()
    tx = conn.transaction()
    await tx.start()
    if not await conn.fetchval(INLINE_LOCK, key):
        raise RuntimeError("the lock was taken")
    await conn.fetchrow(INLINE_READ, key)
    await conn.fetchval(INSERT, PAYLOAD)
    await conn.execute(INLINE_RECORD, key, fingerprint, 201, ANSWER)
    await tx.commit()
    await conn.execute(POOL_RESET)


VARIANTS: dict[str, Run] = {
    "hand": hand,
    "store": store(),
    "asyncpg-reset": store(reset="asyncpg"),
    "no-marks": store(claim="parts_claim_unmarked", marked=False),
    "xact-locks": store(claim="parts_claim_xact", unlock=False),
    "narrow-row": store(record="parts_record_narrow"),
    "prepared": store(prepared=True),
    "record-inline": store(inline=("record",)),
    "claim-inline": store(inline=("claim",)),
    "execute": store(execute=True),
    "all-of-these": store(
        claim="parts_claim_xact",
        record="parts_record_narrow",
        marked=True,
        unlock=False,
        reset="asyncpg",
    ),
}


async def measure(dsn: str, run: Run, seconds: float, postmaster: int) -> float:
    """PostgreSQL's µs per key, `CONNECTIONS` running keys for `seconds`."""
    conns = [await asyncpg.connect(dsn) for _ in range(CONNECTIONS)]
    try:
        await asyncio.gather(*(run(conn) for conn in conns))  # plans and caches made
        done = 0
        until = time.monotonic() + seconds

        async def keep_running(conn: Any) -> None:
            nonlocal done
            while time.monotonic() < until:
                await run(conn)
                done += 1

        before = postgres_ns(postmaster)
        await asyncio.gather(*(keep_running(conn) for conn in conns))
        after = postgres_ns(postmaster)
    finally:
        for conn in conns:
            await conn.close()
    return spent(before, after) / 1000 / done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    from bench.__main__ import prepare
    from examples.local_postgres import LocalPostgres

    database = LocalPostgres(
        Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-")) / "data", keep_data=False
    )
    names = args.variants.split(",")
    seen: dict[str, list[float]] = {name: [] for name in names}
    try:
        dsn = database.start()
        asyncio.run(prepare(dsn))
        asyncio.run(install(dsn))
        postmaster = postmaster_of(dsn)
        for _ in range(args.rounds):
            for name in names:  # the variants take turns: drift reaches each alike
                figure = asyncio.run(measure(dsn, VARIANTS[name], args.seconds, postmaster))
                seen[name].append(figure)
                print(f"{name:>14}: {figure:6.1f} µs", flush=True)
    finally:
        database.stop()
    hand_us = statistics.median(seen["hand"]) if "hand" in seen else None
    print(f"\nPostgreSQL CPU per new key, µs (median of {args.rounds})")
    print("| variant | µs | against hand-written |")
    print("| --- | ---: | ---: |")
    for name in names:
        figure = statistics.median(seen[name])
        against = f"{figure / hand_us:.2f}x" if hand_us else ""
        print(f"| {name} | {figure:.1f} | {against} |")


if __name__ == "__main__":
    main()
