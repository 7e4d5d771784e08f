"""Bounds on the phases of a request that the ASGI app itself sees, so that they hold under
any server: a request body that stops arriving (`body_timeout`, between two parts of it) and
a client that stops reading its response (`send_timeout`, for each part of it).

A slow client must not hold what others need: an upstream connection (there are
`max_connections`) or a key in flight. The phases before the app runs (the request head,
an idle keep-alive connection) belong to the server: the command bounds them there (see
`server.py`), and nginx in front bounds all of them again.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Message, Receive, Scope, Send

from ..problems import Problem

T = TypeVar("T")

#: A key of `http.response.start`: the Problem the client gets instead of this answer, whose
#: status the middleware settles the key by (see `Bounded.send`). The proxy sets it on an
#: upstream answer that cannot be passed on: the request ran, and its status is known.
ANSWER_INSTEAD = "idempotency_asgi.gateway.answer_instead"


class BodyStalled(Exception):
    """No part of the request body arrived within `body_timeout`."""


class ClientTooSlow(OSError):
    """The client took no part of its response within `send_timeout`. An OSError, as a send
    to a client that has gone is: the middleware then still records the answer."""


if sys.version_info >= (3, 11):

    async def within(awaitable: Awaitable[T], seconds: float) -> T:
        """`awaitable`'s result, or TimeoutError after `seconds`."""
        async with asyncio.timeout(seconds):
            return await awaitable

else:  # pragma: no cover

    async def within(awaitable: Awaitable[T], seconds: float) -> T:
        return await asyncio.wait_for(awaitable, seconds)


def declares_body(scope: Scope) -> bool:
    """Whether the request has a body to wait for (a length above 0, or chunked)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b"0 ")):
            return True
    return False


class Bounded:
    """One request's receive and send, each bounded; `started` once the response began."""

    def __init__(
        self, scope: Scope, receive: Receive, send: Send, *, body: float, response: float
    ) -> None:
        self._receive = receive
        self._send = send
        self._body_seconds = body
        self._send_seconds = response
        # Past the body's end, receive() only waits for a disconnect, however long.
        self._reading = declares_body(scope)
        self.started = False
        self._instead: bytes | None = None  # the body of an answer sent instead

    async def receive(self) -> Message:
        if not self._reading or self.started:
            return await self._receive()
        try:
            message = await within(self._receive(), self._body_seconds)
        except asyncio.TimeoutError:
            raise BodyStalled from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._reading = False
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            instead: Problem | None = message.get(ANSWER_INSTEAD)
            if instead is not None:
                # The middleware has settled the key by the upstream's status; the client
                # gets the problem, whole, in place of the (empty) answer.
                headers, self._instead = instead.render()
                message = {"type": message["type"], "status": instead.status, "headers": headers}
            self.started = True
            if self._reading:
                # Answered before the body was whole (a refusal, or an upstream that did not
                # wait for it): the connection closes after this answer, so the rest of the
                # body is neither read as a request nor read at all, however slowly it comes.
                message = _closing(message)
        elif self._instead is not None:
            if not message.get("more_body", False):
                message = {"type": "http.response.body", "body": self._instead}
            else:
                return
        try:
            await within(self._send(message), self._send_seconds)
        except asyncio.TimeoutError:
            raise ClientTooSlow(f"the client read nothing for {self._send_seconds:g} s") from None


def _closing(start: Message) -> Message:
    headers = [(n, v) for n, v in start.get("headers", ()) if n.lower() != b"connection"]
    return {**start, "headers": [*headers, (b"connection", b"close")]}
