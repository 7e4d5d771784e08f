"""Statements per request, by outcome, as PostgreSQL itself counts them (pg_stat_statements).

Each outcome is staged against the served app after a warm-up: N new keys, N replays of one
completed key, N duplicates of a request held in flight (x-delay-ms), N bare requests. The
counters are reset before and read after; the count includes everything the request made
PostgreSQL do: the store's statements, the handler's, BEGIN/COMMIT, and a pool's session
reset (four statements sent in one round trip).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import asyncpg
import httpx

_BODY = b'{"sku":"A-1","quantity":2}'
_READ = """
SELECT query, calls FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query !~* 'pg_stat_statements'
ORDER BY calls DESC
"""

#: outcome -> the served mode it is staged on
OUTCOMES = {
    "bare": "bare",
    "new, plain": "plain",
    "new, transactional": "tx",
    "replay": "tx",
    "conflict (409)": "tx",
    "new, atomic": "atomic",
    "replay, atomic": "atomic",
    "conflict (409), atomic": "atomic",
    "new, hand-written, one transaction": "inline-atomic",
}


@dataclass
class Count:
    outcome: str
    per_request: float
    statements: list[tuple[str, float]] = field(default_factory=list)
    #: write transactions per request (each with its own COMMIT)
    writes: float = 0.0


async def enable(dsn: str) -> bool:
    """Whether pg_stat_statements can be used here (preloaded, extension creatable)."""
    conn = await asyncpg.connect(dsn)
    try:
        if "pg_stat_statements" not in await conn.fetchval("SHOW shared_preload_libraries"):
            return False
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        return True
    finally:
        await conn.close()


#: What each of the store's statements is, by a phrase only it holds (its one-row form and
#: its batched form alike): a claim (the other modes'), a first look (the atomic mode's),
#: a completion, the atomic mode's record.
KINDS = {
    "claim": "inserted AS (",
    "look": "'absent'",
    "completion": "SET state = 'completed'",
    "record": "INSERT INTO idempotency_keys AS k",
}

#: The next transaction id, read without taking one: its advance is the number of write
#: transactions committed or begun meanwhile.
_NEXT_XID = "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"


async def reset(dsn: str) -> int:
    """Start counting; returns the next transaction id, for `per_request`."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SELECT pg_stat_statements_reset()")
        xid: int = await conn.fetchval(_NEXT_XID)
        return xid
    finally:
        await conn.close()


async def per_request(dsn: str, requests: int, since_xid: int = 0) -> dict[str, float]:
    """Statements run since `reset`, per request served meanwhile: the store's claims, looks,
    completions and records (one-row and batched), all of them, and the write transactions
    (`writes`, when `since_xid`, what `reset` returned, is given)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(_READ)
        xid = await conn.fetchval(_NEXT_XID)
    finally:
        await conn.close()
    found = {kind: 0 for kind in KINDS}
    for row in rows:
        for kind, phrase in KINDS.items():
            if phrase in row["query"]:
                found[kind] += row["calls"]
    counts = {kind: calls / requests for kind, calls in found.items()}
    counts["all"] = sum(row["calls"] for row in rows) / requests
    if since_xid:
        counts["writes"] = (xid - since_xid) / requests
    return counts


async def count(dsn: str, url: str, outcome: str, requests: int = 100) -> Count:
    run = uuid.uuid4().hex[:8]
    expected = 409 if outcome.startswith("conflict") else 201
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        held: asyncio.Task[httpx.Response] | None = None
        if outcome.startswith(("replay", "conflict")):
            key = f"{run}-one"
            if outcome.startswith("replay"):
                await _post(http, key, expect=201)
            else:
                # In flight for 4 s; the counted duplicates take well under one, and its lease
                # is renewed only after a third of its 10 s.
                held = asyncio.create_task(_post(http, key, expect=201, delay_ms=4000))
                await asyncio.sleep(0.5)

            def keys(n: int) -> list[str]:
                return [key] * n
        else:

            def keys(n: int) -> list[str]:
                return [f"{run}-{uuid.uuid4().hex}" for _ in range(n)]

        conn = await asyncpg.connect(dsn)
        try:
            for key in keys(20):  # warm-up: prepared statements, pooled connections
                await _post(http, key, expect=expected)
            await conn.execute("SELECT pg_stat_statements_reset()")
            before = await conn.fetchval(_NEXT_XID)
            for key in keys(requests):
                await _post(http, key, expect=expected)
            rows = await conn.fetch(_READ)
            after = await conn.fetchval(_NEXT_XID)
        finally:
            await conn.close()
        if held is not None:
            await held
    total = sum(row["calls"] for row in rows)
    return Count(
        outcome,
        total / requests,
        [
            (name(row["query"]), row["calls"] / requests)
            for row in rows
            if "pg_snapshot_xmax" not in row["query"]  # the count's own read of the xid
        ],
        (after - before) / requests,
    )


async def _post(
    http: httpx.AsyncClient, key: str, *, expect: int, delay_ms: int = 0
) -> httpx.Response:
    headers = {"content-type": "application/json", "idempotency-key": key}
    if delay_ms:
        headers["x-delay-ms"] = str(delay_ms)
    answer = await http.post("/orders", content=_BODY, headers=headers)
    if answer.status_code != expect:
        raise RuntimeError(f"expected {expect}, got {answer.status_code}: {answer.text}")
    return answer


def name(query: str) -> str:
    """A short name for a statement: what it is for, or its first words. Read from the text
    pg_stat_statements keeps, whose constants are placeholders: only names and keywords
    tell the store's statements apart."""
    text = " ".join(query.split())
    for function, what in (
        ("idempotency_asgi_claim(", "BEGIN and the claim (one call)"),
        ("idempotency_asgi_record(", "the record (one call)"),
        ("idempotency_asgi_complete(", "the completion (one call)"),
    ):
        if function in text:
            return what
    if text.startswith("SELECT pg_advisory_unlock($1), pg_advisory_unlock("):
        return "the locks let go of"
    if "idempotency_keys" in text:
        batched = "unnest(" in text
        for marker, what, many in (
            ("inserted AS (", "claim", "claims"),
            ("free AS (", "first look", "first looks"),
            ("written AS (", "record", "records"),
            ("done AS (", "completion", "completions"),
            ("gone AS (", "release", "releases"),
            ("false AS claimed", "read", "reads"),
            ("INSERT INTO idempotency_leases", "renewal", "renewals"),
        ):
            if marker in text:
                return f"batched {many}" if batched else what
    if "pg_try_advisory_xact_lock(" in text and "CASE WHEN" in text:
        return "the key's lock"
    return " ".join(text.split()[:3]).rstrip(";")
