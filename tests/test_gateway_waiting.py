"""`waiting.within`: a deadline on an awaitable, armed only if it waits."""

from __future__ import annotations

import asyncio

import pytest

from idempotency_asgi.gateway.waiting import within


async def test_what_does_not_wait_returns_at_once_whatever_the_deadline():
    async def ready() -> str:
        return "now"

    assert await within(ready(), 0.0) == "now"


async def test_what_waits_within_the_deadline_returns_its_result():
    async def slow() -> int:
        for _ in range(3):
            await asyncio.sleep(0.01)
        return 7

    assert await within(slow(), 5.0) == 7


async def test_what_waits_past_the_deadline_is_stopped_and_cleans_up():
    cleaned = asyncio.Event()

    async def stuck() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    with pytest.raises(TimeoutError):
        await within(stuck(), 0.05)
    assert cleaned.is_set()


async def test_errors_come_out_as_they_were_raised_before_and_after_a_wait():
    async def fails_at_once() -> None:
        raise ValueError("at once")

    async def fails_later() -> None:
        await asyncio.sleep(0)
        raise KeyError("later")

    with pytest.raises(ValueError, match="at once"):
        await within(fails_at_once(), 1.0)
    with pytest.raises(KeyError):
        await within(fails_later(), 1.0)


async def test_a_cancelled_task_cancels_what_it_waits_on():
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def waits() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = asyncio.ensure_future(within(waits(), 60.0))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()
