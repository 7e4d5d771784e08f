"""The atomic mode where the key table is distributed by Citus: the same protocol as
atomic.py, with the transaction's own advisory locks in place of the session's.

A session lock taken through a worker would stay with a connection that Citus shares between
sessions, so the locks here are the transaction's, taken on the worker that holds the
tenant's shard (see sql/atomic.LOCK_KEY):

1. A first look (`Claims.peek`, one statement on a connection of the store's): a finished
   record is replayed or answered 422, a key in flight 409.
2. Otherwise the request's transaction begins and tries the key's locks.
3. The key's row is read again once the locks are held (in the transaction at READ
   COMMITTED, on a connection of the store's otherwise: see sql/atomic.READ).
4. The handler runs; its answer is written with the record (RECORD_ROUTED) and committed.

What must outlast a rollback (the hold after OutcomeUnknown, a 4xx recorded apart) is
written on a connection of the store's while the transaction still holds the key: with a
pool passed in rather than a DSN, those statements need a second connection of that pool. A
handler's own COMMIT lets the transaction's locks go before it is found (docs:
scaling-out.md).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

from .._errors import StatementUnanswered, StoreError
from .._keystore import Claim
from .._records import HeldReason, Outcome, StoredResponse
from . import sql
from .atomic import ANSWERED, AtomicRun, InFlight, Request, replaced_by
from .claiming import Claims, Replaceable, judge
from .connections import bounded, classify, discard, time_left
from .database import Database

logger = logging.getLogger("idempotency_asgi")


class AtomicCitus:
    def __init__(self, db: Database, claims: Claims, in_flight: InFlight) -> None:
        self._db = db
        self._claims = claims
        self._in_flight = in_flight

    async def claim(
        self, request: Request, deadline: float, *, max_in_flight: int | None, max_keys: int | None
    ) -> Claim:
        """As `_atomic.Atomic.claim`."""
        row = await self._claims.peek(
            tenant=request.tenant,
            key=request.key,
            fingerprint=request.fingerprint,
            deadline=deadline,
        )
        seen = judge(row, lease_seconds=request.lease_seconds)
        if isinstance(seen, Claim) and seen.outcome in ANSWERED:
            self._claims.keep(request.tenant, request.key, request.fingerprint, seen)
            return seen
        if self._in_flight.full(request.tenant, max_in_flight):
            return Claim(Outcome.OVER_LIMIT)
        return await self._begin(request, deadline, max_keys=max_keys)

    async def _begin(self, request: Request, deadline: float, *, max_keys: int | None) -> Claim:
        db = self._db
        ticket = db.breaker.admit()  # new work: refused at once while the database is stuck
        try:
            conn = await db.lend(time_left(deadline))
            try:
                tx, held = await bounded(_begin_locked(conn, request, db), time_left(deadline))
            except BaseException as exc:
                discard(conn)  # cut short half way: nobody may reuse it
                await db.lender.give_back(conn)
                if isinstance(exc, asyncio.TimeoutError):
                    db.breaker.stalled(ticket)
                raise classify("cannot begin the request's transaction", exc) from exc
            try:
                claim = await self._read(conn, tx, held, request, deadline, max_keys=max_keys)
            except BaseException as exc:
                await _end(db, conn, tx)
                if isinstance(exc, (asyncio.TimeoutError, StatementUnanswered)):
                    db.breaker.stalled(ticket)
                raise classify("cannot read the key", exc) from exc
            db.breaker.succeeded()
            return claim
        finally:
            db.breaker.ended(ticket)

    async def _read(
        self,
        conn: Any,
        tx: Any,
        held: bool,
        request: Request,
        deadline: float,
        *,
        max_keys: int | None,
    ) -> Claim:
        """With the key's lock `held`, read the key's row (by a statement of its own: see
        sql/atomic.READ): a Claim with the transaction to run in, or the answer (and the
        transaction ended)."""
        db = self._db
        answer: Claim | None = None
        seen: Claim | Replaceable | None = None
        if not held:
            answer = Claim(Outcome.IN_FLIGHT, lease_remaining=request.lease_seconds, locked=True)
        else:
            args = (request.tenant, request.key, request.fingerprint)
            if (request.isolation or db.default_isolation) == "read committed":
                row = await conn.fetchrow(
                    db.qualified(sql.READ), *args, timeout=time_left(deadline)
                )
            else:
                row = await db.call("fetchrow", sql.READ, *args, deadline=deadline)
            seen = None if row is None else judge(row, lease_seconds=request.lease_seconds)
            if isinstance(seen, Claim):
                answer = seen
            elif seen is None:
                answer = await self._over_quota(request.tenant, max_keys, deadline)
        if answer is not None:
            await _end(db, conn, tx)
            return answer
        replaced = seen if isinstance(seen, Replaceable) else None
        return CitusRun.claimed(db, conn, tx, request, replaced, deadline, self._in_flight)

    async def _over_quota(self, tenant: str, max_keys: int | None, deadline: float) -> Claim | None:
        bound = self._claims.bound_for(tenant, max_keys)
        if bound is None:
            return None
        if bound == 0:
            return Claim(Outcome.OVER_QUOTA)
        stored = await self._db.call("fetchval", sql.COUNT_KEYS, tenant, bound, deadline=deadline)
        over = stored >= bound
        self._claims.counted(tenant, over=over)
        return Claim(Outcome.OVER_QUOTA) if over else None


async def _begin_locked(conn: Any, request: Request, db: Database) -> tuple[Any, bool]:
    """BEGIN, then the key's locks tried by a statement routed to the tenant's shard (see
    sql/atomic.LOCK_KEY): the transaction, and whether the locks are held."""
    isolation = None if request.isolation is None else request.isolation.replace(" ", "_")
    tx = conn.transaction(isolation=isolation)
    await tx.start()
    status = await conn.execute(
        db.qualified(sql.LOCK_KEY),
        request.tenant,
        request.key,
        request.lock,
        request.request_lock,
    )
    return tx, status == "SELECT 1"


async def _end(db: Database, conn: Any, tx: Any) -> None:
    """Roll back what is still open (bounded; a connection that cannot is closed) and give the
    connection back. After a COMMIT was sent (`tx` None) the connection is the COMMIT's until
    it ends (see lending.py), and giving it back does nothing."""
    try:
        if tx is not None:
            await db.lender.rollback(conn, tx)
    finally:
        await db.lender.give_back(conn)


class CitusRun(AtomicRun):
    """An atomic request's run where the key table is distributed: its locks are the
    transaction's (see the module's docstring), so what must outlast a rollback is written
    on a connection of the store's while the transaction still holds the key, and a
    transaction the application's statements left unable to commit is left open for that,
    until `close()` rolls it back."""

    def _record(
        self, response: StoredResponse, ttl_seconds: float
    ) -> tuple[str, tuple[Any, ...], bool]:
        args = self._request.replacing_args(response, ttl_seconds, self._replaced)
        return self._db.qualified(sql.RECORD_ROUTED), args, False

    async def _failed_to_commit(self) -> None:
        if self._tx is None:  # its COMMIT failed: nothing holds the key any more
            await self._end()

    async def record_apart(
        self, response: StoredResponse, *, ttl_seconds: float
    ) -> datetime | None:
        args = self._request.replacing_args(response, ttl_seconds, self._replaced)
        written: datetime | None = await self._db.call("fetchval", sql.RECORD_ROUTED, *args)
        return written

    async def keep(self, reason: HeldReason) -> None:
        try:
            args = self._request.hold_args(self._replaced, reason)
            await self._db.call("execute", sql.HOLD, *args)
        except StoreError as exc:
            logger.error(
                "could not hold the key of a request whose outcome is unknown; a retry may "
                "run it again once its transaction has rolled back: %s",
                exc,
            )

    async def lost(self) -> bool:
        request = self._request
        try:
            row = await self._db.call("fetchrow", sql.KEY_ROW, request.tenant, request.key)
        except StoreError:
            return False
        return replaced_by(row, self._replaced)


async def _nothing() -> None:
    """A late COMMIT that failed rolled everything back, the key's locks included."""
