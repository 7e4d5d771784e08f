"""Maintenance where the key table is distributed by Citus (see _sql/upkeep.py): the same
bounded batches as on one server, found tenant by tenant.

A run reads which tenants have work (one statement over every shard, taking no lock), then
runs the one-server statement for each of them with the tenant pinned, routed whole to its
shard: `FOR UPDATE SKIP LOCKED` and the re-checks work there as they do on one server. A run
never does more than `batch_size` rows in all, as on one server.
"""

from __future__ import annotations

from typing import Any

from . import _sql as sql
from ._database import Database, rows_in


async def reap(db: Database, batch_size: int) -> int:
    done = 0
    for row in await db.call("fetch", sql.REAP_TENANTS, batch_size):
        if done >= batch_size:
            break
        done += rows_in(await db.call("execute", sql.REAP_TENANT, batch_size - done, row[0]))
    return done


async def sweep(db: Database, batch_size: int, grace_seconds: float) -> list[dict[str, Any]]:
    swept: list[dict[str, Any]] = []
    for row in await db.call("fetch", sql.SWEEP_TENANTS, batch_size, grace_seconds):
        if len(swept) >= batch_size:
            break
        rows = await db.call(
            "fetch", sql.SWEEP_TENANT, batch_size - len(swept), grace_seconds, row[0]
        )
        swept.extend(dict(found) for found in rows)
    return swept


async def forget_leases(db: Database, batch_size: int, grace_seconds: float) -> int:
    done = 0
    for row in await db.call("fetch", sql.FORGET_TENANTS, batch_size, grace_seconds):
        if done >= batch_size:
            break
        status = await db.call(
            "execute", sql.FORGET_TENANT, batch_size - done, grace_seconds, row[0]
        )
        done += rows_in(status)
    return done


async def reap_processed(db: Database, batch_size: int, retention_seconds: float) -> int:
    return await db.count(sql.REAP_PROCESSED_SPREAD, batch_size, retention_seconds)


async def table_bytes(db: Database) -> int:
    size: int = await db.call("fetchval", sql.TABLE_BYTES_SPREAD)
    return size
