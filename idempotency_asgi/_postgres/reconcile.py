"""Reconciliation, the store's side: keys held for an operator, listed, settled with the answer
a provider confirmed, or released (see sql/reconcile.py for the statements, and
docs/reconciling.md for the workflow).

An operator's change is a look and then a compare-and-set: the look (`INSPECT`) says what the
key is, and refuses a key with no record, a completed one (unless asked) and one whose
request still runs under a live lease; the change itself tries the key's advisory locks and
writes only while the row is still the one looked at. A row that changed in between (a retry
took it over, its answer was recorded) is looked at again, a few times.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .._errors import KeyCompleted, KeyNotFound, KeyRunning
from .._records import (
    FORMAT_VERSION,
    HeldKey,
    HeldReason,
    Lease,
    Reconciled,
    StoredResponse,
    encode_headers,
)
from .._reporting import count_reconciliation, key_hash
from . import sql
from .claiming import new_token
from .database import Database
from .keyhash import key_lock, request_lock

logger = logging.getLogger("idempotency_asgi.maintenance")

#: Looks at a key whose row changed between the look and the change, before giving up (a
#: key taken over and recorded again and again by retries is running, for all purposes).
ATTEMPTS = 3

#: What a key was, when it had a recorded answer.
COMPLETED = "completed"

#: A change: given the token the look read and the request's and the key's locks, runs the
#: statement and answers whether the locks were free and what was written (None: nothing).
Change = Callable[[int, int, int], Awaitable[tuple[bool, Any]]]


class Reconciliation:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def hold(self, lease: Lease, reason: HeldReason) -> bool:
        """Hold the lease's key in flight for an operator, `lease.seconds` from now, saying
        why; False when the lease no longer holds it."""
        args = (lease.tenant, lease.key, lease.token, reason.value, lease.seconds)
        return await self._db.count(sql.HOLD_LEASE, *args) == 1

    async def held(self, *, tenant: str | None, older_than: float, limit: int) -> list[HeldKey]:
        if tenant is None:
            rows = await self._db.call("fetch", sql.HELD, limit, older_than)
        else:
            rows = await self._db.call("fetch", sql.HELD_TENANT, tenant, limit, older_than)
        return [
            HeldKey(
                tenant=row["tenant_id"],
                key=row["idempotency_key"],
                method=row["method"],
                path=row["path"],
                since=row["created_at"],
                reason=row["reason"],
                until=row["held_until"],
            )
            for row in rows
        ]

    async def settle(
        self,
        *,
        tenant: str,
        key: str,
        response: StoredResponse,
        ttl_seconds: float | None,
        replace: bool,
    ) -> Reconciled:
        async def change(token: int, request: int, key_id: int) -> tuple[bool, Any]:
            row = await self._db.call(
                "fetchrow",
                sql.SETTLE,
                tenant,
                key,
                token,
                request,
                key_id,
                new_token(),
                response.status,
                encode_headers(response.headers),
                response.body,
                ttl_seconds,
                FORMAT_VERSION,
                replace,
            )
            return bool(row["free"]), row["expires_at"]

        previous, expires_at = await self._change(tenant, key, replace, change)
        done = Reconciled(tenant, key, previous, COMPLETED, expires_at)
        logger.warning(
            "operator settled tenant=%s key_hash=%s from=%s to=completed status=%d expires_at=%s",
            tenant,
            key_hash(key),
            previous,
            response.status,
            expires_at.isoformat(),
        )
        count_reconciliation("settle", previous)
        return done

    async def release(self, *, tenant: str, key: str, completed: bool) -> Reconciled:
        async def change(token: int, request: int, key_id: int) -> tuple[bool, Any]:
            row = await self._db.call(
                "fetchrow", sql.RELEASE_KEY, tenant, key, token, request, key_id, completed
            )
            return bool(row["free"]), True if row["released"] else None

        previous, _ = await self._change(tenant, key, completed, change)
        logger.warning(
            "operator released tenant=%s key_hash=%s from=%s to=released",
            tenant,
            key_hash(key),
            previous,
        )
        count_reconciliation("release", previous)
        return Reconciled(tenant, key, previous, "released")

    async def _change(
        self, tenant: str, key: str, completed: bool, change: Change
    ) -> tuple[str, Any]:
        """Look at the key, refuse it or `change` it; again if it changed in between. Returns
        what the key was, and what `change` wrote."""
        for attempt in range(ATTEMPTS):
            row = await self._db.call("fetchrow", sql.INSPECT, tenant, key)
            if row is None:
                if await locked_by_transaction(self._db, tenant, key):
                    raise KeyRunning(
                        "a request is running it (its transaction holds the key)",
                        tenant=tenant,
                        key=key,
                    )
                raise KeyNotFound("no such key", tenant=tenant, key=key)
            previous = _what(row)
            if previous == COMPLETED and not completed:
                raise KeyCompleted(
                    f"it has an answer already ({row['response_status']}, recorded"
                    f" {row['completed_at'].isoformat()})",
                    tenant=tenant,
                    key=key,
                )
            if previous is None:
                raise KeyRunning(
                    f"its request is running (its lease is live until"
                    f" {row['lease_expires_at'].isoformat()})",
                    tenant=tenant,
                    key=key,
                )
            request = request_lock(tenant, key, bytes.fromhex(row["fingerprint"]))
            free, written = await change(row["lease_token"], request, key_lock(tenant, key))
            if not free:
                raise KeyRunning(
                    "a request is running it (its transaction holds the key)",
                    tenant=tenant,
                    key=key,
                )
            if written is not None:
                return previous, written
            # The row changed since the look, or a transaction holds it (its answer being
            # recorded): look again, after a moment.
            await asyncio.sleep(0.05 * (attempt + 1))
        raise KeyRunning(
            "its record kept changing (retries are running it); try again",
            tenant=tenant,
            key=key,
        )


def _what(row: Any) -> str | None:
    """What an operator may change the key from: "completed", why it is held (a HeldReason
    value), or None while its request runs under a live lease."""
    if row["state"] == COMPLETED:
        return COMPLETED
    if row["held_reason"] is not None:
        return str(row["held_reason"])
    if not row["lease_live"]:
        return HeldReason.LEASE_LAPSED.value
    return None


async def locked_by_transaction(db: Database, tenant: str, key: str) -> bool:
    """Whether a transaction holds the key's advisory lock (an atomic request running a key
    that has no row yet). On one server read from pg_locks, never tried (a try would hold it
    for a moment, and a request trying it then would be told 409); on Citus tried, on the
    worker that holds the tenant's shard, where the lock lives."""
    lock = key_lock(tenant, key)
    if await db.spread():
        return not await db.call("fetchval", sql.LOCK_FREE, tenant, key, lock, None)
    return bool(await db.call("fetchval", sql.KEY_LOCKED, lock))


