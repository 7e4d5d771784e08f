"""Natural batching: many requests' statements of one kind in one round trip, under load only.

A request's statement goes out at once while fewer than `lanes` statements of its kind are
in flight, alone, as it always did: at low load nobody waits for a batch. While `lanes` are
in flight, the requests that arrive wait, and the next statement to go carries them all (up
to `max_size` rows). So the batches are as large as the load makes them, and a statement's
round trip is shared by every request that queued behind the one before it.

A statement that goes out alone (nothing waits, a lane is free: every statement at low
load) is sent from its request's own task, as an unbatched store sends it: no entry, task or
timer is made for it (a plain-mode request alone made two tasks and about 86 Python calls
more before). Its runner bounds it by the request's deadline. Cancelled while it runs, its
result is lost with it, and `cut` is told (a claim that may have reserved its key for nobody
then frees it, a release is sent again, as unbatched ones are). A statement that carries
queued requests goes in a task of its own, which finishes whoever stops waiting.

Rows that would meet in one statement (the same key twice) never share one. Requests that
ask exactly the same thing (`share`: a storm of retries of one key) ride on one row instead:
the first of them is its row's leader and gets the row's result; the others get what the
leader's result means for them (`follow`). A storm of one key so costs one row per batch,
never one statement each.

Each request keeps its own deadline: one that gives up before its turn leaves the queue, and
one that gives up while its batch is in flight leaves the batch to finish without it (and
hears, through `abandoned`, what became of its row, so a claim made for nobody is freed).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .._errors import StatementUnanswered, StoreUnavailable

I = TypeVar("I")  # noqa: E741 - an item
R = TypeVar("R")  # its result

#: Runs one statement for `items` within `timeout` seconds; returns, for each item in order,
#: its result or the exception that item alone met. `wanted(i)` says whether anyone still
#: waits for item i (a runner that falls back to one statement per row skips the others).
Runner = Callable[
    [Sequence[I], float, Callable[[int], bool]], Awaitable[Sequence["R | BaseException"]]
]


@dataclass(eq=False)
class _Entry(Generic[I, R]):
    item: I
    key: Hashable
    deadline: float
    future: asyncio.Future[R] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    abandoned: Callable[[R], None] | None = None
    sent: bool = False

    @property
    def settled(self) -> bool:
        """Its request stopped waiting, or is about to (its deadline passed or it was
        cancelled, and it has not resumed yet): no statement is sent for it any more."""
        return self.future.done()


@dataclass(eq=False)
class _Row(Generic[I, R]):
    """One row of a statement: its leader's item, and the requests that ride on it."""

    leader: _Entry[I, R]
    followers: list[_Entry[I, R]]

    @property
    def entries(self) -> list[_Entry[I, R]]:
        return [self.leader, *self.followers]

    @property
    def wanted(self) -> bool:
        return any(not entry.settled for entry in self.entries)


