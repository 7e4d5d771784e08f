"""The batcher's own rules, with a runner of the test's in place of a statement (no database:
what is checked is which requests share a statement, when one goes out, and what each hears).
Its use by the store, on real PostgreSQL, is tests/test_batching.py and test_contention.py."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from idempotency_asgi import StoreUnavailable
from idempotency_asgi._errors import StatementUnanswered
from idempotency_asgi._postgres.batching import Batcher


class Runner:
    """Records each statement (its items, timeout and who still waited); answers each item
    with `answer(item)`; waits for `gate` first when one is set."""

    def __init__(self, answer: Callable[[str], Any] = lambda item: f"<{item}>") -> None:
        self.answer = answer
        self.statements: list[list[str]] = []
        self.timeouts: list[float] = []
        self.wanted: list[list[bool]] = []
        self.gate: asyncio.Event | None = None
        #: a gate for each statement in turn, when set (after `gate`)
        self.gates: list[asyncio.Event] = []
        self.failure: BaseException | None = None

    async def __call__(
        self, items: Sequence[str], timeout: float, wanted: Callable[[int], bool]
    ) -> list[Any]:
        turn = len(self.statements)
        self.statements.append(list(items))
        self.timeouts.append(timeout)
        if self.gate is not None:
            await self.gate.wait()
        if turn < len(self.gates):
            await self.gates[turn].wait()
        self.wanted.append([wanted(i) for i in range(len(items))])
        if self.failure is not None:
            raise self.failure
        return [self.answer(item) for item in items]


def batcher(runner: Runner, **options: Any) -> Batcher[str, Any]:
    defaults: dict[str, Any] = {"key": lambda item: item.split(":")[0], "lanes": 1, "max_size": 8}
    return Batcher(runner, **{**defaults, **options})


def later(seconds: float = 5.0) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_a_lone_request_goes_at_once_with_its_own_time():
    runner = Runner()
    b = batcher(runner)
    assert await b.submit("a", deadline=later(2.0)) == "<a>"
    assert runner.statements == [["a"]]
    assert 1.5 < runner.timeouts[0] <= 2.0  # what is left of its deadline, not more
    assert (b.statements, b.rows) == (1, 1)


async def test_requests_queued_behind_a_busy_lane_share_the_next_statement():
    runner = Runner()
    runner.gate = asyncio.Event()
    b = batcher(runner, lanes=1)
    first = asyncio.ensure_future(b.submit("a", deadline=later()))
    await asyncio.sleep(0)
    queued = [asyncio.ensure_future(b.submit(k, deadline=later())) for k in ("b", "c", "d")]
    await asyncio.sleep(0)
    assert runner.statements == [["a"]]  # one lane: the others wait for it
    assert b.waiting == 3
    runner.gate.set()
    assert await first == "<a>"
    assert [await q for q in queued] == ["<b>", "<c>", "<d>"]
    assert runner.statements == [["a"], ["b", "c", "d"]]
    assert (b.statements, b.rows, b.waiting) == (2, 4, 0)


async def test_two_lanes_send_two_statements_at_once_and_no_more():
    runner = Runner()
    runner.gate = asyncio.Event()
    b = batcher(runner, lanes=2)
    tasks = [asyncio.ensure_future(b.submit(k, deadline=later())) for k in ("a", "b", "c")]
    await asyncio.sleep(0.01)
    assert runner.statements == [["a"], ["b"]]
    runner.gate.set()
    await asyncio.gather(*tasks)
    assert runner.statements == [["a"], ["b"], ["c"]]


async def test_a_statement_carries_at_most_max_size_rows():
    runner = Runner()
    runner.gate = asyncio.Event()
    b = batcher(runner, lanes=1, max_size=2)
    tasks = [asyncio.ensure_future(b.submit(k, deadline=later())) for k in "abcdef"]
    await asyncio.sleep(0)
    runner.gate.set()
    await asyncio.gather(*tasks)
    assert runner.statements == [["a"], ["b", "c"], ["d", "e"], ["f"]]


async def test_the_same_key_twice_never_shares_a_statement():
    runner = Runner()
    runner.gate = asyncio.Event()
    b = batcher(runner, lanes=1)
    tasks = [asyncio.ensure_future(b.submit(k, deadline=later())) for k in ("x", "a", "a:2", "b")]
    await asyncio.sleep(0)
    runner.gate.set()
    assert await asyncio.gather(*tasks) == ["<x>", "<a>", "<a:2>", "<b>"]
    # the second of key a goes in the statement after the one that carries the first
    assert runner.statements == [["x"], ["a", "b"], ["a:2"]]


async def test_requests_that_ask_the_same_ride_on_one_row():
    runner = Runner()
    runner.gate = asyncio.Event()
    b = batcher(
        runner,
        lanes=1,
        share=lambda item: item.split(":")[1],  # "key:question"
        follow=lambda result: f"after {result}",
    )
    tasks = [
        asyncio.ensure_future(b.submit(k, deadline=later()))
        for k in ("z:q", "a:q", "a:q", "a:other", "a:q")
    ]
    await asyncio.sleep(0)
    runner.gate.set()
    results = await asyncio.gather(*tasks)
    # One row for the three that ask the same: the first hears its row's result, the others
    # what that result means for them; the one that asks otherwise waits for a row of its own.
    assert results == ["<z:q>", "<a:q>", "after <a:q>", "<a:other>", "after <a:q>"]
    assert runner.statements == [["z:q"], ["a:q"], ["a:other"]]
    assert (b.statements, b.rows) == (3, 3)


async def test_a_row_that_fails_fails_its_riders_as_they_are():
    refused = RuntimeError("refused")
    runner = Runner(answer=lambda item: refused)
    runner.gate = asyncio.Event()
    b = batcher(runner, lanes=1, share=lambda item: 0, follow=lambda result: "never")
    first = asyncio.ensure_future(b.submit("x", deadline=later()))
    riders = [asyncio.ensure_future(b.submit("a", deadline=later())) for _ in range(2)]
    await asyncio.sleep(0)
    runner.gate.set()
    for task in (first, *riders):
        with pytest.raises(RuntimeError, match="refused"):
            await task


async def test_a_request_that_gives_up_while_queued_is_left_out():
    runner = Runner()
    runner.gate = asyncio.Event()
    b = batcher(runner, lanes=1)
    first = asyncio.ensure_future(b.submit("a", deadline=later()))
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(b.submit("b", deadline=later()))
    kept = asyncio.ensure_future(b.submit("c", deadline=later()))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    runner.gate.set()
    await first
    assert await kept == "<c>"
    assert runner.statements == [["a"], ["c"]]


async def test_the_runner_hears_which_rows_still_have_someone_waiting():
    runner = Runner()
    runner.gates = [asyncio.Event(), asyncio.Event()]
    b = batcher(runner, lanes=1)
    blocker = asyncio.ensure_future(b.submit("x", deadline=later()))
    await asyncio.sleep(0)
    stays = asyncio.ensure_future(b.submit("a", deadline=later()))
    leaves = asyncio.ensure_future(b.submit("b", deadline=later()))
    await asyncio.sleep(0)
    runner.gates[0].set()
    await blocker
    await asyncio.sleep(0.01)
    assert runner.statements[-1] == ["a", "b"]  # out, and waiting for its gate
    leaves.cancel()
    await asyncio.sleep(0)
    runner.gates[1].set()
    await stays
    assert runner.wanted[-1] == [True, False]


async def test_a_deadline_before_the_statement_goes_is_no_free_connection():
    runner = Runner()
    runner.gate = asyncio.Event()
    b = batcher(runner, lanes=1)
    blocker = asyncio.ensure_future(b.submit("x", deadline=later()))
    await asyncio.sleep(0)
    with pytest.raises(StoreUnavailable, match=r"^no free connection to the key store in time$"):
        await b.submit("a", deadline=later(0.05))
    runner.gate.set()
    await blocker
    assert runner.statements == [["x"]]  # nothing was sent for it


async def queued_behind(b: Batcher[str, Any], runner: Runner) -> asyncio.Future[Any]:
    """A lone statement ("x") in flight on the one lane until `runner.gates[0]` is set: what
    is submitted next queues, and goes in a statement of its own task when that lane frees."""
    runner.gates = [asyncio.Event(), *runner.gates[1:]]
    blocker = asyncio.ensure_future(b.submit("x", deadline=later()))
    await asyncio.sleep(0)
    return blocker


async def test_a_deadline_after_the_statement_went_is_no_answer():
    runner = Runner()
    runner.gates = [asyncio.Event(), asyncio.Event()]
    b = batcher(runner, lanes=1)
    blocker = await queued_behind(b, runner)
    request = asyncio.ensure_future(b.submit("a", deadline=later(0.1)))
    await asyncio.sleep(0)
    runner.gates[0].set()
    await blocker
    with pytest.raises(StatementUnanswered, match=r"^the key store did not answer in time$"):
        await request
    assert runner.statements == [["x"], ["a"]]
    runner.gates[1].set()


async def test_a_row_whose_request_left_still_tells_what_it_got():
    runner = Runner()
    runner.gates = [asyncio.Event(), asyncio.Event()]
    b = batcher(runner, lanes=1)
    blocker = await queued_behind(b, runner)
    heard: list[str] = []
    cut: list[str] = []
    task = asyncio.ensure_future(
        b.submit("a", deadline=later(), abandoned=heard.append, cut=lambda: cut.append("a"))
    )
    await asyncio.sleep(0)
    runner.gates[0].set()
    await blocker
    await asyncio.sleep(0.01)
    assert runner.statements[-1] == ["a"]  # sent, in a task of its own
    task.cancel()
    await asyncio.sleep(0)
    runner.gates[1].set()
    await asyncio.sleep(0.01)
    assert (heard, cut) == (["<a>"], [])  # its row finished without it, and said what it got


async def test_a_lone_statement_goes_from_its_request_own_task():
    runner = Runner()
    tasks: list[asyncio.Task[Any] | None] = []
    answer = runner.answer
    runner.answer = lambda item: tasks.append(asyncio.current_task()) or answer(item)
    b = batcher(runner, lanes=1)
    request = asyncio.ensure_future(b.submit("a", deadline=later()))
    assert await request == "<a>"
    assert tasks == [request]  # no task of the batcher's: the request's own sent it
    assert (b.statements, b.rows) == (1, 1)


async def test_a_lone_statement_cancelled_while_it_runs_is_cut_and_frees_its_lane():
    runner = Runner()
    runner.gates = [asyncio.Event()]
    b = batcher(runner, lanes=1)
    heard: list[str] = []
    cut: list[str] = []
    task = asyncio.ensure_future(
        b.submit("a", deadline=later(), abandoned=heard.append, cut=lambda: cut.append("a"))
    )
    await asyncio.sleep(0)
    assert runner.statements == [["a"]]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # What its statement did went with it: the caller hears that it was cut, not a result.
    assert (heard, cut) == ([], ["a"])
    # Its lane is free again: the next request goes at once, alone.
    assert await asyncio.wait_for(b.submit("b", deadline=later()), 1.0) == "<b>"
    assert runner.statements == [["a"], ["b"]]


async def test_a_lone_statement_that_fails_frees_its_lane_and_sends_what_queued():
    runner = Runner()
    runner.gates = [asyncio.Event()]
    runner.answer = lambda item: ConnectionError(item) if item == "x" else f"<{item}>"
    b = batcher(runner, lanes=1)
    cut: list[str] = []
    blocker = asyncio.ensure_future(b.submit("x", deadline=later(), cut=lambda: cut.append("x")))
    await asyncio.sleep(0)
    queued = [asyncio.ensure_future(b.submit(k, deadline=later())) for k in ("a", "b")]
    await asyncio.sleep(0)
    runner.gates[0].set()
    with pytest.raises(ConnectionError, match=r"^x$"):
        await blocker
    assert cut == []  # it failed, and said so: `cut` is for a cancellation only
    assert await asyncio.wait_for(asyncio.gather(*queued), 1.0) == ["<a>", "<b>"]
    assert runner.statements == [["x"], ["a", "b"]]
    assert await b.submit("c", deadline=later()) == "<c>"  # alone again: the lane is free


async def test_closing_leaves_a_lone_statement_to_its_runner_and_frees_its_lane():
    runner = Runner()
    runner.gates = [asyncio.Event()]
    b = batcher(runner, lanes=1)
    lone = asyncio.ensure_future(b.submit("a", deadline=later()))
    await asyncio.sleep(0)
    # Closing neither waits for it (the store's connections closing end it) nor stops it...
    await asyncio.wait_for(b.close(), 1.0)
    # ...and a store opened again starts from nothing: the next request goes at once, alone.
    assert await asyncio.wait_for(b.submit("b", deadline=later()), 1.0) == "<b>"
    runner.gates[0].set()
    assert await lone == "<a>"
    # Its end gives back no lane it no longer holds: one lane, one statement at a time.
    runner.gates = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
    first = asyncio.ensure_future(b.submit("c", deadline=later()))
    second = asyncio.ensure_future(b.submit("d", deadline=later()))
    await asyncio.sleep(0.01)
    assert runner.statements == [["a"], ["b"], ["c"]]
    runner.gates[2].set()
    assert await first == "<c>"
    assert await second == "<d>"


async def test_a_failing_statement_fails_every_row_with_its_error():
    runner = Runner()
    b = batcher(runner, lanes=1)
    blocker = await queued_behind(b, runner)
    rows = [asyncio.ensure_future(b.submit(k, deadline=later())) for k in ("a", "b")]
    await asyncio.sleep(0)
    runner.failure = ConnectionError("broken")
    runner.gates[0].set()
    for request in (blocker, *rows):
        with pytest.raises(ConnectionError, match="broken"):
            await request
    assert runner.statements == [["x"], ["a", "b"]]  # both rows in the one that failed


async def test_closing_fails_what_waits_and_the_store_batches_again_after():
    runner = Runner()
    runner.gate = asyncio.Event()
    b = batcher(runner, lanes=1, hold=0.01)
    running = asyncio.ensure_future(b.submit("x", deadline=later()))
    await asyncio.sleep(0.05)  # held, then sent
    queued = asyncio.ensure_future(b.submit("a", deadline=later()))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(b.close())
    await asyncio.sleep(0)
    with pytest.raises(StoreUnavailable, match=r"^the key store is closing$"):
        await b.submit("b", deadline=later())
    await closing
    closed_while = r"^the key store closed while the statement ran$"
    with pytest.raises(StatementUnanswered, match=closed_while):
        await running
    with pytest.raises(StoreUnavailable, match=r"^the key store is closed$"):
        await queued
    assert b.waiting == 0
    runner.gate.set()
    assert await b.submit("c", deadline=later()) == "<c>"  # opened again: it batches again


async def test_a_held_statement_waits_for_company_then_goes():
    runner = Runner()
    b = batcher(runner, lanes=1, hold=0.05)
    tasks = [asyncio.ensure_future(b.submit(k, deadline=later())) for k in ("a", "b")]
    await asyncio.sleep(0.01)
    assert runner.statements == []  # held for company
    late = asyncio.ensure_future(b.submit("c", deadline=later()))
    await asyncio.gather(*tasks, late)
    assert runner.statements == [["a", "b", "c"]]
    # Alone again: held again.
    again = asyncio.ensure_future(b.submit("d", deadline=later()))
    await asyncio.sleep(0.01)
    assert runner.statements == [["a", "b", "c"]]
    assert await again == "<d>"


async def test_a_request_that_left_a_shared_row_leaves_the_others_on_it():
    runner = Runner()
    runner.gate = asyncio.Event()
    b = batcher(runner, lanes=1, share=lambda item: 0, follow=lambda result: f"after {result}")
    blocker = asyncio.ensure_future(b.submit("x", deadline=later()))
    await asyncio.sleep(0)
    first, gone, last = (asyncio.ensure_future(b.submit("a", deadline=later())) for _ in range(3))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    runner.gate.set()
    await blocker
    # The one that left is skipped; the one after it still rides on the first one's row.
    assert await asyncio.wait_for(asyncio.gather(first, last), 1.0) == ["<a>", "after <a>"]
    assert runner.statements == [["x"], ["a"]]


async def test_an_expired_request_with_a_claim_to_free_still_hears_its_deadline():
    runner = Runner()
    runner.gates = [asyncio.Event(), asyncio.Event()]
    b = batcher(runner, lanes=1)
    blocker = await queued_behind(b, runner)
    heard: list[str] = []
    request = asyncio.ensure_future(b.submit("a", deadline=later(0.1), abandoned=heard.append))
    await asyncio.sleep(0)
    runner.gates[0].set()
    await blocker
    with pytest.raises(StatementUnanswered, match=r"^the key store did not answer in time$"):
        await request
    runner.gates[1].set()
    await asyncio.sleep(0.01)
    assert heard == ["<a>"]  # its row came after all: what it got is not lost


async def test_closing_before_a_statement_ran_tells_its_requests_at_once():
    runner = Runner()
    b = batcher(runner, lanes=1)
    blocker = await queued_behind(b, runner)
    request = asyncio.ensure_future(b.submit("a", deadline=later()))
    await asyncio.sleep(0)
    runner.gates[0].set()  # the lane frees, and a task is made to send "a"...
    closing = asyncio.ensure_future(b.close())  # ...which this cancels before it starts
    with pytest.raises(StoreUnavailable, match=r"^the key store closed before the statement ran$"):
        await asyncio.wait_for(request, 1.0)
    await closing
    await blocker
    assert runner.statements == [["x"]]


async def test_closing_while_a_statement_is_held_then_opening_again_sends_at_once():
    runner = Runner()
    b = batcher(runner, lanes=1, hold=0.05)
    held = asyncio.ensure_future(b.submit("a", deadline=later()))
    await asyncio.sleep(0.01)  # held for company, its timer pending
    await b.close()
    with pytest.raises(StoreUnavailable, match=r"^the key store is closed$"):
        await held
    # Opened again: the next request is held as long as the hold, not until its deadline.
    assert await asyncio.wait_for(b.submit("b", deadline=later()), 1.0) == "<b>"
    assert runner.statements == [["b"]]


async def test_a_failing_statement_leaves_no_unretrieved_error_behind():
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda loop, context: unhandled.append(context))
    try:
        runner = Runner()
        runner.failure = ConnectionError("broken")
        b = batcher(runner, lanes=1)
        with pytest.raises(ConnectionError, match=r"^broken$"):
            await b.submit("a", deadline=later())
        await asyncio.sleep(0.01)
        gc.collect()
        await asyncio.sleep(0)
        assert unhandled == []
    finally:
        loop.set_exception_handler(None)


async def test_a_runner_that_answers_too_few_rows_fails_them_all_at_once():
    async def short(items: Sequence[str], timeout: float, wanted: Callable[[int], bool]):
        return ["<only one>"]

    b: Batcher[str, Any] = Batcher(short, key=lambda item: item, lanes=1, max_size=8, hold=0.01)
    tasks = [asyncio.ensure_future(b.submit(k, deadline=later())) for k in ("a", "b")]
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 1.0)
    assert [str(r) for r in results] == ["the statement answered 1 of 2 rows"] * 2


async def test_a_runner_that_answers_too_many_rows_for_a_lone_statement_fails_it():
    async def extra(items: Sequence[str], timeout: float, wanted: Callable[[int], bool]):
        return ["<one>", "<two>"]

    b: Batcher[str, Any] = Batcher(extra, key=lambda item: item, lanes=1, max_size=8)
    with pytest.raises(RuntimeError, match=r"^the statement answered 2 of 1 rows$"):
        await b.submit("a", deadline=later())
    with pytest.raises(RuntimeError):  # and its lane is free again: the next goes at once
        await asyncio.wait_for(b.submit("b", deadline=later()), 1.0)
