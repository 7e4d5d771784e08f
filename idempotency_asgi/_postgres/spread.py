"""Maintenance where the key table is distributed by Citus (see sql/upkeep.py): the same
bounded batches as on one server, found tenant by tenant.

A run reads which tenants have work (one statement over every shard, taking no lock), then
runs the one-server statement for each of them with the tenant pinned, routed whole to its
shard: `FOR UPDATE SKIP LOCKED` and the re-checks work there as they do on one server. A run
never does more than `batch_size` rows in all, as on one server.
"""

from __future__ import annotations

from typing import Any

from . import sql
from .database import Database


async def reap(db: Database, batch_size: int) -> int:
    return await _counted(db, sql.REAP_TENANTS, sql.REAP_TENANT, batch_size)


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
    return await _counted(db, sql.FORGET_TENANTS, sql.FORGET_TENANT, batch_size, grace_seconds)


async def _counted(db: Database, find: str, each: str, batch_size: int, *args: Any) -> int:
    """`find` the tenants with work ($1: the batch, then `args`), then run `each` for one
    tenant after another (the tenant its last argument) until `batch_size` rows are done."""
    done = 0
    for row in await db.call("fetch", find, batch_size, *args):
        if done >= batch_size:
            break
        done += await db.count(each, batch_size - done, *args, row[0])
    return done


async def reap_processed(db: Database, batch_size: int, retention_seconds: float) -> int:
    return await db.count(sql.REAP_PROCESSED_SPREAD, batch_size, retention_seconds)


async def table_bytes(db: Database) -> int:
    size: int = await db.call("fetchval", sql.TABLE_BYTES_SPREAD)
    return size
