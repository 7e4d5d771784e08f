"""PostgresStore: the key store on PostgreSQL, through asyncpg. It knows rows, not ASGI."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from typing import Any

import asyncpg

from . import _sql as sql
from ._batching import Batcher, arrays
from ._connections import (
    DATABASE_ERRORS,
    POOL_ONLY,
    SESSION_ENDED,
    Statements,
    bounded,
    classify,
    discard,
    is_stall,
)
from ._errors import StatementUnanswered, StoreError, StoreRefused, StoreUnavailable
from ._keybound import KeyBounds
from ._lending import Lender
from ._listener import Listener
from ._outages import COOLDOWN_SECONDS, Breaker, SharedAttempt, Ticket
from ._records import (
    FORMAT_VERSION,
    Claim,
    Lease,
    Outcome,
    StoredResponse,
    decode_headers,
    encode_headers,
)
from ._transaction import Transaction

logger = logging.getLogger("idempotency_asgi")

#: Claim attempts before giving up. A claim repeats only when it lost a race (a row committed
#: after its snapshot, or a takeover won by another request): two are nearly always enough.
_CLAIM_ATTEMPTS = 5


#: Rows one batched statement carries at most: claims, releases and renewals are small;
#: a completion carries its response (up to max_stored_response_bytes), so fewer of those.
MAX_BATCH_ROWS = 64
MAX_BATCH_RESPONSES = 16


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


#: The longest tenant id, in UTF-8 bytes. The tenant and the key (at most 255 bytes) make the
#: primary key, and PostgreSQL refuses an index entry beyond about 2,700 bytes: a longer id
#: would fail every claim the same way. Account ids, token subjects and credential hashes are
#: far shorter.
MAX_TENANT_BYTES = 1024


def unstorable_tenant(tenant: str) -> str | None:
    """Why a tenant id cannot be a key column as it is (a NUL, a lone surrogate, too long),
    or None when it can. It is never rewritten, since two tenants must never become one."""
    if "\x00" in tenant:
        return "it contains NUL"
    try:
        size = len(tenant.encode("utf-8"))
    except UnicodeEncodeError:
        return "it contains a lone surrogate"
    if size > MAX_TENANT_BYTES:
        return f"it is {size} bytes long, more than {MAX_TENANT_BYTES}"
    return None


def new_token() -> int:
    # A random 63-bit token, not a counter: after a release deletes the row and a new request
    # claims the key again, a counter would restart and a stale owner could match it.
    return secrets.randbits(63)


class PostgresStore:
    """Idempotency records in PostgreSQL.

    `PostgresStore("postgresql://...")` owns a pool it creates on `open()` (or on first use);
    `PostgresStore(pool)` uses an existing asyncpg pool and never closes it.

    `timeout` bounds every step a request waits on (taking a connection, connecting, one
    statement, BEGIN, COMMIT, ROLLBACK) in seconds: a store that is slower than that is
    treated as unavailable, and the middleware answers 503. `pool_options` go to
    `asyncpg.create_pool` (ssl, server_settings, init, ...).

    With a DSN, the store's one-statement calls (claim, completion, renewal, release) run on
    `statement_connections` connections of its own, taken and given back without a pool's
    machinery; the pool (`min_size`/`max_size`) lends transactions to handlers only; a
    duplicate that waits listens on one more connection, and the elected maintenance runner
    holds one more while it works. With a pool passed in, everything runs on that pool.
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
        batch: bool = True,
    ) -> None:
        self.timeout = timeout
        self._pool_options = dict(pool_options or {})
        self._min_size = min(min_size, max_size)  # a pool of one keeps one
        self._max_size = max_size
        cooldown = min(COOLDOWN_SECONDS, timeout)
        self._breaker = Breaker(cooldown)
        self._lender = Lender(timeout=timeout, breaker=self._breaker)
        self._statements: Statements | None = None
        self._statement_connections = statement_connections
        self._opening = SharedAttempt(self._open, what="opening the key store", cooldown=cooldown)
        self._listener: Listener | None = None
        self._listening = SharedAttempt(
            self._listen, what="listening for completions", cooldown=cooldown
        )
        self._complete_in_transaction: str | None = None
        self._releasing: set[asyncio.Task[None]] = set()
        self._key_bounds = KeyBounds()
        # Natural batching of the one-statement calls (see _batching.py): under load, the
        # requests queued behind one statement share the next. Each kind may have half the
        # statement connections busy at once, so no one kind can take them all (the kinds
        # together may want more than there are: they then wait their turn for one).
        lanes = max(1, statement_connections // 2)
        # For tests only: one row goes as an array too, so that a suite of one-at-a-time
        # requests runs the batched statements.
        self._arrays_always = False
        self._claims: Batcher[tuple[Any, ...], Any] | None = None
        self._completions: Batcher[tuple[Any, ...], Any] | None = None
        self._releases: Batcher[Lease, Any] | None = None
        self._renewals: Batcher[Lease, Any] | None = None
        if batch:
            self._claims = Batcher(
                self._claim_rows, key=_args_key, lanes=lanes, max_size=MAX_BATCH_ROWS
            )
            self._completions = Batcher(
                self._complete_rows, key=_args_key, lanes=lanes, max_size=MAX_BATCH_RESPONSES
            )
            self._releases = Batcher(
                self._release_rows, key=_lease_key, lanes=lanes, max_size=MAX_BATCH_ROWS
            )
            self._renewals = Batcher(
                self._renew_rows, key=_lease_key, lanes=lanes, max_size=MAX_BATCH_ROWS
            )
        if isinstance(dsn_or_pool, str):
            self._dsn: str | None = dsn_or_pool
        else:
            self._dsn = None
            self._lender.attach(dsn_or_pool, owns=False)

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the pool and the statement connections now rather than on first use."""
        await self._ready()

    async def close(self) -> None:
        for batcher in self._batchers():
            await batcher.close()
        self._opening.cancel()
        self._listening.cancel()
        for task in list(self._releasing):
            task.cancel()
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await listener.close()
        if self._statements is not None:
            statements, self._statements = self._statements, None
            await statements.close()
        await self._lender.close()

    async def _ready(self, timeout: float | None = None) -> None:
        if self._lender.pool is None:
            if self._dsn is None:
                raise StoreUnavailable("the key store is closed")
            # One attempt for every caller, each waiting no longer than its own timeout;
            # a failure is remembered briefly, so an outage fails every caller at once.
            await self._opening(self.timeout if timeout is None else timeout)

    async def _open(self) -> None:
        pool = asyncpg.create_pool(
            self._dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            timeout=self.timeout,
            reset=self._lender.reset,
            **self._pool_options,
        )
        ticket = self._breaker.ticket()
        try:
            await bounded(pool, self.timeout)  # awaiting the pool connects its first ones
        except BaseException as exc:
            with contextlib.suppress(Exception):
                pool.terminate()
            if is_stall(exc):
                self._breaker.stalled(ticket)
            raise classify("cannot open the key store", exc) from exc
        self._lender.attach(pool, owns=True)
        self._statements = Statements(self._connect, self._statement_connections, self.timeout)

    async def _connect(self) -> Any:
        """A connection of the store's own, made as the pool makes its own."""
        options = {k: v for k, v in self._pool_options.items() if k not in POOL_ONLY}
        ticket = self._breaker.ticket()
        try:
            conn = await asyncpg.connect(self._dsn, timeout=self.timeout, **options)
        except BaseException as exc:
            if is_stall(exc):
                self._breaker.stalled(ticket)
            raise classify("cannot connect to the key store", exc) from exc
        init = self._pool_options.get("init")
        if init is not None:
            try:
                await bounded(init(conn), self.timeout)
            except BaseException as exc:
                discard(conn)  # half set up: nobody may use it
                raise classify("pool_options init failed", exc) from exc
        return conn

    async def _own_connection(self) -> tuple[Any, Callable[[Any], Awaitable[None]]]:
        """A connection kept apart from the ones handlers borrow, and how to give it back:
        one of its own with a DSN, else one from the pool."""
        if self._dsn is None:
            return await self._lender.lend(), self._lender.give_back
        await self._ready()
        return await self._connect(), _close

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
        at most once a second per tenant: see _keybound.py)."""
        path = diagnostic_text(path)
        # One deadline for the whole claim (its retries and a takeover included): a request
        # is answered within the timeout, not within a timeout per step.
        deadline = asyncio.get_running_loop().time() + self.timeout
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
            lease = Lease(tenant=tenant, key=key, token=token, seconds=lease_seconds)
            extra: tuple[int | None, ...]
            if bound is not None:
                statement, extra = sql.CLAIM_BOUNDED, (max_in_flight, bound)
            elif max_in_flight is None:
                statement, extra = sql.CLAIM, ()
            else:
                statement, extra = sql.CLAIM_CAPPED, (max_in_flight,)
            try:
                if statement is sql.CLAIM and self._claims is not None:
                    row = await self._claims.submit(
                        args, deadline=deadline, abandoned=partial(self._claim_left, lease)
                    )
                else:
                    row = await self._fetchrow(statement, *args, *extra, deadline=deadline)
            except StatementUnanswered:
                self._abandoned(lease)
                raise
            if row is None or (not row["claimed"] and row["state"] is None):
                continue  # the conflicting row is newer than our snapshot: look again
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
            expired = state == "completed" and row["expired"]
            if expired:
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
            try:
                taken = await self._execute(
                    sql.TAKE_OVER, *args, row["lease_token"], deadline=deadline
                )
            except StatementUnanswered:
                self._abandoned(lease)
                raise
            if taken:
                return Claim(Outcome.EXPIRED if expired else Outcome.TAKEN_OVER, lease=lease)
        # Lost every race in a row: someone else holds the key right now.
        return Claim(Outcome.IN_FLIGHT, lease_remaining=1.0)

    async def wait(self, *, tenant: str, key: str, timeout: float) -> None:
        """Return when the in-flight request holding this key completes or is released, or
        after `timeout` seconds, whichever is first; then claim again to see which.

        Woken by LISTEN/NOTIFY on a connection of the store's own, not one handlers borrow
        from. When no listener can be had within the time left (the database is slow, the
        pool is full), this simply sleeps out the time: the caller's next claim is its poll.
        It never raises for the store's sake."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        listener = await self._listener_within(timeout)
        if listener is None:
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            return
        token = wake_token(tenant, key)
        woken = listener.subscribe(token)
        try:
            try:
                if not await self._execute(sql.MARK_WAITING, tenant, key):
                    return  # finished (or released) before we could wait for it
            except StoreError:
                pass  # unmarked: no wake-up will come, so this waits out its time
            with contextlib.suppress(asyncio.TimeoutError):
                await bounded(asyncio.shield(woken), max(0.0, deadline - loop.time()))
        finally:
            listener.unsubscribe(token, woken)

    async def _listener_within(self, timeout: float) -> Listener | None:
        """The store's one listener, started by whichever waiter comes first and shared by
        those that come meanwhile; None when it cannot be had within `timeout`."""
        listener = self._listener
        if listener is not None and not listener.closed:
            return listener
        try:
            return await self._listening(min(timeout, self.timeout))
        except StoreError as exc:
            logger.info("waiting by polling, no listener: %s", exc)
            return None

    async def _listen(self) -> Listener:
        dead, self._listener = self._listener, None
        if dead is not None:
            await dead.close()  # its connection died: give its place back
        conn, give_back = await bounded(self._own_connection(), self.timeout)
        try:
            listener = await bounded(Listener.start(conn, give_back), self.timeout)
        except BaseException as exc:
            await give_back(conn)
            raise classify("cannot listen for completions", exc) from exc
        self._listener = listener
        return listener

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease; False when it was lost (taken over or released)."""
        if self._renewals is not None:
            renewed: bool = await self._renewals.submit(lease, deadline=self._deadline())
            return renewed
        return await self._execute(sql.RENEW, lease.tenant, lease.key, lease.token, lease.seconds)

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
            expires_at: datetime | None
            if self._completions is not None:
                expires_at = await self._completions.submit(args, deadline=self._deadline())
            else:
                expires_at = await self._call("fetchval", sql.COMPLETE, *args)
            return expires_at
        statement = self._complete_in_transaction or sql.COMPLETE
        # Inside the caller's transaction: a failure here may be the caller's (an aborted
        # transaction), so it is raised as it is, for the caller to tell which.
        return await conn.fetchval(  # type: ignore[no-any-return]
            statement, *args, timeout=self.timeout if timeout is None else timeout
        )

    async def release(self, lease: Lease) -> None:
        """Give the key up so that the next retry runs afresh (after a 5xx, an error...)."""
        if self._releases is not None:
            await self._releases.submit(lease, deadline=self._deadline())
            return
        await self._call("execute", sql.RELEASE, lease.tenant, lease.key, lease.token)

    # -- batching (see _batching.py and the *_MANY statements) ----------------------------

    def _batchers(self) -> list[Batcher[Any, Any]]:
        found = [self._claims, self._completions, self._releases, self._renewals]
        return [batcher for batcher in found if batcher is not None]

    def batching(self) -> dict[str, tuple[int, int]]:
        """Statements sent and rows they carried, per kind (claim, completion, release,
        renewal), since the store was made: how much batching saved."""
        names = ("claim", "completion", "release", "renewal")
        found = (self._claims, self._completions, self._releases, self._renewals)
        return {n: (b.statements, b.rows) for n, b in zip(names, found, strict=True) if b}

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.timeout

    def _claim_left(self, lease: Lease, row: Any) -> None:
        """A claim's request stopped waiting while its batch was in flight: free what it got."""
        if row is not None and row["claimed"]:
            self.release_soon(lease)

    async def _claim_rows(self, batch: Sequence[tuple[Any, ...]], timeout: float) -> list[Any]:
        rows = [args[:8] for args in batch]  # the format version goes once, as $9
        return await self._batched(
            batch,
            timeout,
            one=(sql.CLAIM, "fetchrow"),
            many=sql.CLAIM_MANY,
            columns=rows,
            extra=(FORMAT_VERSION,),
            result=lambda row: row,
        )

    async def _complete_rows(self, batch: Sequence[tuple[Any, ...]], timeout: float) -> list[Any]:
        # COMPLETE's arguments: tenant, key, token, format, status, headers, body, ttl.
        rows = [(a[0], a[1], a[2], a[4], a[5], a[6], a[7]) for a in batch]
        return await self._batched(
            batch,
            timeout,
            one=(sql.COMPLETE, "fetchval"),
            many=sql.COMPLETE_MANY,
            columns=rows,
            extra=(FORMAT_VERSION,),
            result=lambda row: row["expires_at"],
        )

    async def _release_rows(self, batch: Sequence[Lease], timeout: float) -> list[Any]:
        args = [(lease.tenant, lease.key, lease.token) for lease in batch]
        return await self._batched(
            args,
            timeout,
            one=(sql.RELEASE, "execute"),
            many=sql.RELEASE_MANY,
            columns=args,
            extra=(),
            result=None,
        )

    async def _renew_rows(self, batch: Sequence[Lease], timeout: float) -> list[Any]:
        args = [(lease.tenant, lease.key, lease.token, lease.seconds) for lease in batch]
        results = await self._batched(
            args,
            timeout,
            one=(sql.RENEW, "execute"),
            many=sql.RENEW_MANY,
            columns=args,
            extra=(),
            result=lambda row: bool(row["renewed"]),
        )
        # RENEW alone answers with its status ("INSERT 0 1"): renewed when it wrote a row.
        return [_wrote(r) if isinstance(r, str) else r for r in results]

    async def _batched(
        self,
        batch: Sequence[tuple[Any, ...]],
        timeout: float,
        *,
        one: tuple[str, str],
        many: str,
        columns: Sequence[Sequence[Any]],
        extra: tuple[Any, ...],
        result: Callable[[Any], Any] | None,
    ) -> list[Any]:
        """Run `batch` as one statement (`many`), or, for one item, as the statement a lone
        request has always run (`one`: the statement and the call). Returns each item's
        result, or the exception it met on its own."""
        deadline = asyncio.get_running_loop().time() + timeout
        query, method = one
        if len(batch) == 1 and not self._arrays_always:
            return [await self._call(method, query, *batch[0], deadline=deadline)]
        try:
            rows = await self._call("fetch", many, *arrays(columns), *extra, deadline=deadline)
        except StoreRefused:
            # Refused for good: maybe for one row's sake. Each alone, so that one row's
            # fault fails that row only.
            return [await self._alone(method, query, args, deadline) for args in batch]
        if result is None:
            return [None] * len(batch)
        by_row = {row["n"]: result(row) for row in rows}
        return [by_row.get(n) for n in range(1, len(batch) + 1)]

    async def _alone(self, method: str, query: str, args: tuple[Any, ...], deadline: float) -> Any:
        try:
            return await self._call(method, query, *args, deadline=deadline)
        except StoreError as exc:
            return exc

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
        It is held on a connection kept apart from the ones handlers borrow; the lock goes
        with that connection, so a runner that dies frees it for another, and so does
        leaving (the connection is closed, or reset)."""
        try:
            conn, give_back = await self._own_connection()
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

    def transaction(self) -> Transaction:
        """A transaction for one request, opened only if the handler asks for its connection."""
        return Transaction(self)

    # -- plumbing --------------------------------------------------------------------------

    async def _call(
        self, method: str, query: str, *args: Any, deadline: float | None = None
    ) -> Any:
        """One statement: `method` is fetchrow, fetch, fetchval or execute. It runs on one of
        the store's statement connections, or on the pool when the store was given one.
        Everything it waits for (opening, a free connection, the statement) fits in the
        timeout, or in what is left until `deadline` (the loop's clock) when one is given."""
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.timeout
        ticket = self._breaker.admit()
        try:
            return await self._statement(ticket, deadline, method, query, args)
        finally:
            self._breaker.ended(ticket)

    async def _statement(
        self, ticket: Ticket, deadline: float, method: str, query: str, args: Any
    ) -> Any:
        loop = asyncio.get_running_loop()

        def left() -> float:
            seconds = deadline - loop.time()
            if seconds <= 0:
                raise StoreUnavailable(f"the key store did not answer within {self.timeout:g} s")
            return seconds

        await self._ready(left())
        statements = self._statements
        try:
            if statements is None:
                conn = await self._lender.acquire(left())
            else:
                conn = await statements.acquire(left())
        except asyncio.TimeoutError as exc:
            raise StoreUnavailable("no free connection to the key store in time") from exc
        try:
            budget = left()
        except StoreUnavailable:
            await self._give_back_unused(conn, statements)
            raise
        try:
            result = await getattr(conn, method)(query, *args, timeout=budget)
        except BaseException as exc:
            if statements is None:
                await self._lender.give_back(conn)  # the pool waits for a cancellation
            elif isinstance(exc, asyncpg.PostgresError) and not isinstance(exc, SESSION_ENDED):
                statements.release(conn)  # the server answered: the connection is fine
            else:
                # A timeout, a cancelled request or a lost connection: a cancel request may
                # be on its way to the server. The connection serves again only once it has
                # landed (see connections.settle).
                statements.interrupted(conn)
            # Only a statement the server never answered tells that it is stuck: one lost
            # connection (a backend terminated, an idle timeout) is that connection's fate.
            if isinstance(exc, asyncio.TimeoutError):
                self._breaker.stalled(ticket)
            elif isinstance(exc, asyncpg.PostgresError) and not isinstance(exc, SESSION_ENDED):
                self._breaker.succeeded()
            if isinstance(exc, asyncpg.exceptions.UndefinedTableError):
                raise StoreUnavailable(f"{SCHEMA_MISSING} ({exc})") from exc
            if isinstance(exc, (asyncio.TimeoutError, *SESSION_ENDED)):
                raise StatementUnanswered(f"key store statement got no answer: {exc!r}") from exc
            raise classify("key store statement failed", exc) from exc
        await self._give_back_unused(conn, statements)
        self._breaker.succeeded()
        return result

    async def _give_back_unused(self, conn: Any, statements: Statements | None) -> None:
        """Return a statement connection that is idle (its statement ended normally) to
        where it came from (not to `self._statements`, which close() may have ended since)."""
        if statements is None:
            await self._lender.give_back(conn)
        else:
            statements.release(conn)

    async def _fetchrow(self, query: str, *args: Any, deadline: float | None = None) -> Any:
        return await self._call("fetchrow", query, *args, deadline=deadline)

    async def _fetch(self, query: str, *args: Any) -> list[Any]:
        return list(await self._call("fetch", query, *args))

    async def _count(self, query: str, *args: Any, deadline: float | None = None) -> int:
        """Run a row-changing statement; return how many rows it changed."""
        status: str = await self._call("execute", query, *args, deadline=deadline)
        return int(status.rsplit(" ", 1)[-1])

    async def _execute(self, query: str, *args: Any, deadline: float | None = None) -> bool:
        """Run a row-changing statement; True when it changed a row."""
        return await self._count(query, *args, deadline=deadline) > 0

    # -- lending connections to handlers (see _lending.py) ---------------------------------

    async def lend(self) -> Any:
        """A pooled connection for code other than the store's (a handler's transaction):
        its session is reset before the pool hands it to anyone else."""
        await self._ready()
        conn = await self._lender.lend()
        if self._complete_in_transaction is None:
            try:
                await self._name_tables(conn)
            except BaseException as exc:
                await self._lender.give_back(conn)
                raise classify("cannot read the schema", exc) from exc
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

    async def begin(self, conn: Any) -> Any:
        """Start the transaction of a connection from `lend()`, within the timeout."""
        return await self._lender.begin(conn)

    async def commit(self, conn: Any, tx: Any, lease: Lease, *, timeout: float) -> None:
        """Commit the transaction `tx` of a connection from `lend()` within `timeout`; a
        COMMIT that outlives it raises CommitPending and goes on (see _lending.py), and frees
        the key of `lease` if it then fails."""
        await self._lender.commit(
            conn, tx, timeout=timeout, if_rolled_back=lambda: self._release_until_lapsed(lease)
        )

    async def rollback(self, conn: Any, tx: Any) -> None:
        await self._lender.rollback(conn, tx)

    async def give_back(self, conn: Any) -> None:
        """Return a connection from `lend()`; a second call for the same one is ignored."""
        await self._lender.give_back(conn)

    def _abandoned(self, lease: Lease) -> None:
        """A claim got no answer, and its request is answered 503: if it did reserve the key
        (a COMMIT that waited for a lost standby lands once its cancel does), nobody would
        ever complete it, and every retry would get a 409 until the lease lapsed. Free it,
        once its cancel has had the time to land (before that the row is not visible, and a
        release would find nothing)."""
        self.release_soon(lease, after=self.timeout)

    def release_soon(self, lease: Lease, *, after: float = 0.0) -> None:
        """Free the key in the background: for an owner whose release failed because the
        database was away (a failover, a restart). It tries again until the lease would
        have lapsed anyway; a retry of the key then runs as soon as the database is back,
        not a whole lease later."""
        task = asyncio.ensure_future(self._release_until_lapsed(lease, after=after))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_until_lapsed(self, lease: Lease, *, after: float = 0.0) -> None:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + lease.seconds
        await asyncio.sleep(after)
        pause = 0.1
        while True:
            try:
                await self.release(lease)
                return
            except StoreRefused as exc:
                logger.error("could not free the key; it is free when its lease lapses: %s", exc)
                return
            except StoreUnavailable as exc:
                if loop.time() + pause >= give_up_at:
                    logger.warning("could not free the key before its lease lapsed: %s", exc)
                    return
            await asyncio.sleep(pause)
            pause = min(pause * 2, COOLDOWN_SECONDS)  # a probe's pace once it is back


def _args_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return args[0], args[1]  # tenant, key


def _lease_key(lease: Lease) -> tuple[str, str]:
    return lease.tenant, lease.key


def _wrote(status: str) -> bool:
    return int(status.rsplit(" ", 1)[-1]) > 0


async def _close(conn: Any) -> None:
    with contextlib.suppress(*DATABASE_ERRORS):
        await conn.close(timeout=1)
    discard(conn)
