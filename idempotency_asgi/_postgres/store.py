"""PostgresStore: the key store on PostgreSQL, through asyncpg. It knows rows, not ASGI.

The store is a facade over one module per protocol, each on the same plumbing
(`_database.Database`: connections, one statement within a deadline, the breaker):

- `_claiming`: the claim (reserve a key, or say what holds it), batched under load;
- `_recording`: the completion, the release and the renewal, fenced by the lease;
- `_atomic`: the atomic mode, where the claim, the handler's writes and the record are one
  transaction;
- `_waiting`: duplicates that wait for the request in flight;
- `_transaction` and `_lending`: the transactional mode's transaction, lent to the handler;
- `_reconcile`: keys held for operators, who list them, settle or release them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import asyncpg

from .._errors import SCHEMA_MISSING, StoreUnavailable
from .._keystore import Claim
from .._records import (
    FORMAT_VERSION,
    HeldKey,
    HeldReason,
    Lease,
    Reconciled,
    StoredResponse,
    encode_headers,
)
from . import spread as _spread
from . import sql
from .atomic import Atomic, InFlight, Request
from .atomic_citus import AtomicCitus
from .batching import Batcher
from .claiming import Claims
from .connections import DATABASE_ERRORS, classify, time_left
from .database import Database
from .deadlines import Deadlines
from .onecommit import OneCommit
from .reconcile import Reconciliation, answer, locked_by_transaction
from .recording import Records
from .replays import ReplayCache
from .schema import HEAD
from .sql import onecommit as short_sql
from .stalls import Watch
from .transaction import Transaction
from .waiting import Waiting

__all__ = ["SCHEMA_MISSING", "PostgresStore"]

logger = logging.getLogger("idempotency_asgi")


class PostgresStore:
    """Idempotency records in PostgreSQL.

    `PostgresStore("postgresql://...")` owns a pool it creates on `open()` (or on first use);
    SQLAlchemy's `postgresql+asyncpg://` and `postgres://` are taken too, and a URL the store
    cannot use (another driver's or database's) raises ValueError here, naming the fix;
    `PostgresStore(pool)` uses an existing asyncpg pool and never closes it;
    `PostgresStore(lambda: app.state.pool)` the pool that function returns when the store
    opens (the middleware opens it once the application's own startup, which makes that pool
    in the running event loop, is complete). Once closed, a store opens again only on
    `open()`.

    `timeout` bounds every step a request waits on (taking a connection, connecting, one
    statement, BEGIN, COMMIT, ROLLBACK) in seconds: a store that is slower than that is
    treated as unavailable, and the middleware answers 503. `pool_options` are what
    `asyncpg.create_pool` takes (ssl, server_settings, init, setup, ...), used for the
    store's own connections where they mean something for one connection.

    With a DSN, the store's one-statement calls (claim, completion, renewal, release) run on
    `statement_connections` connections of its own, taken and given back without a pool's
    machinery; `min_size` to `max_size` more, its own too, are lent to handlers for their
    transactions; a duplicate that waits listens on one more connection, and the elected
    maintenance runner holds one more while it works. With a pool passed in, everything runs
    on that pool, but for one connection kept beside it (see database.py: `looks`).

    `batch`: under load, concurrent requests' statements of one kind share a round trip
    (see `batching()`); a lone request always runs its own one-row statement at once.

    `replay_cache_seconds` (off by default): replays of a record this process read within
    that many seconds are answered from memory (at most `replay_cache_bytes` of them), without
    a round trip, and even while the database is away; a record deleted by hand is still
    replayed for up to that long (see replays.py). Never past a record's retention.
    """

    #: the schema revision this version expects (see `schema_revision`)
    schema_head = HEAD

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool | Callable[[], asyncpg.Pool],
        *,
        timeout: float = 2.0,
        min_size: int = 2,
        max_size: int = 10,
        pool_options: Mapping[str, Any] | None = None,
        statement_connections: int = 4,
        batch: bool = True,
        replay_cache_seconds: float = 0.0,
        replay_cache_bytes: int = 32 * 1024 * 1024,
    ) -> None:
        if not (math.isfinite(replay_cache_seconds) and replay_cache_seconds >= 0):
            raise ValueError("replay_cache_seconds must be a finite number, 0 or more")
        self.timeout = timeout
        self._deadlines = Deadlines(timeout)
        self._db = Database(
            dsn_or_pool,
            timeout=timeout,
            min_size=min_size,
            max_size=max_size,
            pool_options=pool_options,
            statement_connections=statement_connections,
            deadlines=self._deadlines,
        )
        # Each kind of statement may have half the statement connections busy at once, so no
        # one kind can take them all (the kinds together may want more than there are: they
        # then wait their turn for one).
        lanes = max(1, statement_connections // 2)
        self._records = Records(self._db, batch=batch, lanes=lanes)
        #: the cache of finished records, when asked for (see `replay_cache_seconds`)
        self.replays = (
            ReplayCache(seconds=replay_cache_seconds, max_bytes=replay_cache_bytes)
            if replay_cache_seconds > 0
            else None
        )
        self._claims = Claims(
            self._db,
            batch=batch,
            lanes=lanes,
            release_soon=lambda lease, after: self._records.release_soon(lease, after=after),
            replays=self.replays,
        )
        in_flight = InFlight()
        self._short = OneCommit(self._db, self._claims, in_flight, self._deadlines)
        self._atomic = Atomic(self._db, self._claims, in_flight)
        self._atomic_citus = AtomicCitus(self._db, self._claims, in_flight)
        self._waiting = Waiting(self._db)
        self._reconciliation = Reconciliation(self._db)

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the pool and the statement connections now rather than on first use (and
        again after `close()`)."""
        self._records.open()
        await self._db.open()

    async def close(self) -> None:
        """Fail what still waits (503), stop what runs in the background, close the store's
        connections (a pool passed in stays open). Nothing is left behind."""
        await self._claims.close()
        await self._records.close()
        await self._waiting.close()
        await self._db.close()
        self._deadlines.close()

    # -- the claim -------------------------------------------------------------------------

    async def claim(
        self,
        *,
        tenant: str,
        key: str,
        method: str,
        path: str,
        fingerprint: bytes,
        lease_seconds: float,
        ttl_seconds: float,
        max_in_flight: int | None = None,
        max_keys: int | None = None,
        atomic: bool = False,
        isolation: str | None = None,
        idle_seconds: float = 0.0,
    ) -> Claim:
        """Reserve the key for this request, or say why not. One round trip unless a race
        was lost or a takeover is due. With `max_in_flight`, a new key is refused (OVER_LIMIT)
        while the tenant already has that many requests in flight; with `max_keys`, a new
        key is refused (OVER_QUOTA) while the tenant already stores that many keys (counted
        at most once a second per tenant: see keybound.py).

        `atomic`: the atomic mode (see atomic.py). A run's Claim then holds the request's
        transaction, begun with the key's lock (`claim.hold`) at `isolation` (None: the
        database's default), instead of a lease; in the atomic mode `max_in_flight` counts
        this process's requests, and `idle_seconds` bounds how long another session may wait
        on the request's transaction while it sits idle (0: no bound; see stalls.py)."""
        if atomic:
            kept = self._claims.replay(tenant, key, fingerprint)
            if kept is not None:
                return kept
            deadline = asyncio.get_running_loop().time() + self._db.timeout
            request = Request(
                tenant=tenant,
                key=key,
                method=method,
                path=path,
                fingerprint=fingerprint,
                lease_seconds=lease_seconds,
                ttl_seconds=ttl_seconds,
                isolation=isolation,
                idle_seconds=idle_seconds,
            )
            short = self._short
            if short.fits(isolation) and self._db.settled():
                return await short.claim(
                    request, deadline, max_in_flight=max_in_flight, max_keys=max_keys
                )
            spread = await self._db.spread(time_left(deadline))
            runner = self._atomic_citus if spread else self._atomic
            return await runner.claim(
                request, deadline, max_in_flight=max_in_flight, max_keys=max_keys
            )
        return await self._claims.claim(
            tenant=tenant,
            key=key,
            method=method,
            path=path,
            fingerprint=fingerprint,
            lease_seconds=lease_seconds,
            ttl_seconds=ttl_seconds,
            max_in_flight=max_in_flight,
            max_keys=max_keys,
        )

    async def wait(
        self,
        *,
        tenant: str,
        key: str,
        timeout: float,
        locked: bool = False,
        fingerprint: bytes | None = None,
    ) -> None:
        """Return when the in-flight request holding this key completes or is released, or
        after `timeout` seconds, whichever is first (see waiting.py); never raises for the
        store's sake. `locked`: the claim found the key held by an atomic transaction's lock,
        with no row to wait on; `fingerprint`: the waiting request's."""
        await self._waiting.wait(
            tenant=tenant, key=key, timeout=timeout, locked=locked, fingerprint=fingerprint
        )

    # -- ending a claim (see recording.py) ------------------------------------------------

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease; False when it was lost (taken over or released)."""
        return await self._records.renew(lease)

    async def complete(
        self,
        lease: Lease,
        response: StoredResponse,
        *,
        ttl_seconds: float,
        conn: Any = None,
        timeout: float | None = None,
    ) -> datetime | None:
        """Store the response, if this lease still holds the key; return when the record
        expires, or None when the lease no longer holds the key. With `conn`, inside that
        connection's open transaction (its errors are asyncpg's own)."""
        return await self._records.complete(
            lease, response, ttl_seconds=ttl_seconds, conn=conn, timeout=timeout
        )

    async def release(self, lease: Lease) -> None:
        """Give the key up so that the next retry runs afresh (after a 5xx, an error...)."""
        await self._records.release(lease)

    def release_soon(self, lease: Lease, *, after: float = 0.0) -> None:
        """Free the key in the background, trying again while the database is away, until
        the lease would have lapsed anyway."""
        self._records.release_soon(lease, after=after)

    async def holds(self, lease: Lease) -> bool:
        """Whether the lease still holds its key (in flight under its token)."""
        return await self._records.holds(lease)

    async def hold(self, lease: Lease, reason: HeldReason) -> bool:
        """Hold the key in flight for an operator (after OutcomeUnknown, say), nobody
        renewing it, for `lease.seconds` from now; False when the lease no longer holds it."""
        return await self._reconciliation.hold(lease, reason)

    # -- the transactional mode (see transaction.py, lending.py) -------------------------

    def transaction(self, isolation: str | None = None, idle_seconds: float = 0.0) -> Transaction:
        """A transaction for one request, opened only if the handler asks for its connection
        (at `isolation`; None: the database's default), another session's wait on it while it
        sits idle bounded by `idle_seconds` (0: no bound; see stalls.py)."""
        return Transaction(self, isolation, idle_seconds)

    async def lend(self) -> Any:
        """A pooled connection for code other than the store's (a handler's transaction):
        its session is reset before the pool hands it to anyone else."""
        return await self._db.lend()

    async def begin(self, conn: Any, isolation: str | None = None, run: int = 0) -> Any:
        """Start the transaction of a connection from `lend()`, within the timeout, marked
        with `run` (the completion tells by it whether the handler ended the transaction)."""
        return await self._db.lender.begin(conn, isolation, run)

    def watch(self, conn: Any, seconds: float) -> Watch | None:
        """Watch the transaction begun on `conn` for sessions that wait on it while it sits
        idle (see stalls.py); end with `unwatch`."""
        return self._db.stalls.watch(conn, seconds)

    def unwatch(self, watch: Watch | None) -> None:
        self._db.stalls.end(watch)

    async def commit(
        self,
        conn: Any,
        tx: Any,
        lease: Lease,
        *,
        timeout: float,
        first: str = "",
        if_committed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Commit the transaction `tx` of a connection from `lend()` within `timeout`, after
        `first` (the completion, in the same round trip, see `completion`); a COMMIT that
        outlives it raises CommitPending and goes on (see lending.py), frees the key of
        `lease` if it then fails, and runs `if_committed` if it then lands."""
        await self._db.lender.commit(
            conn,
            tx,
            timeout=timeout,
            if_rolled_back=lambda: self._records.release_until_lapsed(lease),
            if_committed=if_committed,
            first=first,
        )

    def completion(
        self, lease: Lease, response: StoredResponse, expires_us: int, run: int
    ) -> str | None:
        """The completion as a statement to run before its transaction's COMMIT, in the same
        round trip (see sql/onecommit.complete); None where it is a round trip of its own
        (Citus, or before a lent connection told where the tables are)."""
        db = self._db
        if db.distributed or db.tables is None:
            return None
        args = (
            lease.tenant,
            lease.key,
            lease.token,
            FORMAT_VERSION,
            response.status,
            encode_headers(response.headers),
            response.body,
            expires_us,
            str(run),
        )
        return short_sql.complete(db.schema, args, lease.row)

    async def rollback(self, conn: Any, tx: Any, run: int | None = None) -> bool:
        """Roll back `tx`; with `run` (its mark, see sql/onecommit.marked), also tell whether
        the handler had committed it before (True: what it wrote may have happened)."""
        check = None
        if run is not None and self._db.tables is not None and not self._db.distributed:
            check = short_sql.rolled_back(self._db.schema, run)
        return await self._db.lender.rollback(conn, tx, check=check)

    async def give_back(self, conn: Any) -> None:
        """Return a connection from `lend()`; a second call for the same one is ignored."""
        await self._db.lender.give_back(conn)

    # -- maintenance (see maintenance.py) -------------------------------------------------

    async def reap(self, *, batch_size: int) -> int:
        """Delete up to `batch_size` finished rows past retention; return how many."""
        if await self._db.spread():
            return await _spread.reap(self._db, batch_size)
        return await self._db.count(sql.REAP, batch_size)

    async def sweep(self, *, batch_size: int, grace_seconds: float) -> list[dict[str, Any]]:
        """Release up to `batch_size` in-flight rows whose lease lapsed more than
        `grace_seconds` ago; return them (tenant, key, method, path, lapsed_seconds)."""
        if await self._db.spread():
            return await _spread.sweep(self._db, batch_size, grace_seconds)
        rows = await self._db.call("fetch", sql.SWEEP, batch_size, grace_seconds)
        return [dict(row) for row in rows]

    async def forget_leases(self, *, batch_size: int, grace_seconds: float) -> int:
        """Delete up to `batch_size` lease rows whose lease ended more than `grace_seconds`
        ago (a completed request leaves its lease row behind); return how many."""
        if await self._db.spread():
            return await _spread.forget_leases(self._db, batch_size, grace_seconds)
        return await self._db.count(sql.FORGET_LEASES, batch_size, grace_seconds)

    async def reap_processed(self, *, batch_size: int, retention_seconds: float) -> int:
        """Delete up to `batch_size` consumer dedup records older than the retention."""
        if await self._db.spread():
            return await _spread.reap_processed(self._db, batch_size, retention_seconds)
        return await self._db.count(sql.REAP_PROCESSED, batch_size, retention_seconds)

    async def inspect(self, *, tenant: str, key: str) -> dict[str, Any] | None:
        """The key's row, as operators read it; None when there is none. A key an atomic
        transaction is running has no row yet: `locked_by_transaction` says so."""
        row = await self._db.call("fetchrow", sql.INSPECT, tenant, key)
        if row is not None:
            return dict(row)
        if not await locked_by_transaction(self._db, tenant, key):
            return None
        return {"tenant_id": tenant, "idempotency_key": key, "locked_by_transaction": True}

    # -- reconciliation: what the service could not know (see reconcile.py) --------------

    async def held(
        self, *, tenant: str | None = None, older_than: float = 0.0, limit: int = 1000
    ) -> list[HeldKey]:
        """Keys held in flight for an operator (after OutcomeUnknown, a transaction the
        handler ended, an answer plain mode could not record) and keys in flight past their
        lease (`lease-lapsed`: their owner died or stalled), oldest first: of `tenant`, or
        of every tenant; claimed at least `older_than` seconds ago; at most `limit`."""
        return await self._reconciliation.held(tenant=tenant, older_than=older_than, limit=limit)

    async def settle(
        self,
        *,
        tenant: str,
        key: str,
        status: int,
        body: bytes = b"",
        headers: Sequence[tuple[str | bytes, str | bytes]] = (),
        replace: bool = False,
        ttl_seconds: float | None = None,
    ) -> Reconciled:
        """Write the answer a provider confirmed as the key's record: every retry of its
        request then gets it replayed, byte for byte, as if the handler had answered it.
        `status` from 200 to 499 (what the middleware records); `headers` as given (names
        lowercased), with `content-length` added when missing; retained `ttl_seconds` from
        now (None: the key's own retention, the application's `ttl_seconds`). A ValueError
        for an answer that could not be replayed as given.

        Refused (nothing changed) with KeyNotFound, KeyCompleted (a key with an answer
        already, unless `replace`) or KeyRunning (its request runs: a live lease, or a
        transaction's lock): settling never races the handler. Logged at WARNING on
        `idempotency_asgi.maintenance`."""
        if ttl_seconds is not None and not (math.isfinite(ttl_seconds) and ttl_seconds > 0):
            raise ValueError("ttl_seconds must be a finite number of seconds, more than 0")
        response = answer(status, headers, body)
        return await self._reconciliation.settle(
            tenant=tenant, key=key, response=response, ttl_seconds=ttl_seconds, replace=replace
        )

    async def release_key(self, *, tenant: str, key: str, completed: bool = False) -> Reconciled:
        """Free the key at once: the next retry runs its request. Refused as `settle` is;
        a key with an answer already (KeyCompleted) only with `completed` (its retries then
        run the request again). `release(lease)` is the middleware's, fenced by its lease."""
        return await self._reconciliation.release(tenant=tenant, key=key, completed=completed)

    async def schema_revision(self) -> str | None:
        """The schema revision the database is at; None when the tables are not there."""
        tables = await self._db.call("fetchrow", sql.SCHEMA_TABLES)
        if not tables["has_keys"]:
            return None
        if not tables["has_versions"]:
            return ""  # made by hand, not by a migration: no revision to tell
        revision: str | None = await self._db.call("fetchval", sql.SCHEMA_VERSION)
        return revision or ""

    async def stats(self) -> dict[str, Any]:
        # The one statement that reads the whole table: on a pooled connection, where a scan
        # may be planned (the store's own connections have none: see _database.STORE_SETTINGS).
        conn = await self._db.lend()
        try:
            found = dict(await conn.fetchrow(self._db.qualified(sql.STATS), timeout=self.timeout))
        except asyncpg.exceptions.UndefinedTableError as exc:
            raise StoreUnavailable(f"{SCHEMA_MISSING} ({exc})") from exc
        except DATABASE_ERRORS as exc:
            raise classify("cannot read the key table's statistics", exc) from exc
        finally:
            await self._db.lender.give_back(conn)
        if await self._db.spread():  # the coordinator's table is an empty shell: the shards'
            found["table_bytes"] = await _spread.table_bytes(self._db)
        return found

    @contextlib.asynccontextmanager
    async def exclusive(self, lock_id: int) -> AsyncIterator[bool]:
        """Hold a session advisory lock while inside, if it is free: yields whether it was.
        It is held on a connection kept apart from the ones handlers borrow; the lock goes
        with that connection, so a runner that dies frees it for another, and so does
        leaving (the connection is closed, or reset)."""
        try:
            conn, give_back = await self._db.own_connection()
        except DATABASE_ERRORS as exc:
            raise classify("cannot take the maintenance lock", exc) from exc
        try:
            try:
                held = await conn.fetchval(sql.MAINTENANCE_LOCK, lock_id, timeout=self.timeout)
            except DATABASE_ERRORS as exc:
                raise classify("maintenance lock failed", exc) from exc
            yield bool(held)
        finally:
            await give_back(conn)

    # -- batching (see batching.py) -------------------------------------------------------

    def _batchers(self) -> dict[str, Batcher[Any, Any]]:
        found = {
            "claim": self._claims.claims,
            "peek": self._claims.peeks,
            "completion": self._records.completions,
            "release": self._records.releases,
            "renewal": self._records.renewals,
        }
        return {name: batcher for name, batcher in found.items() if batcher is not None}

    def batching(self) -> dict[str, tuple[int, int]]:
        """Statements sent and rows they carried, per kind (claim, peek, completion,
        release, renewal), since the store was made: how much batching saved. A row may
        carry many requests that asked the same (retries of one key)."""
        return {name: (b.statements, b.rows) for name, b in self._batchers().items()}
