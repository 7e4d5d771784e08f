"""The plumbing every protocol of the store runs on: opening the database, the store's own
statement connections, one statement within a caller's deadline, the pool handlers borrow
from, and the breaker in front of new work.

The breaker (see outages.py) guards new work only: a claim, the atomic mode's first
statements. What ends work already admitted (a completion, a release, a renewal, a
handler's COMMIT) is never refused while the database answers, and never opens the breaker:
a recorded answer refused by a breaker would be sent unrecorded, and its retry would run the
request again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import asyncpg

from .._errors import (
    SCHEMA_MISSING,
    StatementUnanswered,
    StoreError,
    StoreRefused,
    StoreUnavailable,
)
from . import sql
from .connections import (
    DATABASE_ERRORS,
    POOL_ONLY,
    SESSION_ENDED,
    Statements,
    bounded,
    classify,
    discard,
    is_stall,
    server_answered,
)
from .deadlines import Deadlines
from .lending import Lender
from .outages import COOLDOWN_SECONDS, Breaker, SharedAttempt, Ticket
from .stalls import Stalls
from .urls import asyncpg_url


class _Unreached:
    def __repr__(self) -> str:
        return "UNREACHED"


#: A batched statement's answer for a row it did not reach (see `Database.batched`).
UNREACHED: Final = _Unreached()


#: Settings of the store's own connections (the application's may override them through
#: `pool_options["server_settings"]`). Every statement the store runs reaches its rows through
#: an index or by TID: a scan of the key table is never the plan it wants. asyncpg prepares a
#: statement once per connection, and PostgreSQL keeps the generic plan it made then until the
#: table's statistics change: planned while the key table was nearly empty (a new install, or
#: a benchmark's first minute), the batched completion scanned the whole table on every run
#: until autovacuum next analysed it (3.8 ms a statement at 13,000 rows against 0.2 ms; plain
#: new keys ran at 0.64x their unbatched throughput). Without a scan to choose, the plan does
#: not depend on how large the table was when it was made.
#:
#: And one plan per statement and connection, the generic one, for the batched statements
#: too. PostgreSQL plans a prepared statement anew for its first five runs, and then keeps
#: doing so while that plan looks cheaper than the generic one: a batch's arrays are shorter
#: than the ten rows the generic plan assumes, so the batched claim, completion, release and
#: look were planned on every run, 50 to 70 µs of PostgreSQL's CPU a request in plain and
#: two-phase modes under load, more than their execution (`python -m bench.pg_time`). Their
#: generic plans reach the key table by its primary key or by TID whenever it holds a row,
#: and a batch only ever concerns rows the table holds; they read the lease table by its
#: key, row by row, however small it was when they were made (sql.waited_for's `per_row`).
#: tests/test_batching.py counts what they read of both. Not asked for where Citus is
#: installed (see `_learn_distribution`).
#:
#: A pooler that refuses a setting at startup (PgBouncer, unless told to ignore it), or a
#: server that does not know one, gets connections without it.
STORE_SETTINGS = {"enable_seqscan": "off", "plan_cache_mode": "force_generic_plan"}

#: How a setting is refused at startup: a pooler's protocol violation (PgBouncer), or
#: PostgreSQL's undefined object (`plan_cache_mode` before PostgreSQL 12).
_REFUSALS = ("08P01", "42704")


def _refused(exc: BaseException, settings: Mapping[str, str]) -> set[str]:
    """The store's `settings` the server (a pooler in front of PostgreSQL, or PostgreSQL
    itself) refused at startup, when connecting failed for that."""
    if getattr(exc, "sqlstate", None) not in _REFUSALS:
        return set()
    message = str(exc)
    return {name for name in settings if name in message}


#: Time a connection attempt must still have to be tried again without the store's settings.
RETRY_MARGIN_SECONDS = 0.05

#: How often a store that found a Citus cluster's key table not distributed looks again.
LOOK_AGAIN_SECONDS = 10.0


class Database:
    """One database, as the store's protocols use it. With a DSN it owns a pool (for
    handlers' transactions) and `statement_connections` connections of its own (for the
    store's one-statement calls); with a pool passed in, everything runs on that pool, which
    it never closes. After `close()` nothing opens again until `open()` is called."""

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool | Callable[[], asyncpg.Pool],
        *,
        timeout: float,
        min_size: int,
        max_size: int,
        pool_options: Mapping[str, Any] | None,
        statement_connections: int,
        deadlines: Deadlines | None = None,
    ) -> None:
        self.timeout = timeout
        #: the store's one timer for bounded steps (see deadlines.py)
        self.deadlines = deadlines or Deadlines(timeout)
        self._pool_options = dict(pool_options or {})
        self._min_size = min(min_size, max_size)  # a pool of one keeps one
        self._max_size = max_size
        self.cooldown = min(COOLDOWN_SECONDS, timeout)
        self.breaker = Breaker(self.cooldown)
        self.lender = Lender(timeout=timeout, deadlines=self.deadlines)
        self._statements: Statements | None = None
        self._statement_connections = statement_connections
        self._opening = SharedAttempt(
            self._open, what="opening the key store", cooldown=self.cooldown
        )
        self._closed = False
        #: For tests only: one row goes as an array too, so that a suite of one-at-a-time
        #: requests runs the batched statements.
        self.arrays_always = False
        #: the key table and the lease table, schema-qualified, once a lent connection told
        self.tables: tuple[str, str] | None = None
        #: the isolation level a transaction begun without one gets, once a lent connection
        #: told (`default_transaction_isolation`)
        self.default_isolation: str | None = None
        #: whether the key table is distributed by Citus (read when the store opens): the
        #: protocols then run only statements that Citus routes to one shard (docs:
        #: scaling-out.md), and share none across requests
        self.distributed = False
        self._learned = False
        self._learning = self._new_learning()
        #: when a Citus cluster's key table that was not distributed is looked at again
        self._look_again_at: float | None = None
        self._qualified: dict[str, str] = {}
        self._store_settings = dict(STORE_SETTINGS)  # emptied if the server refuses them
        #: the application's pool, read when the store opens (made by its own startup)
        self._pool_of: Callable[[], asyncpg.Pool] | None = None
        self._given: asyncpg.Pool | None = None
        #: With a pool of the application's: one connection of the store's own beside it,
        #: for the looks that answer a duplicate or a replay while every pooled connection
        #: is taken (see `_beside`); None where it cannot be made.
        self.looks: Statements | None = None
        #: the requests' transactions watched for sessions waiting on them (see stalls.py)
        self.stalls = Stalls(self.deadlines, self._stalled)
        if isinstance(dsn_or_pool, str):
            # Read now: a URL the store cannot use is a configuration error, raised here,
            # never an outage found at the first connection (see urls.py).
            self.dsn: str | None = asyncpg_url(dsn_or_pool)
        elif isinstance(dsn_or_pool, asyncpg.Pool):
            self.dsn, self._given = None, dsn_or_pool
            self.lender.attach(dsn_or_pool)
        elif callable(dsn_or_pool):
            self.dsn, self._pool_of = None, dsn_or_pool
        else:
            # A URL object (SQLAlchemy's URL, pydantic's PostgresDsn): its text is not always
            # what str() gives (SQLAlchemy hides the password), so the caller says which.
            raise TypeError(
                f"the store takes a database URL as a str, an asyncpg pool, or a function "
                f"returning one, not {type(dsn_or_pool).__name__}: pass the URL's text "
                f"(str(dsn); for SQLAlchemy, url.render_as_string(hide_password=False))"
            )

    # -- opening and closing ---------------------------------------------------------------

    async def open(self) -> None:
        self._closed = False
        if self._pool_of is not None:
            pool = self._pool_of()
            if not isinstance(pool, asyncpg.Pool):
                raise TypeError(f"the store's pool function returned {pool!r}, not an asyncpg Pool")
            self._given = pool
        if self._given is not None and not self.lender.opened:
            self.lender.attach(self._given)
            self.looks = _beside(self._given, self.timeout, self.deadlines)
        await self.ready()
        if self._given is not None:
            try:
                conn = await self._given.acquire(timeout=self.timeout)
            except BaseException as exc:
                # A pool the application drained says nothing of the database: not a guess
                # either way, the store's failure to read (503), read again when asked.
                raise StoreUnavailable(
                    f"cannot read whether the key table is distributed: {exc!r}"
                ) from exc
            try:
                await self._learn_distribution(conn)
                if self.tables is None:
                    # Now rather than at the first request's loan (which runs the atomic
                    # mode's long path until then); that loan tries again if this fails.
                    with contextlib.suppress(*DATABASE_ERRORS):
                        await self._name_tables(conn)
            finally:
                await self._given.release(conn)

    async def close(self) -> None:
        self._closed = True
        self._opening.cancel()
        # A fresh attempt for the next open(): the cancelled one is not a failure to remember.
        self._opening = SharedAttempt(
            self._open, what="opening the key store", cooldown=self.cooldown
        )
        self._learning.cancel()
        self._learning = self._new_learning()
        self.stalls.close()
        if self._statements is not None:
            statements, self._statements = self._statements, None
            await statements.close()
        if self.looks is not None:
            looks, self.looks = self.looks, None
            await looks.close()
        await self.lender.close()

    async def spread(self, timeout: float | None = None) -> bool:
        """Whether the key table is distributed by Citus, the store opened first if need be
        (which is when that is read). Read again while it could not be (a pool given and
        never opened, a key table not there yet), and every LOOK_AGAIN_SECONDS while Citus is
        there and the table is not distributed (`migrate`, then `migrate --distribute`, with
        servers running): one reading for every caller, within `timeout` (the store's by
        default), failing closed."""
        seconds = self.timeout if timeout is None else timeout
        await self.ready(seconds)
        if not self._learned or (
            self._look_again_at is not None and time.monotonic() >= self._look_again_at
        ):
            await self._learning(seconds)
        return self.distributed

    def settled(self) -> bool:
        """Whether the store is open and knows for now whether the key table is distributed
        (what `spread` would otherwise await)."""
        return (
            self.lender.opened
            and self._learned
            and (self._look_again_at is None or time.monotonic() < self._look_again_at)
        )

    def _new_learning(self) -> SharedAttempt[None]:
        # Shared while under way, never remembered as failed: what fails it is as often a
        # pool the application drained (nothing to do with the database) as an outage, and
        # an outage fails the request's own statements at once anyway.
        return SharedAttempt(
            self._learn_again, what="reading the key table's distribution", cooldown=0.0
        )

    async def _learn_again(self) -> None:
        if not self.lender.opened:
            raise StoreUnavailable("the key store is closed")
        conn = await self.lender.acquire()
        try:
            await self._learn_distribution(conn)
        finally:
            await self.lender.give_back(conn)

    async def ready(self, timeout: float | None = None) -> None:
        if not self.lender.opened:
            if self.dsn is None or self._closed:
                raise StoreUnavailable("the key store is closed")
            # One attempt for every caller, each waiting no longer than its own timeout;
            # a failure is remembered briefly, so an outage fails every caller at once.
            await self._opening(self.timeout if timeout is None else timeout)

    async def _open(self) -> None:
        self.stalls.open()
        # The connections lent to handlers: the store's own, the first `min_size` of them
        # made now (a failure to make them is a failure to open).
        lent = Statements(self._connect_lent, self._max_size, self.timeout, self.deadlines)
        ticket = self.breaker.ticket()
        first: list[Any] = []
        try:
            deadline = time.monotonic() + self.timeout
            for _ in range(max(self._min_size, 1)):
                first.append(await lent.acquire(max(deadline - time.monotonic(), 0.001)))
        except BaseException as exc:
            for conn in first:
                discard(conn)
            await lent.close()
            if is_stall(exc.__cause__ or exc):
                self.breaker.stalled(ticket)
            raise classify("cannot open the key store", exc) from exc
        try:
            if self._closed:  # closed while it opened: nobody will close these
                raise StoreUnavailable("the key store is closed")
            await self._learn_distribution(first[0])
            with contextlib.suppress(*DATABASE_ERRORS):  # see open()
                await self._name_tables(first[0])
        except BaseException:
            for conn in first:
                discard(conn)
            await lent.close()
            raise
        for conn in first:
            lent.release(conn)
        self.lender.own(lent)
        self._statements = Statements(self.connect, self._statement_connections, self.timeout)

    async def _connect_lent(self, timeout: float) -> Any:
        """A connection to lend to handlers: the pool options' settings, not the store's."""
        return await self.connect(timeout, store_settings=False)

    async def _learn_distribution(self, conn: Any) -> None:
        """Whether the key table is distributed by Citus (catalog reads on `conn`, at open).
        Learned for good once the key table is there (without Citus, at once); a failure to
        read it is the store's failure (503), never a guess: a wrong answer would put the
        atomic mode's lock on another node than the claims' (docs: scaling-out.md)."""
        try:
            if not await conn.fetchval(sql.HAS_CITUS, timeout=self.timeout):
                self.distributed, self._learned, self._look_again_at = False, True, None
                return
            # Citus plans a statement about one tenant with its parameters' values and has no
            # generic plan to give: its statements are left to PostgreSQL's choice (batching,
            # which the setting is for, is off on a distributed table anyway). Asked of the
            # extension, not of the table, so that one distributed later is served too.
            self._store_settings.pop("plan_cache_mode", None)
            distributed = await conn.fetchval(sql.KEYS_DISTRIBUTED, timeout=self.timeout)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            raise StoreUnavailable(
                f"cannot read whether the key table is distributed: {exc!r}"
            ) from exc
        self.distributed = bool(distributed)
        self._learned = distributed is not None  # None: no key table yet
        self._look_again_at = None if self.distributed else time.monotonic() + LOOK_AGAIN_SECONDS

    async def connect(self, timeout: float, *, store_settings: bool = True) -> Any:
        """A connection of the store's own, made with the pool options, within `timeout` in
        all (connecting, and the pool options' `init`). `store_settings`: for the store's
        statements (STORE_SETTINGS); without, for handlers (and with the application's
        record and connection classes)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        options = {k: v for k, v in self._pool_options.items() if k not in POOL_ONLY}
        given = options.get("server_settings") or {}
        ours = self._store_settings if store_settings else {}
        if not store_settings:
            for name in ("record_class", "connection_class"):
                if name in self._pool_options:
                    options[name] = self._pool_options[name]
        try:
            while True:
                try:
                    conn = await asyncpg.connect(
                        self.dsn,
                        timeout=max(deadline - loop.time(), 0.001),
                        **{**options, "server_settings": {**ours, **given}},
                    )
                    break
                except asyncpg.PostgresError as exc:
                    refused = _refused(exc, ours)
                    if not refused or deadline - loop.time() < RETRY_MARGIN_SECONDS:
                        raise  # not that, or no time left to connect again
                    # A pooler that passes on only the settings it was told to (PgBouncer:
                    # "unsupported startup parameter"), or a server that does not know one:
                    # without those, then, from now on; the others are asked for again.
                    ours = {name: value for name, value in ours.items() if name not in refused}
                    self._store_settings = ours
        except BaseException as exc:
            # The breaker hears of it from the new work that needed the connection, if any
            # (see _statement): a completion's reconnect is not new work.
            raise classify("cannot connect to the key store", exc) from exc
        init = self._pool_options.get("init")
        if init is not None:
            try:
                await bounded(init(conn), max(deadline - loop.time(), 0.0))
            except BaseException as exc:
                discard(conn)  # half set up: nobody may use it
                raise classify("pool_options init failed", exc) from exc
        return conn

    @property
    def apart(self) -> bool:
        """Whether the store has connections of its own for its statements, apart from the
        ones handlers borrow (with a DSN, once open)."""
        return self._statements is not None

    async def own_connection(self) -> tuple[Any, Callable[[Any], Awaitable[None]]]:
        """A connection kept apart from the ones handlers borrow, and how to give it back:
        one of its own with a DSN, else one from the pool."""
        if self.dsn is None:
            await self.ready()
            return await self.lender.lend(), self.lender.give_back
        await self.ready()
        return await self.connect(self.timeout), _close

    # -- one statement ---------------------------------------------------------------------

    async def call(
        self,
        method: str,
        query: str,
        *args: Any,
        deadline: float | None = None,
        new_work: bool = False,
    ) -> Any:
        """One statement: `method` is fetchrow, fetch, fetchval or execute. It runs on one of
        the store's statement connections, or on the pool when the store was given one.
        Everything it waits for (opening, a free connection, the statement) fits in the
        timeout, or in what is left until `deadline` (the loop's clock) when one is given.
        `new_work`: the breaker may refuse it, and its stall opens the breaker."""
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.timeout
        if not new_work:
            return await self._statement(None, deadline, method, query, args)
        ticket = self.breaker.admit()
        try:
            return await self._statement(ticket, deadline, method, query, args)
        finally:
            self.breaker.ended(ticket)

    async def _statement(
        self, ticket: Ticket | None, deadline: float, method: str, query: str, args: Any
    ) -> Any:
        loop = asyncio.get_running_loop()

        def left() -> float:
            seconds = deadline - loop.time()
            if seconds <= 0:
                raise StoreUnavailable(f"the key store did not answer within {self.timeout:g} s")
            return seconds

        await self.ready(left())
        statements = self._statements
        try:
            if statements is None:
                conn = await self.lender.acquire(left())
            else:
                conn = await statements.acquire(left())
        except asyncio.TimeoutError as exc:
            raise StoreUnavailable("no free connection to the key store in time") from exc
        except StoreError as exc:
            # New work could not even connect. (A pool passed in that the application drained
            # says nothing of the database: waiting on it out is not a stall.)
            if ticket is not None and statements is not None and is_stall(exc.__cause__ or exc):
                self.breaker.stalled(ticket)
            raise
        try:
            budget = left()
        except StoreUnavailable:
            await self._give_back_unused(conn, statements)
            raise
        try:
            result = await getattr(conn, method)(query, *args, timeout=budget)
        except BaseException as exc:
            answered = server_answered(exc)
            if statements is None:
                await self.lender.give_back(conn)  # the pool waits for a cancellation
            elif answered:
                statements.release(conn)  # the server answered: the connection is fine
            else:
                # A timeout, a cancelled request or a lost connection: a cancel request may
                # be on its way to the server. The connection serves again only once it has
                # landed (see connections.settle).
                statements.interrupted(conn)
            # Only a statement the server never answered tells that it is stuck: one lost
            # connection (a backend terminated, an idle timeout) is that connection's fate.
            if isinstance(exc, asyncio.TimeoutError):
                if ticket is not None:
                    self.breaker.stalled(ticket)
            elif answered:
                self.breaker.succeeded()
            if isinstance(exc, asyncpg.exceptions.UndefinedTableError):
                raise StoreUnavailable(f"{SCHEMA_MISSING} ({exc})") from exc
            if isinstance(exc, (asyncio.TimeoutError, *SESSION_ENDED)):
                raise StatementUnanswered(f"key store statement got no answer: {exc!r}") from exc
            raise classify("key store statement failed", exc) from exc
        await self._give_back_unused(conn, statements)
        self.breaker.succeeded()
        return result

    async def look(self, query: str, *args: Any, deadline: float, method: str = "fetchrow") -> Any:
        """One row read (`method`: fetchrow, or fetch for every row) on the connection kept
        for looks (see `looks`), by `deadline`."""
        looks = self.looks
        assert looks is not None
        left = max(deadline - asyncio.get_running_loop().time(), 0.001)
        try:
            conn = await looks.acquire(left)
        except asyncio.TimeoutError as exc:
            raise StoreUnavailable("no free connection to the key store in time") from exc
        step = self.deadlines.start(conn.terminate, at=deadline)
        try:
            row = await getattr(conn, method)(query, *args)
        except BaseException as exc:
            discard(conn)
            looks.release(conn)
            raise classify("cannot look at the key", exc) from exc
        finally:
            self.deadlines.end(step)
        looks.release(conn)
        return row

    async def _stalled(self, method: str, query: str, *args: Any) -> Any:
        """stalls.py's statements: on the connection kept for looks where there is one (a
        pool the requests may have taken whole), else on a statement connection (`call`)."""
        if self.looks is not None:
            deadline = asyncio.get_running_loop().time() + self.timeout
            return await self.look(query, *args, deadline=deadline, method=method)
        return await self.call(method, query, *args)

    async def _give_back_unused(self, conn: Any, statements: Statements | None) -> None:
        """Return a statement connection that is idle (its statement ended normally) to
        where it came from (not to `self._statements`, which close() may have ended since)."""
        if statements is None:
            await self.lender.give_back(conn)
        else:
            statements.release(conn)

    async def batched(
        self,
        items: Sequence[tuple[Any, ...]],
        timeout: float,
        wanted: Callable[[int], bool],
        *,
        one: tuple[str, str],
        many: str,
        columns: Sequence[Sequence[Any]],
        extra: tuple[Any, ...],
        result: Callable[[Any], Any],
        new_work: bool = False,
    ) -> list[Any]:
        """Run `items` as one statement (`many`: a row per item, numbered from 1 as `n`), or,
        for one item, as the statement a lone request has always run (`one`: the statement
        and the call). Returns each item's result (`result` of its row), UNREACHED for an
        item the statement answered no row for, or the exception the item met on its own."""
        deadline = asyncio.get_running_loop().time() + timeout
        query, method = one
        if len(items) == 1 and not self.arrays_always:
            return [await self.call(method, query, *items[0], deadline=deadline, new_work=new_work)]
        try:
            rows = await self.call(
                "fetch", many, *arrays(columns), *extra, deadline=deadline, new_work=new_work
            )
        except StoreRefused:
            # Refused for good: maybe for one row's sake. Each alone, so that one row's fault
            # fails that row only; rows nobody waits for any more are not run again.
            return [
                await self.alone(method, query, args, deadline)
                if wanted(i)
                else StoreUnavailable("nobody waits for this row any more")
                for i, args in enumerate(items)
            ]
        by_row = {row["n"]: result(row) for row in rows}
        return [by_row.get(n, UNREACHED) for n in range(1, len(items) + 1)]

    async def alone(self, method: str, query: str, args: tuple[Any, ...], deadline: float) -> Any:
        """One item's statement on its own: its result, or the StoreError it met."""
        try:
            return await self.call(method, query, *args, deadline=deadline)
        except StoreError as exc:
            return exc

    async def count(self, query: str, *args: Any, deadline: float | None = None) -> int:
        """Run a row-changing statement; return how many rows it changed."""
        status: str = await self.call("execute", query, *args, deadline=deadline)
        return rows_in(status)

    # -- lending connections to handlers (see lending.py) ---------------------------------

    async def lend(self, timeout: float | None = None, *, reset: bool = True) -> Any:
        """A pooled connection for code other than the store's (a handler's transaction):
        its session is reset before the pool hands it to anyone else (see `Lender.lend`)."""
        await self.ready(timeout)
        conn = await self.lender.lend(timeout, reset=reset)
        setup = self._pool_options.get("setup")
        if setup is not None and self.dsn is not None:
            # As asyncpg's pool calls it on every acquire (a pool of the application's calls
            # it itself): the store's own connections are lent the same way.
            try:
                await bounded(setup(conn), self.timeout)
            except BaseException as exc:
                discard(conn)
                await self.lender.give_back(conn)
                raise classify("pool_options setup failed", exc) from exc
        if self.tables is None:
            try:
                await self._name_tables(conn)
            except BaseException as exc:
                await self.lender.give_back(conn)
                raise classify("cannot read the schema", exc) from exc
        return conn

    async def _name_tables(self, conn: Any) -> None:
        """Look up, once, where the tables are, for the statements that run on connections
        lent to handlers (whose search_path is theirs to change): on such a connection,
        before the handler has it."""
        names = await conn.fetchrow(sql.TABLE_NAMES, timeout=self.timeout)
        self.default_isolation = names["isolation"]
        if names["keys"] is not None and names["leases"] is not None:
            self.tables = (names["keys"], names["leases"])

    @property
    def schema(self) -> str:
        """The key table's schema, quoted (once a lent connection told)."""
        assert self.tables is not None
        return self.tables[0].rsplit(".", 1)[0]

    def qualified(self, statement: str) -> str:
        """`statement` with its tables named by schema, as a handler's connection needs them
        (the statement as it is until a lent connection has told where they are)."""
        if self.tables is None:
            return statement
        named = self._qualified.get(statement)
        if named is None:
            named = self._qualified[statement] = sql.qualified(statement, *self.tables)
        return named


#: asyncpg's private method of its pool that makes a connection as the pool does (see
#: `_beside`).
POOLS_CONNECT = "_get_new_connection"


def _beside(pool: asyncpg.Pool, timeout: float, deadlines: Deadlines) -> Statements | None:
    """One connection made as `pool` makes its own, kept apart from it (opened when first
    needed), or None where this asyncpg's pool does not say how it connects.

    asyncpg's pool has no public way to make a connection like its own: its connect
    arguments and its method that uses them are private (`_get_new_connection`). They are
    used here for one connection, for looks only; without them (another asyncpg), a look
    waits for a pooled connection as everything else does (tests/test_small_pool.py covers
    both)."""
    connect = getattr(pool, POOLS_CONNECT, None)
    if connect is None:
        return None

    async def made(seconds: float) -> Any:
        try:
            return await bounded(connect(), seconds)
        except BaseException as exc:
            raise classify("cannot connect to the key store", exc) from exc

    return Statements(made, 1, timeout, deadlines)


def arrays(rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """Columns out of rows: what `unnest($1::t[], $2::t[], ...)` reads back as rows."""
    return [list(column) for column in zip(*rows, strict=True)]


def rows_in(status: str) -> int:
    """How many rows a statement's status (`DELETE 3`, `SELECT 0`) says it touched."""
    return int(status.rsplit(" ", 1)[-1])


async def _close(conn: Any) -> None:
    with contextlib.suppress(*DATABASE_ERRORS):
        await conn.close(timeout=1)
    discard(conn)