class Batcher(Generic[I, R]):
    def __init__(
        self,
        run: Runner[I, R],
        *,
        key: Callable[[I], Hashable],
        lanes: int,
        max_size: int,
        hold: float = 0.0,
        share: Callable[[I], Hashable] | None = None,
        follow: Callable[[R], R] | None = None,
    ) -> None:
        self._run = run
        self._key = key
        self._share = share
        self._follow = follow
        self._lanes = lanes
        self._max_size = max_size
        # For tests only: a statement that would go out while none of its kind is in flight
        # waits this long for company first, so that concurrent requests share statements
        # even at a test's low load.
        self._hold = hold
        # Waiting requests by key, in the order each key first came: a key's requests stay
        # together, so that those asking the same thing can ride on one row.
        self._queue: dict[Hashable, deque[_Entry[I, R]]] = {}
        self._running = 0
        # Counted up by close(): a lone statement sent before it no longer holds a lane.
        self._epoch = 0
        # The batches in flight, by the task that sends each.
        self._tasks: dict[asyncio.Task[None], list[_Row[I, R]]] = {}
        self._held: asyncio.TimerHandle | None = None
        # The task closing the batcher, while it does: nothing new is taken meanwhile.
        self._closer: asyncio.Task[Any] | None = None
        #: statements sent, and rows they carried (for tests and the benchmark)
        self.statements = 0
        self.rows = 0

    async def submit(
        self,
        item: I,
        *,
        deadline: float,
        abandoned: Callable[[R], None] | None = None,
        cut: Callable[[], None] | None = None,
    ) -> R:
        """`item`'s result, or StoreUnavailable when its deadline (the loop's clock) passed
        before its statement went out, StatementUnanswered when it passed after.
        `abandoned`: told what a row got whose request stopped waiting while it was in
        flight; `cut`: told when the request was cancelled while it sent its statement alone
        from its own task (whether that statement ran, or did anything, is not known)."""
        if self._closer is not None:
            raise StoreUnavailable("the key store is closing")
        if not self._queue and self._running < self._lanes and not self._hold:
            return await self._alone(item, deadline, cut)
        entry: _Entry[I, R] = _Entry(item, self._key(item), deadline, abandoned=abandoned)
        self._queue.setdefault(entry.key, deque()).append(entry)
        self._start()
        # A timer, not a timeout around the wait: the hot path of every request pays for it.
        timer = asyncio.get_running_loop().call_at(deadline, _expire, entry.future)
        try:
            return await entry.future
        except BaseException as exc:
            # Its future is done (its deadline set it, or the cancellation cancelled it): its
            # batch, if sent, finishes without it (see _send).
            future = entry.future
            # Its row's result came, and its request was cancelled before it resumed: what the
            # row got still matters (a claim made for nobody is freed).
            came = future.done() and not future.cancelled() and future.exception() is None
            if came and abandoned is not None:
                abandoned(future.result())
            if isinstance(exc, _Expired):
                if entry.sent:
                    raise StatementUnanswered("the key store did not answer in time") from None
                raise StoreUnavailable("no free connection to the key store in time") from None
            raise
        finally:
            timer.cancel()

    async def _alone(self, item: I, deadline: float, cut: Callable[[], None] | None) -> R:
        """The statement `_start` would send for `item` alone, sent from the caller's task."""
        epoch = self._epoch
        self._running += 1
        self.statements += 1
        self.rows += 1
        try:
            timeout = deadline - asyncio.get_running_loop().time()
            results = await self._run((item,), timeout, _wanted)
        except asyncio.CancelledError:
            if cut is not None:
                cut()
            raise
        finally:
            if epoch == self._epoch:
                self._running -= 1
                if self._queue:
                    self._start()  # what queued meanwhile goes now
        if len(results) != 1:  # a runner's mistake
            raise RuntimeError(f"the statement answered {len(results)} of 1 rows")
        result = results[0]
        if isinstance(result, BaseException):
            raise result
        return result

    @property
    def waiting(self) -> int:
        """Requests queued for a statement (not yet sent)."""
        return sum(len(group) for group in self._queue.values())

    async def close(self) -> None:
        """Fail every request still waiting (StoreUnavailable) and stop the batches under way.
        A lone statement, which runs in its request's own task, is left to run (the store's
        connections closing end it); its lane is free. A store opened again starts from
        nothing."""
        self._closer = asyncio.current_task()
        try:
            if self._held is not None:
                self._held.cancel()
                self._held = None
            for task in list(self._tasks):
                task.cancel()
            for task in list(self._tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            # The lone statements still running are left to the store's connections closing
            # (their requests' tasks are not the batcher's to cancel): their lanes are free.
            self._epoch += 1
            self._running = 0
            queue, self._queue = self._queue, {}
            for group in queue.values():
                for entry in group:
                    if not entry.future.done():
                        entry.future.set_exception(StoreUnavailable("the key store is closed"))
        finally:
            self._closer = None  # a store opened again batches again

    def _start(self, *, held: bool = False) -> None:
        """Send what waits, while lanes are free (`held`: the hold for company ran out)."""
        while self._running < self._lanes and self._closer is None:
            batch = self._take(held)
            if not batch:
                return
            self._running += 1
            task = asyncio.ensure_future(self._send(batch))
            self._tasks[task] = batch
            # Counted down when the task ends, however it ends: a task cancelled before it
            # ever ran (close() right after it was made) runs no `finally` of its own.
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        batch = self._tasks.pop(task)
        self._running -= 1
        if task.cancelled():
            # Closed before (or while) it ran: its requests hear so now, not at their deadline.
            failure = StoreUnavailable("the key store closed before the statement ran")
            for row in batch:
                for entry in row.entries:
                    _fail(entry, failure)
        self._start()

    def _take(self, held: bool) -> list[_Row[I, R]]:
        if not self._queue:
            return []
        if self._hold and self._running == 0 and not held:
            if self._held is None:
                self._held = asyncio.get_running_loop().call_later(self._hold, self._hold_ran_out)
            return []
        batch: list[_Row[I, R]] = []
        for key in list(self._queue):
            if len(batch) >= self._max_size:
                break
            row = self._row_of(key)
            if row is not None:
                batch.append(row)
        return batch

    def _row_of(self, key: Hashable) -> _Row[I, R] | None:
        """The next row for `key`: its first waiting request, with those that ask the same
        (when this kind shares); the others stay queued, in order, for a later statement."""
        group = self._queue[key]
        while group and group[0].settled:
            group.popleft()  # its request stopped waiting: nothing is done on its behalf
        if not group:
            del self._queue[key]
            return None
        leader = group.popleft()
        followers: list[_Entry[I, R]] = []
        if self._share is not None and group:
            same = self._share(leader.item)
            rest: deque[_Entry[I, R]] = deque()
            for entry in group:
                if entry.settled:
                    continue
                if self._share(entry.item) == same:
                    followers.append(entry)
                else:
                    rest.append(entry)
            group = self._queue[key] = rest
        if not group:
            del self._queue[key]
        return _Row(leader, followers)

    def _hold_ran_out(self) -> None:
        """Send what came meanwhile."""
        self._held = None
        self._start(held=True)

    async def _send(self, batch: list[_Row[I, R]]) -> None:
        loop = asyncio.get_running_loop()
        for row in batch:
            for entry in row.entries:
                entry.sent = True
        self.statements += 1
        self.rows += len(batch)
        # As long as the most patient request in it waits: the others stop waiting at their
        # own deadlines and leave the batch to finish.
        timeout = max(entry.deadline for row in batch for entry in row.entries) - loop.time()
        try:
            results = await self._run(
                [row.leader.item for row in batch], timeout, lambda i: batch[i].wanted
            )
        except BaseException as exc:
            # Only close() cancels a batch: its requests are told the store closed.
            failure = (
                exc
                if isinstance(exc, Exception)
                else StatementUnanswered("the key store closed while the statement ran")
            )
            for row in batch:
                for entry in row.entries:
                    _fail(entry, failure)
            if not isinstance(exc, Exception):
                raise
            return
        if len(results) != len(batch):  # a runner's mistake: every row hears of it now
            mistake = RuntimeError(f"the statement answered {len(results)} of {len(batch)} rows")
            results = [mistake] * len(batch)
        for row, result in zip(batch, results):  # noqa: B905 - lengths checked above
            _settle(row.leader, result)
            if row.followers:
                shared = result
                if not isinstance(result, BaseException) and self._follow is not None:
                    shared = self._follow(result)
                for entry in row.followers:
                    _settle(entry, shared)


def _wanted(index: int) -> bool:
    return True  # a lone statement's request waits for it, or `cut` hears that it left


def _settle(entry: _Entry[I, R], result: R | BaseException) -> None:
    if entry.future.done():
        # Its request stopped waiting: a row's result still matters to it (a claim made for
        # nobody is freed).
        if not isinstance(result, BaseException) and entry.abandoned is not None:
            entry.abandoned(result)
    elif isinstance(result, BaseException):
        entry.future.set_exception(result)
    else:
        entry.future.set_result(result)


def _fail(entry: _Entry[Any, Any], failure: BaseException) -> None:
    if not entry.future.done():
        entry.future.set_exception(failure)


class _Expired(Exception):
    """A request's deadline passed while it waited for its row's result."""


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(_Expired())
