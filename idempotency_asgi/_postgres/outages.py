"""What the store does while the database is away: one attempt at a time, and a short
cool-down after a stall.

- `SharedAttempt`: callers that need the same thing opened (the store's pool, the listener's
  connection) share one attempt, each waiting no longer than its own bound. A failure is
  remembered for the cool-down, so during an outage every caller fails at once instead of
  queueing behind attempts that each take the whole timeout.
- `Breaker`: a call that stalled (timed out, or could not connect) while nothing else
  succeeded since it began means the database is stuck, not one key's lock: new calls then
  fail at once for the cool-down, and after it one call goes through as a probe; any success
  closes the breaker again. Calls that fail at once cost the database nothing, so the
  backends the store can leave busy on a stuck server are bounded by its own connections,
  whatever the clients' retries do.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from .._errors import StoreRefused, StoreUnavailable
from .connections import bounded

#: How long a stall or a failed opening is taken for granted. Long enough that a storm of
#: retries against a stuck database turns into one probe per half second; short enough that
#: a failover (about a second to promote a standby) costs little more than itself. Never
#: longer than the store's `timeout`.
COOLDOWN_SECONDS = 0.5

T = TypeVar("T")


class SharedAttempt(Generic[T]):
    """`await attempt(timeout)`: the result of the attempt under way, or of a new one."""

    def __init__(self, attempt: Callable[[], Awaitable[T]], *, what: str, cooldown: float) -> None:
        self._attempt = attempt
        self._what = what
        self._cooldown = cooldown
        self._task: asyncio.Future[T] | None = None
        # The last attempt's failure and when it ended (its monotonic time), if it failed.
        self._failed: tuple[BaseException, float] | None = None

    async def __call__(self, timeout: float) -> T:
        if self._task is None:
            if self._failed is not None:
                self._refuse_while_cooling(*self._failed)
            self._task = asyncio.ensure_future(self._attempt())
            self._task.add_done_callback(self._finished)
        task = self._task
        try:
            return await bounded(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"{self._what} did not finish within {timeout:g} s") from None
        except asyncio.CancelledError:
            if task.cancelled():  # cancel(): the store is closing, not this caller
                raise StoreUnavailable(f"{self._what} stopped: the key store closed") from None
            raise

    def _refuse_while_cooling(self, failure: BaseException, at: float) -> None:
        since = time.monotonic() - at
        if since < self._cooldown:
            message = (
                f"{self._what} failed {since:.2f} s ago ({failure}); "
                f"not trying again for {self._cooldown - since:.2f} s"
            )
            if isinstance(failure, StoreRefused):  # it would fail the same way
                raise StoreRefused(message, error=failure.error)
            raise StoreUnavailable(message)

    def cancel(self) -> None:
        """Stop the attempt under way, if any (the store is closing)."""
        if self._task is not None:
            self._task.cancel()

    def _finished(self, task: asyncio.Future[T]) -> None:
        self._task = None
        failure = None if task.cancelled() else task.exception()
        if task.cancelled() or failure is not None:
            self._failed = (failure or asyncio.CancelledError(), time.monotonic())
        else:
            self._failed = None


class Ticket:
    """One call through the breaker: when it began, and whether it is the probe."""

    __slots__ = ("probe", "started")

    def __init__(self, started: float, probe: bool) -> None:
        self.started = started
        self.probe = probe


class Breaker:
    def __init__(self, cooldown: float) -> None:
        self._cooldown = cooldown
        self._open_until: float | None = None  # None: closed
        self._probe: Ticket | None = None  # the probe under way, if any
        self._last_success = -math.inf

    def admit(self) -> Ticket:
        """Let a call through, or raise StoreUnavailable while cooling down (or while the
        probe after the cool-down is under way)."""
        now = time.monotonic()
        if self._open_until is None:
            return Ticket(now, probe=False)
        if now < self._open_until or self._probe is not None:
            raise StoreUnavailable(
                "the database stopped answering moments ago; not sending it more work "
                f"for up to {self._cooldown:g} s"
            )
        self._probe = Ticket(now, probe=True)
        return self._probe

    def ticket(self) -> Ticket:
        """A ticket for a step of a call already admitted (a COMMIT, a new connection)."""
        return Ticket(time.monotonic(), probe=False)

    def succeeded(self) -> None:
        """The database answered (a refusal is an answer too)."""
        self._last_success = time.monotonic()
        self._open_until = None
        self._probe = None

    def stalled(self, ticket: Ticket) -> None:
        """The call timed out or could not connect. Only a stall with no success since the
        call began opens the breaker: a lock one key waits on is not the database stuck."""
        if ticket is self._probe:
            self._probe = None
        if self._last_success < ticket.started:
            self._open_until = time.monotonic() + self._cooldown

    def ended(self, ticket: Ticket) -> None:
        """The call ended (whatever `stalled` or `succeeded` said of it): a probe's turn
        is over."""
        if ticket is self._probe:
            self._probe = None
