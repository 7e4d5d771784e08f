"""Awaiting under a deadline, without arming one when nothing is awaited.

Most of what the gateway bounds in time does not wait at all: a send to a client that reads
(uvicorn waits only while the socket's buffer is full), a request body that came with its
head. `asyncio.timeout` costs a timer, a context and a reschedule even then, several times a
request. `within` first runs the coroutine up to its first wait; only if it waits does the
deadline start, and the coroutine goes on from where it stopped (`Resumed` hands the task
what the coroutine waits on, and passes back into it what the task sends or throws: what
`await` itself does).
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """`awaitable`'s result, or TimeoutError when it waits past `seconds` in all."""
    resumed: Awaitable[T] = awaitable
    if isinstance(awaitable, types.CoroutineType):  # not the ABC: a type check, not a walk
        try:
            waits_on = awaitable.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        resumed = Resumed(awaitable, waits_on)
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await resumed
    return await asyncio.wait_for(resumed, seconds)  # pragma: no cover


class Resumed(Awaitable[Any]):
    """A coroutine that already ran up to a wait, as an awaitable that goes on from there."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any], waits_on: Any) -> None:
        self._coroutine = coroutine
        self._waits_on = waits_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, waits_on = self._coroutine, self._waits_on
        while True:
            try:
                sent = yield waits_on
            except BaseException as thrown:  # a cancellation (the deadline's, or the task's)
                try:
                    waits_on = coroutine.throw(thrown)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    waits_on = coroutine.send(sent)
                except StopIteration as done:
                    return done.value
