"""PostgresStore: the key store on PostgreSQL, through asyncpg. It knows rows, not ASGI."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import Any

import asyncpg

from . import sql
from .connections import POOL_ONLY, UNAVAILABLE, Statements, asyncio_timeout, commit_with
from .errors import StoreUnavailable
from .keybound import KeyBounds
from .listener import Listener
from .records import (
    FORMAT_VERSION,
    Claim,
    Lease,
    Outcome,
    StoredResponse,
    decode_headers,
    encode_headers,
)
from .transaction import Transaction

#: Claim attempts before giving up. A claim repeats only when it lost a race (a row committed
#: after its snapshot, or a takeover won by another request): two are nearly always enough.
_CLAIM_ATTEMPTS = 5


#: What is wrong, and what to do, when the store's tables are not there.
SCHEMA_MISSING = (
    "the idempotency tables do not exist in this database: create them with "
    "`idempotency-asgi migrate` (or `alembic upgrade head` in the repository)"
)


def wake_token(tenant: str, key: str) -> str:
    """The NOTIFY payload naming one key: fixed length, and no tenant or key in clear."""
    return hashlib.sha256(f"{len(tenant)}:{tenant}{key}".encode()).hexdigest()[:32]


#: What the path column keeps of a longer path: it is there to be read by a person.
_MAX_DIAGNOSTIC_CHARS = 2048


def diagnostic_text(value: str) -> str:
    """`value` as a text column can hold it, for diagnostics only (the path): PostgreSQL
    text has no NUL, and a lone surrogate has no UTF-8, so both are written as escapes."""
    if len(value) > _MAX_DIAGNOSTIC_CHARS:
        value = value[:_MAX_DIAGNOSTIC_CHARS] + "..."
    if "\x00" in value or not value.isascii():
        value = value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return value


def storable_tenant(tenant: str) -> bool:
    """Whether a tenant id can be a key column as it is (no NUL, no lone surrogate): it is
    never rewritten, since two tenants must never become one."""
    if "\x00" in tenant:
        return False
    try:
        tenant.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def new_token() -> int:
    # A random 63-bit token, not a counter: after a release deletes the row and a new request
    # claims the key again, a counter would restart and a stale owner could match it.
    return secrets.randbits(63)


class PostgresStore:
    """Idempotency records in PostgreSQL.

    `PostgresStore("postgresql://...")` owns a pool it creates on `open()` (or on first use);
    `PostgresStore(pool)` uses an existing asyncpg pool and never closes it.

    `timeout` bounds each step (acquiring a connection, one statement) in seconds: a store that
    is slower than that is treated as unavailable, and the middleware answers 503.
    `pool_options` go to `asyncpg.create_pool` (ssl, server_settings, init, ...).

    With a DSN, the store's one-statement calls (claim, completion, renewal, release) run on
    `statement_connections` connections of its own, taken and given back without a pool's
    machinery; the pool (`min_size`/`max_size`) lends transactions to handlers. With a pool
    passed in, everything runs on that pool, which keeps its own reset: one more round trip
    per statement.
    """

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool,
        *,
        timeout: float = 2.0,
        min_size: int = 2,
        max_size: int = 10,
        pool_options: Mapping[str, Any] | None = None,
        statement_connections: int = 4,
    ) -> None:
        self.timeout = timeout
        self._pool_options = dict(pool_options or {})
        self._min_size = min_size
        self._max_size = max_size
        self._lent: set[int] = set()
        # Connections out of the pool, by id: the pool and the gate permit each must go back
        # to, exactly once, however many times give_back() is called for it.
        self._out: dict[int, tuple[asyncpg.Pool, asyncio.Semaphore]] = {}
        self._opening: asyncio.Lock | None = None
        self._gate: asyncio.Semaphore | None = None
        self._statements: Statements | None = None
        self._statement_connections = statement_connections
        self._listener: Listener | None = None
        self._listener_lock: asyncio.Lock | None = None
        self._complete_in_transaction: str | None = None
        self._key_bounds = KeyBounds()
        if isinstance(dsn_or_pool, str):
            self._dsn: str | None = dsn_or_pool
            self._pool: asyncpg.Pool | None = None
            self._owns_pool = True
        else:
            self._dsn = None
            self._pool = dsn_or_pool
            self._owns_pool = False

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        await self._ready()

    async def close(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await listener.close()
        if self._statements is not None:
            statements, self._statements = self._statements, None
            await statements.close()
        if self._owns_pool and self._pool is not None:
            pool, self._pool, self._gate = self._pool, None, None
            await pool.close()

    async def _ready(self) -> asyncpg.Pool:
        if self._pool is not None:
            if self._gate is None:
                self._gate = asyncio.Semaphore(self._pool.get_max_size())
            return self._pool
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                try:
                    self._pool = await asyncpg.create_pool(
                        self._dsn,
                        min_size=self._min_size,
                        max_size=self._max_size,
                        timeout=self.timeout,
                        reset=self._reset,
                        **self._pool_options,
                    )
                except UNAVAILABLE as exc:
                    raise StoreUnavailable(f"cannot open the key store: {exc!r}") from exc
                self._gate = asyncio.Semaphore(self._max_size)
                self._statements = Statements(self._connect, self._statement_connections)
        return self._pool

    async def _connect(self) -> Any:
        options = {k: v for k, v in self._pool_options.items() if k not in POOL_ONLY}
        conn = await asyncpg.connect(self._dsn, timeout=self.timeout, **options)
        init = self._pool_options.get("init")
        if init is not None:
            await init(conn)
        return conn

    async def _reset(self, conn: Any) -> None:
        # The default reset is a round trip on every release. The store's own statements leave
        # no session state, so only connections lent to a handler pay for it.
        pid = conn.get_server_pid()
        if pid in self._lent:
            self._lent.discard(pid)
            await conn.execute(sql.RESET_SESSION)

    # -- primitives ------------------------------------------------------------------------

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
    ) -> Claim:
        """Reserve the key for this request, or say why not. One round trip unless a race
        was lost or a takeover is due. With `max_in_flight`, a new key is refused (OVER_LIMIT)
        while the tenant already has that many requests in flight; with `max_keys`, a new
        key is refused (OVER_QUOTA) while the tenant already stores that many keys (counted
        at most once a second per tenant: see keybound.py)."""
        path = diagnostic_text(path)
        bound = None if max_keys is None else self._key_bounds.bound_for(tenant, max_keys)
        for _ in range(_CLAIM_ATTEMPTS):
            token = new_token()
            args = (
                tenant,
                key,
                method,
                path,
                fingerprint,
                token,
                lease_seconds,
                ttl_seconds,
                FORMAT_VERSION,
            )
            if bound is not None:
                row = await self._fetchrow(sql.CLAIM_BOUNDED, *args, max_in_flight, bound)
            elif max_in_flight is None:
                row = await self._fetchrow(sql.CLAIM, *args)
            else:
                row = await self._fetchrow(sql.CLAIM_CAPPED, *args, max_in_flight)
            if row is None:
                continue  # the conflicting row is newer than our snapshot: look again
            lease = Lease(tenant=tenant, key=key, token=token, seconds=lease_seconds)
            counted = bound is not None and bound == max_keys  # a new key's claim counted
            if row["claimed"]:
                if counted:
                    self._key_bounds.counted(tenant, over=False)
                return Claim(Outcome.CLAIMED, lease=lease)
            state = row["state"]
            if state == "over_limit":
                return Claim(Outcome.OVER_LIMIT)
            if state == "over_quota":
                if counted:
                    self._key_bounds.counted(tenant, over=True)
                return Claim(Outcome.OVER_QUOTA)
            if state == "completed" and row["expired"]:
                pass  # past retention: the key is new again
            elif not row["same_request"]:
                return Claim(Outcome.MISMATCH)
            elif state == "completed":
                if row["format_version"] != FORMAT_VERSION:
                    return Claim(Outcome.UNREADABLE)
                response = StoredResponse(
                    status=row["response_status"],
                    headers=decode_headers(row["response_headers"]),
                    body=row["response_body"],
                )
                return Claim(Outcome.COMPLETED, response=response, expires_at=row["expires_at"])
            elif row["lease_remaining"] > 0:
                return Claim(
                    Outcome.IN_FLIGHT,
                    lease_remaining=row["lease_remaining"],
                    running_for=row["running_for"],
                )
            if await self._execute(sql.TAKE_OVER, *args, row["lease_token"]):
                return Claim(Outcome.TAKEN_OVER, lease=lease)
        # Lost every race in a row: someone else holds the key right now.
        return Claim(Outcome.IN_FLIGHT, lease_remaining=1.0)

    async def wait(self, *, tenant: str, key: str, timeout: float) -> None:
        """Return when the in-flight request holding this key completes or is released, or
        after `timeout` seconds, whichever is first; then claim again to see which.

        Woken by LISTEN/NOTIFY on a connection of its own, not by polling."""
        waiter = await self._waiters()
        token = wake_token(tenant, key)
        woken = waiter.subscribe(token)
        try:
            if not await self._execute(sql.MARK_WAITING, tenant, key):
                return  # finished (or released) before we could wait for it
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(woken), timeout)
        finally:
            waiter.unsubscribe(token, woken)

    async def _waiters(self) -> Listener:
        """The store's one listener, started by whichever waiter comes first."""
        listener = self._listener
        if listener is not None and not listener.closed:
            return listener
        if self._listener_lock is None:
            self._listener_lock = asyncio.Lock()
        async with self._listener_lock:
            if self._listener is not None and self._listener.closed:
                dead, self._listener = self._listener, None
                await dead.close()  # its connection died: give its slot back
            if self._listener is None:
                try:
                    self._listener = await Listener.start(self)
                except UNAVAILABLE as exc:
                    raise StoreUnavailable(f"cannot listen for completions: {exc!r}") from exc
            return self._listener

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease; False when it was lost (taken over or released)."""
        return await self._execute(sql.RENEW, lease.tenant, lease.key, lease.token, lease.seconds)

    async def complete(
        self, lease: Lease, response: StoredResponse, *, ttl_seconds: float, conn: Any = None
    ) -> datetime | None:
        """Store the response, if this lease still holds the key; return when the record
        expires, or None when the lease no longer holds the key.

        With `conn`, the write happens on that connection (inside its open transaction), and
        its errors are asyncpg's own."""
        args = (
            lease.tenant,
            lease.key,
            lease.token,
            FORMAT_VERSION,
            response.status,
            encode_headers(response.headers),
            response.body,
            ttl_seconds,
        )
        if conn is None:
            expires_at: datetime | None = await self._call("fetchval", sql.COMPLETE, *args)
            return expires_at
        statement = self._complete_in_transaction or sql.COMPLETE
        # Inside the caller's transaction: a failure here may be the caller's (an aborted
        # transaction), so it is raised as it is, for the caller to tell which.
        return await conn.fetchval(statement, *args, timeout=self.timeout)  # type: ignore[no-any-return]

    async def release(self, lease: Lease) -> None:
        """Give the key up so that the next retry runs afresh (after a 5xx, an error...)."""
        await self._call("execute", sql.RELEASE, lease.tenant, lease.key, lease.token)

    # -- maintenance (see maintenance.py) -------------------------------------------------

    async def reap(self, *, batch_size: int) -> int:
        """Delete up to `batch_size` finished rows past retention; return how many."""
        return await self._count(sql.REAP, batch_size)

    async def sweep(self, *, batch_size: int, grace_seconds: float) -> list[dict[str, Any]]:
        """Release up to `batch_size` in-flight rows whose lease lapsed more than
        `grace_seconds` ago; return them (tenant, key, method, path, lapsed_seconds)."""
        rows = await self._fetch(sql.SWEEP, batch_size, grace_seconds)
        return [dict(row) for row in rows]

    async def forget_leases(self, *, batch_size: int, grace_seconds: float) -> int:
        """Delete up to `batch_size` lease rows whose lease ended more than `grace_seconds`
        ago (a completed request leaves its lease row behind); return how many."""
        return await self._count(sql.FORGET_LEASES, batch_size, grace_seconds)

    async def reap_processed(self, *, batch_size: int, retention_seconds: float) -> int:
        """Delete up to `batch_size` consumer dedup records older than the retention."""
        return await self._count(sql.REAP_PROCESSED, batch_size, retention_seconds)

    async def inspect(self, *, tenant: str, key: str) -> dict[str, Any] | None:
        row = await self._fetchrow(sql.INSPECT, tenant, key)
        return None if row is None else dict(row)

    async def schema_revision(self) -> str | None:
        """The schema revision the database is at; None when the tables are not there."""
        tables = await self._fetchrow(sql.SCHEMA_TABLES)
        if not tables["has_keys"]:
            return None
        if not tables["has_versions"]:
            return ""  # made by hand, not by a migration: no revision to tell
        revision: str | None = await self._call("fetchval", sql.SCHEMA_VERSION)
        return revision or ""

    async def stats(self) -> dict[str, Any]:
        return dict(await self._fetchrow(sql.STATS))

    @contextlib.asynccontextmanager
    async def exclusive(self, lock_id: int) -> AsyncIterator[bool]:
        """Hold a session advisory lock while inside, if it is free: yields whether it was.
        The lock goes with the connection, so a runner that dies frees it for another."""
        conn = await self._acquire()
        try:
            held = bool(await conn.fetchval(sql.MAINTENANCE_LOCK, lock_id, timeout=self.timeout))
            try:
                yield held
            finally:
                if held:
                    await conn.fetchval(sql.MAINTENANCE_UNLOCK, lock_id, timeout=self.timeout)
        except UNAVAILABLE as exc:
            raise StoreUnavailable(f"maintenance lock failed: {exc!r}") from exc
        finally:
            await self.give_back(conn)

    def transaction(self) -> Transaction:
        """A transaction for one request, opened only if the handler asks for its connection."""
        return Transaction(self)

    # -- plumbing --------------------------------------------------------------------------

    async def _acquire(self) -> Any:
        pool = await self._ready()
        gate = self._gate
        assert gate is not None
        try:
            # First in, first served. asyncpg's pool queue lets a newcomer take a connection
            # that was just handed to a waiter, and under load the waiters that lose that race
            # again and again made a p99 several times the p50. The gate is a FIFO semaphore
            # sized to the pool, so the pool itself never makes anyone wait.
            if not gate.locked():
                await gate.acquire()
            elif asyncio_timeout is None:  # Python 3.10
                await asyncio.wait_for(gate.acquire(), self.timeout)
            else:
                async with asyncio_timeout(self.timeout):
                    await gate.acquire()
        except asyncio.TimeoutError as exc:
            raise StoreUnavailable("no free connection to the key store in time") from exc
        try:
            if self._owns_pool:
                # Nobody else draws on it: past the gate a connection is free (a new one is
                # bounded by the pool's connect timeout).
                conn = await pool.acquire()
            else:
                # A pool shared with the application may be drained by it: bound the wait.
                conn = await pool.acquire(timeout=self.timeout)
        except BaseException as exc:
            gate.release()
            if isinstance(exc, UNAVAILABLE):
                raise StoreUnavailable(f"no connection to the key store: {exc!r}") from exc
            raise
        self._out[id(conn)] = (pool, gate)
        return conn

    async def _call(self, method: str, query: str, *args: Any) -> Any:
        """One statement: `method` is fetchrow, fetch, fetchval or execute. It runs on one of
        the store's statement connections, or on the pool when the store was given one."""
        await self._ready()
        statements = self._statements
        try:
            conn = await (
                self._acquire() if statements is None else statements.acquire(self.timeout)
            )
        except UNAVAILABLE as exc:
            raise StoreUnavailable(f"no connection to the key store: {exc!r}") from exc
        try:
            return await getattr(conn, method)(query, *args, timeout=self.timeout)
        except BaseException as exc:
            if statements is not None and not isinstance(exc, asyncpg.PostgresError):
                # A timeout, a cancellation or a broken socket leaves the connection in a state
                # nobody should inherit (a cancel request may still be in flight): drop it.
                conn.terminate()
            if isinstance(exc, asyncpg.exceptions.UndefinedTableError):
                raise StoreUnavailable(f"{SCHEMA_MISSING} ({exc})") from exc
            if isinstance(exc, UNAVAILABLE):
                raise StoreUnavailable(f"key store statement failed: {exc!r}") from exc
            raise
        finally:
            if statements is None:
                await self.give_back(conn)
            else:
                statements.release(conn)

    async def _fetchrow(self, query: str, *args: Any) -> Any:
        return await self._call("fetchrow", query, *args)

    async def _fetch(self, query: str, *args: Any) -> list[Any]:
        return list(await self._call("fetch", query, *args))

    async def _count(self, query: str, *args: Any) -> int:
        """Run a row-changing statement; return how many rows it changed."""
        status: str = await self._call("execute", query, *args)
        return int(status.rsplit(" ", 1)[-1])

    async def _execute(self, query: str, *args: Any) -> bool:
        """Run a row-changing statement; True when it changed a row."""
        return await self._count(query, *args) > 0

    async def lend(self) -> Any:
        """A pooled connection for code other than the store's (a handler's transaction, the
        listener): its session is reset before the pool hands it to anyone else."""
        conn = await self._acquire()
        self._lent.add(conn.get_server_pid())
        if self._complete_in_transaction is None:
            try:
                await self._name_tables(conn)
            except BaseException as exc:
                await self.give_back(conn)
                if isinstance(exc, UNAVAILABLE):
                    raise StoreUnavailable(f"cannot read the schema: {exc!r}") from exc
                raise
        return conn

    async def _name_tables(self, conn: Any) -> None:
        """Look up, once, where the tables are, for the completion that runs on connections
        lent to handlers (whose search_path is theirs to change): on such a connection, before
        the handler has it."""
        names = await conn.fetchrow(sql.TABLE_NAMES, timeout=self.timeout)
        if names["keys"] is not None and names["leases"] is not None:
            self._complete_in_transaction = sql.qualified(
                sql.COMPLETE, names["keys"], names["leases"]
            )

    async def commit(self, conn: Any, tx: Any) -> None:
        """Commit the transaction `tx` of a connection from `lend()`, with the session reset
        its release would otherwise cost in the COMMIT's round trip."""
        if await commit_with(tx, sql.COMMIT_AND_RESET):
            self._lent.discard(conn.get_server_pid())
        else:
            await tx.commit()

    async def give_back(self, conn: Any) -> None:
        """Return a connection from `lend()` (or `_acquire()`) to its pool and its permit to
        the gate. A connection already given back is ignored, so a second call can never
        hand the gate more permits than the pool has connections."""
        taken = self._out.pop(id(conn), None)
        if taken is None:
            return
        pool, gate = taken
        try:
            if not self._owns_pool:
                # A pool of the application's resets what asyncpg resets, which leaves a
                # handler's role and temporary tables behind: reset those here. A connection
                # that cannot be reset is not handed to anyone again.
                try:
                    await self._reset(conn)
                except UNAVAILABLE:
                    conn.terminate()
            # The pool terminates a connection it cannot reset; nothing is lost.
            with contextlib.suppress(*UNAVAILABLE):
                await pool.release(conn, timeout=self.timeout)
        finally:
            gate.release()
