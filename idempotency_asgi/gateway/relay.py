"""An upstream answer's body on its way to the client, at each one's own pace.

A pump (a task of its own) reads the body from the upstream as fast as the upstream sends it,
into an `AnswerSpool` (memory, then a temporary file), and gives the upstream connection back
as soon as the body is whole; the request's own task takes the parts from the spool and sends
them to the client as the client reads them. A client that reads slowly, or not at all, so
holds its socket and some disk (until `send_timeout` lets it go), never an upstream
connection, as nginx's proxy buffering does. Past the spool's disk bound, the pump waits for
the client.

Each part goes on as soon as it arrives: an event stream is not held back a part. What is
already in hand when the answer's head is read (for a small answer, all of it) is taken at
once, without a task.

The pump gives the event loop a turn once it has run `YIELD_SECONDS` without one: an upstream
that sends faster than the pump reads would otherwise have every other request on the worker
wait for as long as it kept sending. A bound of time, not of bytes: what a byte costs depends
on the answer's framing (a chunked body in one-byte chunks with bare LFs costs some fifty
times what a Content-Length body does), and each part the pump moves is bounded in work
(see chunks.ONE_BY_ONE: the decoder hands on what it has every so many chunks).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any, cast

import httpx

from .spool import AnswerSpool
from .upstream import UpstreamResponse
from .waiting import Resumed, within

#: The longest the pump runs before the event loop gets a turn, in seconds.
YIELD_SECONDS = 0.005


class ExchangeExpired(httpx.TimeoutException):
    """The upstream's whole answer did not arrive within the exchange's deadline."""


class Pump:
    """Reads `response`'s body into `spool`, within `seconds` (None: no bound), then closes
    the response (which gives its connection back). What went wrong is the spool's to tell.

    What is already in hand is read at once, in the request's own task (for most answers,
    the whole body came with the head, and the connection goes back before the first send);
    a task of its own reads on only when the body is not whole yet."""

    def __init__(self, response: UpstreamResponse, spool: AnswerSpool) -> None:
        self._response = response
        self._spool = spool
        self._task: asyncio.Future[None] | None = None

    async def start(self, seconds: float | None) -> None:
        parts = self._response.__aiter__()
        loop = asyncio.get_running_loop()
        turn = loop.time() + YIELD_SECONDS
        while True:
            following = parts.__anext__()
            if not hasattr(following, "send") or loop.time() >= turn:
                # An awaitable of some other kind (no peeking), or enough taken at once: the
                # rest is the task's.
                self._task = asyncio.ensure_future(self._run(following, parts, seconds))
                return
            # An async generator's step is a coroutine in all but name.
            step = cast(Coroutine[Any, Any, bytes], following)
            try:
                waits_on = step.send(None)
            except StopIteration as done:
                self._took(done.value)
                continue
            except StopAsyncIteration:
                self._spool.end()
            except Exception as exc:
                self._spool.fail(exc)
            else:
                resumed = Resumed(step, waits_on)
                self._task = asyncio.ensure_future(self._run(resumed, parts, seconds))
                return
            await self._close()
            return

    def _took(self, part: bytes) -> None:
        self._spool.put_now(part)

    async def _run(
        self, first: Awaitable[bytes], parts: AsyncIterator[bytes], seconds: float | None
    ) -> None:
        try:
            if seconds is None:
                await self._fill(first, parts)
            else:
                await within(self._fill(first, parts), seconds)
        except asyncio.TimeoutError:
            self._spool.fail(
                ExchangeExpired(f"no whole answer from the upstream within {seconds:g} s")
            )
        except Exception as exc:
            self._spool.fail(exc)
        else:
            self._spool.end()
        finally:
            await self._close()

    async def _fill(self, first: Awaitable[bytes], parts: AsyncIterator[bytes]) -> None:
        try:
            part = await first
        except StopAsyncIteration:
            return
        loop = asyncio.get_running_loop()
        turn = loop.time() + YIELD_SECONDS
        while True:
            await self._spool.put(part)
            if loop.time() >= turn:
                await asyncio.sleep(0)
                turn = loop.time() + YIELD_SECONDS
            try:
                part = await parts.__anext__()
            except StopAsyncIteration:
                return

    async def _close(self) -> None:
        with contextlib.suppress(httpx.TransportError):
            await self._response.aclose()

    async def finish(self) -> None:
        """Wait for the pump to be done (the body read, or its failure in the spool)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Abandon the body: the upstream connection is closed, not reused."""
        if self._task is None:
            return
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