#: Headers an operator's answer may not carry: they belong to one connection, or frame a body
#: the replay sends whole, or are derived from the record when it is replayed.
REFUSED_HEADERS = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"idempotency-key-expires"}
)


def answer(
    status: int, headers: Sequence[tuple[str | bytes, str | bytes]], body: bytes
) -> StoredResponse:
    """An operator's answer as the middleware stores a handler's: header names lowercased
    (ASGI's form), values as latin-1 bytes, a `content-length` for the body. A ValueError
    for one that could not be replayed as given."""
    if not 200 <= status <= 499:
        # What the middleware itself records: a 5xx is never an answer (release the key for
        # the retry to run instead), and a 1xx is not a final one.
        raise ValueError(f"status must be from 200 to 499, not {status}")
    found: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        raw_name = (name if isinstance(name, bytes) else name.encode("latin-1")).lower()
        raw_value = value if isinstance(value, bytes) else value.encode("latin-1")
        if not _TOKEN.fullmatch(raw_name):
            raise ValueError(f"not a header name: {raw_name!r}")
        if any(c in (0, 10, 13) for c in raw_value):
            raise ValueError(f"header {raw_name!r}: a value may not hold CR, LF or NUL")
        if raw_name in REFUSED_HEADERS:
            raise ValueError(f"header {raw_name!r} cannot be part of a stored answer")
        if raw_name == b"content-length" and raw_value.strip() != str(len(body)).encode():
            raise ValueError(f"content-length {raw_value!r} is not the body's {len(body)} bytes")
        found.append((raw_name, raw_value))
    if not any(name == b"content-length" for name, _ in found):
        found.append((b"content-length", str(len(body)).encode()))
    return StoredResponse(status, found, body)


_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+")
