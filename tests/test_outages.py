"""The breaker and the shared attempt on their own (no database: what is checked is who is let
through, when, and what each caller is told). Their use by the store against a database that
is away is tests/test_store_failures.py, test_failure_paths.py and test_contention.py."""

from __future__ import annotations

import asyncio
import re

import pytest

from idempotency_asgi import StoreRefused, StoreUnavailable
from idempotency_asgi._postgres.outages import Breaker, SharedAttempt

COOL = 0.05


def test_a_closed_breaker_lets_every_call_through():
    breaker = Breaker(COOL)
    ticket = breaker.admit()
    assert ticket.probe is False
    assert breaker.ticket().probe is False


async def test_a_stall_with_nothing_since_opens_it_for_its_cool_down():
    breaker = Breaker(COOL)
    ticket = breaker.admit()
    breaker.stalled(ticket)
    with pytest.raises(StoreUnavailable, match=r"not sending it more work for up to 0\.05 s"):
        breaker.admit()
    await asyncio.sleep(COOL * 1.5)
    probe = breaker.admit()  # the cool-down is over: one call goes, as the probe
    assert probe.probe is True
    with pytest.raises(StoreUnavailable):
        breaker.admit()  # while the probe is out, nobody else
    breaker.ended(probe)
    assert breaker.admit().probe is True  # the probe ended without news: another may try
    breaker.succeeded()
    assert breaker.admit().probe is False  # closed


async def test_a_stall_is_not_the_database_stuck_when_something_succeeded_since():
    breaker = Breaker(COOL)
    ticket = breaker.admit()
    await asyncio.sleep(0.001)
    breaker.succeeded()  # another call got an answer after this one began
    breaker.stalled(ticket)
    assert breaker.admit().probe is False


async def test_a_probe_that_stalls_opens_it_again():
    breaker = Breaker(COOL)
    breaker.stalled(breaker.admit())
    await asyncio.sleep(COOL * 1.5)
    probe = breaker.admit()
    breaker.stalled(probe)
    with pytest.raises(StoreUnavailable):
        breaker.admit()
    await asyncio.sleep(COOL * 1.5)
    assert breaker.admit().probe is True


async def test_after_a_success_the_next_stall_opens_it_and_a_probe_follows_again():
    breaker = Breaker(COOL)
    breaker.stalled(breaker.admit())
    await asyncio.sleep(COOL * 1.5)
    breaker.admit()  # the probe
    breaker.succeeded()  # it answered: closed
    breaker.stalled(breaker.admit())  # later, a stall again: open again
    with pytest.raises(StoreUnavailable):
        breaker.admit()
    await asyncio.sleep(COOL * 1.5)
    assert breaker.admit().probe is True  # the old probe's turn is long over


async def test_an_old_probe_ending_late_lets_no_second_probe_beside_the_new_one():
    breaker = Breaker(COOL)
    breaker.stalled(breaker.admit())
    await asyncio.sleep(COOL * 1.5)
    old = breaker.admit()
    breaker.succeeded()  # another call answered while the old probe was still out
    breaker.stalled(breaker.admit())
    await asyncio.sleep(COOL * 1.5)
    new = breaker.admit()
    assert new.probe is True
    breaker.ended(old)  # the old probe comes back now
    with pytest.raises(StoreUnavailable):
        breaker.admit()  # the new probe is still out: still one at a time
    breaker.ended(new)
    assert breaker.admit().probe is True


async def test_callers_share_one_attempt():
    calls = 0

    async def attempt() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.02)
        return "opened"

    shared = SharedAttempt(attempt, what="opening", cooldown=COOL)
    assert await asyncio.gather(*(shared(1.0) for _ in range(5))) == ["opened"] * 5
    assert calls == 1
    assert await shared(1.0) == "opened" and calls == 2  # over: the next call tries again


async def test_a_failure_is_remembered_for_the_cool_down():
    calls = 0

    async def attempt() -> str:
        nonlocal calls
        calls += 1
        raise StoreUnavailable("connection refused")

    shared = SharedAttempt(attempt, what="opening the key store", cooldown=COOL)
    with pytest.raises(StoreUnavailable, match="connection refused"):
        await shared(1.0)
    await asyncio.sleep(COOL * 0.4)
    with pytest.raises(StoreUnavailable) as remembered:
        await shared(1.0)
    told = re.fullmatch(
        r"opening the key store failed (\d\.\d\d) s ago \(connection refused\); "
        r"not trying again for (\d\.\d\d) s",
        str(remembered.value),
    )
    assert told is not None, str(remembered.value)
    ago, left = float(told[1]), float(told[2])
    assert 0 < left <= COOL and ago + left == pytest.approx(COOL, abs=0.011)
    assert calls == 1
    await asyncio.sleep(COOL * 1.5)
    with pytest.raises(StoreUnavailable, match="connection refused"):
        await shared(1.0)
    assert calls == 2


async def test_a_refusal_is_remembered_as_a_refusal():
    async def attempt() -> str:
        raise StoreRefused("password authentication failed", error="InvalidPassword (28P01)")

    shared = SharedAttempt(attempt, what="opening", cooldown=COOL)
    with pytest.raises(StoreRefused):
        await shared(1.0)
    with pytest.raises(StoreRefused) as remembered:
        await shared(1.0)
    assert remembered.value.error == "InvalidPassword (28P01)"
    assert "password authentication failed" in str(remembered.value)


async def test_a_caller_waits_no_longer_than_its_own_bound_and_the_attempt_goes_on():
    async def attempt() -> str:
        await asyncio.sleep(0.1)
        return "opened"

    shared = SharedAttempt(attempt, what="opening", cooldown=COOL)
    with pytest.raises(StoreUnavailable, match=r"opening did not finish within 0\.02 s"):
        await shared(0.02)
    assert await shared(1.0) == "opened"  # the same attempt, not cancelled by the first


async def test_cancelling_the_attempt_tells_its_callers_the_store_closed():
    async def attempt() -> str:
        await asyncio.sleep(10)
        return "never"

    shared = SharedAttempt(attempt, what="opening", cooldown=COOL)
    caller = asyncio.ensure_future(shared(5.0))
    await asyncio.sleep(0)
    shared.cancel()
    with pytest.raises(StoreUnavailable, match="opening stopped: the key store closed"):
        await caller
    with pytest.raises(StoreUnavailable, match="not trying again"):
        await shared(1.0)  # a cancelled attempt is remembered as a failure, for the cool-down


async def test_a_caller_cancelled_while_it_waits_leaves_the_attempt_running():
    async def attempt() -> str:
        await asyncio.sleep(0.05)
        return "opened"

    shared = SharedAttempt(attempt, what="opening", cooldown=COOL)
    caller = asyncio.ensure_future(shared(5.0))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert await shared(1.0) == "opened"
