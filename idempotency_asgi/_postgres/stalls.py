"""A request's transaction that another session waits on while it sits idle.

A handler that writes through the request's connection and then through a session of its own
(an application's old session, a second pool) can wait on its own request: the second
session's statement waits for a lock the request's transaction holds, and the request's
transaction sits idle, waiting for the handler. Neither ends by itself, and PostgreSQL's
deadlock detector cannot see it (one side of the cycle is the application, not a backend).

So every request's transaction is watched from `transaction_idle_seconds` after it began:
while any is that old, one statement a second, on a connection of the store's own, asks
PostgreSQL which of them sit idle in transaction while a session has waited on them for that
long. Those requests are marked `stalled` first, and then the waiting statements are
cancelled (`pg_cancel_backend`). The handler's own session fails with a cancelled statement,
the request's transaction is still whole (its writes roll back with it, or commit if the
handler answers anyway), and a failure of the request's after that (the cancelled statement
in what it raised, or a 5xx) holds its key, since what the other session wrote may have
committed (see _asgi/onecommit.py and _asgi/execution.py).

Nothing is done to a transaction that is idle but blocks nobody (a handler awaiting a slow
provider), nor to one that is busy: those end by themselves, or by the application's own
timeouts. Only a session of the same role as the request's is cancelled (an application's own;
not a migration run by the tables' owner, say), and only where the store's role may see it
(pg_stat_activity shows a role's sessions to itself, its members and pg_read_all_stats). A
request costs one step of the store's timer (see deadlines.py) until it is that old, and nothing
more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .deadlines import Deadlines, Step

logger = logging.getLogger("idempotency_asgi")

#: How often the old transactions are looked at, at most.
CHECK_SECONDS = 1.0

#: Every watched transaction at once, in one statement: the waiting statements of this
#: database, waiting that long (read first, so that pg_blocking_pids, which takes the lock
#: manager's locks, runs only for them), and those of them that wait on a watched transaction
#: idle that long, of the same role. Nothing is cancelled here: each request is marked first.
STALLED = """
WITH watched AS (
    SELECT w.pid, make_interval(secs => w.seconds) AS bound
      FROM unnest($1::int[], $2::float8[]) AS w(pid, seconds)
), waiting AS MATERIALIZED (
    SELECT a.pid, a.usesysid, a.query_start
      FROM pg_stat_activity AS a
     WHERE a.wait_event_type = 'Lock' AND a.pid <> pg_backend_pid()
       AND a.datname = current_database()
       AND a.query_start <= now() - make_interval(secs => $3)
)
SELECT DISTINCT r.pid AS run, b.pid AS waiting
  FROM waiting AS b
  CROSS JOIN LATERAL unnest(pg_blocking_pids(b.pid)) AS blocker(pid)
  JOIN watched AS w ON w.pid = blocker.pid
  JOIN pg_stat_activity AS r ON r.pid = w.pid
 WHERE r.state = 'idle in transaction' AND r.usesysid = b.usesysid
   AND r.state_change <= now() - w.bound
   AND b.query_start <= now() - w.bound
"""

#: Then the waiting statements found, cancelled if each still waits on the same transaction
#: (a statement may have ended, and its session begun another, in between).
CANCEL = """
SELECT pg_cancel_backend(f.waiting) AS cancelled
  FROM unnest($1::int[], $2::int[]) WITH ORDINALITY AS f(run, waiting, n)
  JOIN pg_stat_activity AS a ON a.pid = f.waiting AND a.wait_event_type = 'Lock'
 WHERE f.run = ANY (pg_blocking_pids(f.waiting))
 ORDER BY f.n
"""


class Watch:
    """One request's transaction under watch: its backend, its bound, and whether another
    session's wait on it was cut short."""

    __slots__ = ("_step", "pid", "seconds", "stalled")

    def __init__(self, pid: int, seconds: float) -> None:
        self.pid = pid
        self.seconds = seconds
        #: set when a statement that waited on this transaction was cancelled
        self.stalled = False
        self._step: Step | None = None


class Stalls:
    """The watched transactions of a store's requests, and the one task that looks at the
    old ones (running only while there are any)."""

    def __init__(self, deadlines: Deadlines, look: Callable[..., Awaitable[Any]]) -> None:
        self._deadlines = deadlines
        self._look = look
        self._old: set[Watch] = set()
        self._task: asyncio.Task[None] | None = None
        self._failing = False  # said once, until a look succeeds again
        self._closed = False  # the store closed: nobody looks until it opens again

    def watch(self, conn: Any, seconds: float) -> Watch | None:
        """Watch the transaction open on `conn` from `seconds` on (0: not at all)."""
        if seconds <= 0:
            return None
        try:
            pid = int(conn.get_server_pid())
        except Exception:  # a connection already gone: nothing waits on it
            return None
        watch = Watch(pid, seconds)
        # Not lasting: the watches end with the store (see close()).
        watch._step = self._deadlines.start(lambda: self._aged(watch), seconds, lasting=False)
        return watch

    def end(self, watch: Watch | None) -> None:
        """The transaction ended: stop watching it. Safe to call more than once."""
        if watch is None:
            return
        step, watch._step = watch._step, None
        if step is not None:
            self._deadlines.end(step)
        self._old.discard(watch)

    def open(self) -> None:
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._old.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    def _aged(self, watch: Watch) -> None:
        if watch._step is None:
            return  # ended meanwhile
        watch._step = None
        if self._closed:
            return  # a watch of a request still running when the store closed
        self._old.add(watch)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._looking())

    async def _looking(self) -> None:
        while self._old:
            old = list(self._old)
            try:
                await self._look_once(old)
            except Exception as exc:
                if not self._failing:
                    logger.warning("could not look for sessions waiting on requests: %r", exc)
                self._failing = True
            else:
                self._failing = False
            await asyncio.sleep(min(CHECK_SECONDS, *(w.seconds / 2 for w in old)))

    async def _look_once(self, old: list[Watch]) -> None:
        shortest = min(w.seconds for w in old)
        rows = await self._look(
            "fetch", STALLED, [w.pid for w in old], [w.seconds for w in old], shortest
        )
        if not rows:
            return
        by_pid = {w.pid: w for w in old}
        pairs = [(row["run"], row["waiting"]) for row in rows if row["run"] in by_pid]
        # Marked before the cancel: the handler hears of it at once, and its request must be
        # settled as stalled (its key held), never as an outage (its key freed).
        for run, _ in pairs:
            by_pid[run].stalled = True
        runs, waiting = [run for run, _ in pairs], [pid for _, pid in pairs]
        cancelled = await self._look("fetch", CANCEL, runs, waiting)
        logger.warning(
            "sessions waited on requests' transactions idle past transaction_idle_seconds "
            "(backend waiting on backend: %s); %d of their statements cancelled",
            ", ".join(f"{w} on {r}" for r, w in pairs),
            sum(1 for row in cancelled if row["cancelled"]),
        )
