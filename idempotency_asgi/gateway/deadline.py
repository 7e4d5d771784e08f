"""The client's deadline on a recorded request: answer at the deadline, finish anyway.

When the upstream is slower than the client may wait, the client gets a 504 at its deadline,
but the request is not stopped: the middleware still records the upstream's answer, exactly as
it records a response whose client went away. A retry meanwhile gets 409 (in flight), a retry
after gets the real answer, and the upstream never sees the request twice. Cancelling instead
would be worse: the middleware frees the key of a cancelled request, and a retry would run it
a second time while the first may still be taking effect upstream.

The deadline runs from the moment the request is forwarded: the proxy arms it through the
scope (`DEADLINE_KEY`) once the middleware has read the body and claimed the key. Until then
nothing is running upstream and nothing would be recorded, so a 504 saying "the request goes
on" would be false (a slow upload is not a slow upstream). A request with a key that the
middleware does not record after all (an exempt path) is never armed: its own read timeout
answers instead.

No task per request: a timer fires at the deadline, and only then is the 504 sent (from a task
of its own) while the request runs on, its own messages discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..problems import Problem

logger = logging.getLogger("idempotency_asgi.gateway")

#: Where the request's deadline sits in the ASGI scope, for `disarm()`.
DEADLINE_KEY = "idempotency_asgi.gateway.deadline"


class ClientDeadline:
    def __init__(self, app: ASGIApp, *, seconds: float, answer: Problem) -> None:
        self.app = app
        self._seconds = seconds
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        responder = Responder(send, self._answer, self._seconds)
        try:
            await self.app({**scope, DEADLINE_KEY: responder}, receive, responder.send)
        except Exception:
            if not responder.expired:
                raise
            # The client has its 504 already; what failed afterwards is only worth a log line.
            logger.exception("request failed after its client's deadline")
        finally:
            responder.disarm()
            if responder.answering is not None:
                await responder.answering


class Responder:
    def __init__(self, send: Send, answer: Problem, seconds: float) -> None:
        self._send = send
        self._answer = answer
        self._seconds = seconds
        self.timer: asyncio.TimerHandle | None = None
        self.started = False
        self.expired = False
        self.answering: asyncio.Task[None] | None = None

    def arm(self) -> None:
        """The request goes upstream now: its client is answered at most `seconds` later."""
        if self.timer is None and not self.expired:
            self.timer = asyncio.get_running_loop().call_later(self._seconds, self.expire)

    def disarm(self) -> None:
        """No 504 from here: the request is over."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    async def send(self, message: Message) -> None:
        if self.expired:
            return  # the client has had its answer; the middleware records this one
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    def expire(self) -> None:
        if self.started:
            return  # the answer is on its way: never interrupt a response
        self.expired = True
        self.answering = asyncio.ensure_future(self._deliver())

    async def _deliver(self) -> None:
        with contextlib.suppress(OSError):
            await self._answer.send(self._send)
