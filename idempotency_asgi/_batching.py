"""Natural batching: many requests' statements of one kind in one round trip, under load only.

A request's statement goes out at once while fewer than `lanes` statements of its kind are
in flight, alone, as it always did: at low load nobody waits for a batch. While `lanes` are
in flight, the requests that arrive wait, and the next statement to go carries them all (up
to `max_size`). So the batches are as large as the load makes them, and a statement's round
trip is shared by every request that queued behind the one before it.

Each request keeps its own deadline: one that gives up before its turn leaves the queue, and
one that gives up while its batch is in flight leaves the batch to finish without it (and
hears, through `abandoned`, what became of its row, so a claim made for nobody is freed).
Rows that would meet in one statement (the same key twice) never share one: the later waits
for the next batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ._errors import StatementUnanswered, StoreUnavailable

I = TypeVar("I")  # noqa: E741 - an item
R = TypeVar("R")  # its result

#: Runs one statement for `items` within `timeout` seconds; returns, for each item in order,
#: its result or the exception that item alone met (see `PostgresStore._batched`).
Runner = Callable[[Sequence[I], float], Awaitable[Sequence["R | BaseException"]]]


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
    gone: bool = False  # its request stopped waiting

    @property
    def settled(self) -> bool:
        """Its request stopped waiting, or is about to (its deadline passed, and it has not
        resumed yet): no statement is sent for it any more."""
        return self.gone or self.future.done()


class Batcher(Generic[I, R]):
    def __init__(
        self,
        run: Runner[I, R],
        *,
        key: Callable[[I], Hashable],
        lanes: int,
        max_size: int,
        hold: float = 0.0,
    ) -> None:
        self._run = run
        self._key = key
        self._lanes = lanes
        self._max_size = max_size
        # For tests only: a statement that would go out while none of its kind is in flight
        # waits this long for company first, so that concurrent requests share statements
        # even at a test's low load.
        self._hold = hold
        self._queue: deque[_Entry[I, R]] = deque()
        self._running = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: asyncio.TimerHandle | None = None
        self._hold_over = False
        self._closing = False
        #: statements sent, and rows they carried (for tests and the benchmark)
        self.statements = 0
        self.rows = 0

    async def submit(
        self, item: I, *, deadline: float, abandoned: Callable[[R], None] | None = None
    ) -> R:
        """`item`'s result, or StoreUnavailable when its deadline (the loop's clock) passed
        before its statement went out, StatementUnanswered when it passed after."""
        entry: _Entry[I, R] = _Entry(item, self._key(item), deadline, abandoned=abandoned)
        self._queue.append(entry)
        self._start()
        # A timer, not a timeout around the wait: the hot path of every request pays for it.
        timer = asyncio.get_running_loop().call_at(deadline, _expire, entry.future)
        try:
            return await entry.future
        except BaseException as exc:
            entry.gone = True  # its batch finishes without it (see _send)
            if isinstance(exc, _Expired):
                if entry.sent:
                    raise StatementUnanswered("the key store did not answer in time") from None
                raise StoreUnavailable("no free connection to the key store in time") from None
            raise
        finally:
            timer.cancel()

    async def close(self) -> None:
        self._closing = True
        if self._held is not None:
            self._held.cancel()
            self._held = None
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while self._queue:
            entry = self._queue.popleft()
            if not entry.future.done():
                entry.future.set_exception(StoreUnavailable("the key store is closed"))
        self._closing = False  # a store opened again batches again

    def _start(self) -> None:
        while self._running < self._lanes and not self._closing:
            batch = self._take()
            if not batch:
                return
            self._running += 1
            task = asyncio.ensure_future(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Entry[I, R]]:
        while self._queue and self._queue[0].settled:
            self._queue.popleft()
        if not self._queue:
            return []
        if self._hold and self._running == 0 and not self._hold_over:
            if self._held is None:
                self._held = asyncio.get_running_loop().call_later(self._hold, self._hold_ran_out)
            return []
        self._hold_over = False
        batch: list[_Entry[I, R]] = []
        keys: set[Hashable] = set()
        later: list[_Entry[I, R]] = []
        while self._queue and len(batch) < self._max_size:
            entry = self._queue.popleft()
            if entry.settled:
                continue  # its request stopped waiting: nothing is done on its behalf
            if entry.key in keys:
                later.append(entry)  # the same key twice: its own statement, next
                continue
            keys.add(entry.key)
            batch.append(entry)
        self._queue.extendleft(reversed(later))
        return batch

    def _hold_ran_out(self) -> None:
        """Send what came meanwhile."""
        self._held = None
        self._hold_over = True
        self._start()

    async def _send(self, batch: list[_Entry[I, R]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            for entry in batch:
                entry.sent = True
            self.statements += 1
            self.rows += len(batch)
            # As long as the most patient request in it waits: the others stop waiting at
            # their own deadlines and leave the batch to finish.
            timeout = max(entry.deadline for entry in batch) - loop.time()
            try:
                results = await self._run([entry.item for entry in batch], timeout)
            except BaseException as exc:
                # Only close() cancels a batch: its requests are told the store closed.
                failure = (
                    exc
                    if isinstance(exc, Exception)
                    else StatementUnanswered("the key store closed while the statement ran")
                )
                for entry in batch:
                    if not entry.future.done():
                        entry.future.set_exception(failure)
                if not isinstance(exc, Exception):
                    raise
                return
            for entry, result in zip(batch, results, strict=True):
                if entry.future.done():
                    # Its request stopped waiting: a row's result still matters to it (a
                    # claim made for nobody is freed).
                    if not isinstance(result, BaseException) and entry.abandoned is not None:
                        entry.abandoned(result)
                elif isinstance(result, BaseException):
                    entry.future.set_exception(result)
                else:
                    entry.future.set_result(result)
        finally:
            self._running -= 1
            self._start()


class _Expired(Exception):
    """A request's deadline passed while it waited for its row's result."""


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(_Expired())


def arrays(rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """Columns out of rows: what `unnest($1::t[], $2::t[], ...)` reads back as rows."""
    return [list(column) for column in zip(*rows, strict=True)]
