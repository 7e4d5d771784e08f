"""An upstream answer's body on its way to the client, at each one's own pace.

A pump (a task of its own) reads the body from the upstream as fast as the upstream sends it,
into an `AnswerSpool` (memory, then a temporary file), and gives the upstream connection back
as soon as the body is whole; the request's own task takes the parts from the spool and sends
them to the client as the client reads them. A client that reads slowly, or not at all, so
holds its socket and some disk (until `send_timeout` lets it go), never an upstream
connection, as nginx's proxy buffering does. Past the spool's disk bound, the pump waits for
the client.

Each part goes on as soon as it arrives: an event stream is not held back a part.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from .spool import AnswerSpool
from .upstream import UpstreamResponse
from .waiting import within


class ExchangeExpired(httpx.TimeoutException):
    """The upstream's whole answer did not arrive within the exchange's deadline."""


class Pump:
    """Reads `response`'s body into `spool`, within `seconds` (None: no bound), then closes
    the response (which gives its connection back). What went wrong is the spool's to tell."""

    def __init__(
        self, response: UpstreamResponse, spool: AnswerSpool, seconds: float | None
    ) -> None:
        self.received = 0
        self._response = response
        self._spool = spool
        self._task = asyncio.ensure_future(self._run(seconds))

    async def _run(self, seconds: float | None) -> None:
        try:
            if seconds is None:
                await self._fill()
            else:
                await within(self._fill(), seconds)
        except asyncio.TimeoutError:
            self._spool.fail(
                ExchangeExpired(f"no whole answer from the upstream within {seconds:g} s")
            )
        except Exception as exc:
            self._spool.fail(exc)
        else:
            self._spool.end()
        finally:
            with contextlib.suppress(httpx.TransportError):
                await self._response.aclose()

    async def _fill(self) -> None:
        async for part in self._response:
            self.received += len(part)
            await self._spool.put(part)

    async def finish(self) -> None:
        """Wait for the pump to be done (the body read, or its failure in the spool)."""
        await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Abandon the body: the upstream connection is closed, not reused."""
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
