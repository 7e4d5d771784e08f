"""One timer for every bounded step of the atomic mode's requests, and of the BEGIN and the
COMMIT of a handler's transaction in the two-phase mode (see lending.py).

Every step a request waits on the database for is bounded (a connection, the claim, the
record and its COMMIT, a rollback): a database that stops answering must cost a request its
`timeout`, not hang it. A timer per step (asyncio.timeout, or asyncpg's own `timeout=`)
costs a timer handle and its cancellation on every step of every request that succeeds,
which is nearly all of them. Here a step says when it began and what to do if it is still
under way at its deadline; one timer, ticking only while steps are under way, looks at them
a few times a second. A step is late by at most a tick.

What a late step does is its own business (see onecommit.py and lending.py): a claim's or a
BEGIN's connection is closed under it (the server rolls back, and the locks go with the
session), a COMMIT is left to finish while the client is answered (cancelling a COMMIT that
waits for a synchronous standby keeps it on the primary alone), a wait for a connection
gives up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger("idempotency_asgi")

#: The longest a late step goes unnoticed: a tenth of the timeout, at most 50 ms.
MAX_TICK_SECONDS = 0.05


class Step:
    """One bounded step under way: ended by `end()`, or `expire()`d at its deadline."""

    __slots__ = ("_on_expiry", "deadline", "handle", "lasting")

    def __init__(self, deadline: float, on_expiry: Callable[[], None], lasting: bool) -> None:
        self.deadline = deadline
        self._on_expiry: Callable[[], None] | None = on_expiry
        #: whether it keeps its deadline when the store closes (see Deadlines.close)
        self.lasting = lasting
        #: its timer of its own, once the store closed under it
        self.handle: asyncio.TimerHandle | None = None

    def expire(self) -> None:
        on_expiry, self._on_expiry = self._on_expiry, None
        if on_expiry is not None:
            on_expiry()

    @property
    def expired(self) -> bool:
        return self._on_expiry is None


class Deadlines:
    """The steps under way, and the one timer that looks at them."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._tick = min(MAX_TICK_SECONDS, timeout / 10)
        self._steps: set[Step] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(
        self,
        on_expiry: Callable[[], None],
        seconds: float | None = None,
        *,
        at: float = 0.0,
        lasting: bool = True,
    ) -> Step:
        """A step that must end within `seconds` (the timeout by default), or by the loop
        time `at` when given; `on_expiry` runs, once, if it has not ended by then. It keeps
        its deadline if the store closes meanwhile (see `close`), unless not `lasting`."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        seconds = self.timeout if seconds is None else seconds
        step = Step(at or loop.time() + seconds, on_expiry, lasting)
        self._steps.add(step)
        if self._timer is None:
            self._timer = loop.call_later(self._tick, self._look)
        return step

    def now(self) -> float:
        """The loop's clock (the one deadlines are on)."""
        return (self._loop or asyncio.get_running_loop()).time()

    def end(self, step: Step) -> None:
        self._steps.discard(step)
        if step.handle is not None:
            step.handle.cancel()
            step.handle = None

    def _look(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None
        steps = self._steps
        now = loop.time()
        late = [step for step in steps if step.deadline <= now]
        try:
            for step in late:
                steps.discard(step)
                _expire(step)  # one step's failure must not stop the others' expiry
        finally:
            if steps and self._timer is None:
                self._timer = loop.call_later(self._tick, self._look)
            elif not steps:
                self._loop = None  # idle: the next step starts on whatever loop runs it

    def close(self) -> None:
        """The store closes, and the timer stops, so that the store may open again on any
        loop. A step under way keeps its deadline, on a timer of its own: the close does not
        take a connection from its request (lent to a handler, or a look's), so nothing else
        would bound it. Steps that are not lasting (what ends with the store) are forgotten."""
        loop, steps = self._loop, self._steps
        try:
            for step in steps:
                if step.lasting and loop is not None and not loop.is_closed():
                    step.handle = loop.call_at(step.deadline, _expire, step)
        finally:
            steps.clear()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._loop = None


def _expire(step: Step) -> None:
    try:
        step.expire()
    except Exception:
        logger.exception("a late step's expiry failed")
