"""Bounds on the phases of a request that the ASGI app itself sees, so that they hold under
any server: a request body that stops arriving (`body_timeout`, between two parts of it) or
does not arrive whole in time (`body_deadline`), and a client that stops reading its
response (`send_timeout`, for each part of it).

A slow client must not hold what others need: an upstream connection (there are
`max_connections`) or a key in flight. So a request body is read whole before anything is
forwarded (`BodySpool`: in memory up to `request_buffer_bytes`, then in a temporary file),
within its deadline; the proxy then sends it at the upstream's pace. The phases before the
app runs (the request head, an idle keep-alive connection) belong to the server: the command
bounds them there (see `server.py`), and nginx in front bounds all of them again.

Two more things happen on the way out, to the answer itself:

- `ANSWER_INSTEAD`: the proxy marks an upstream answer that cannot be passed on; the
  middleware settles the key by its status, and the client gets the problem in its place;
- an HTTP/1.0 client cannot read a chunked body: an answer without a length is held until it
  is whole and sent with one (uvicorn's httptools writer would chunk it), within the answer's
  own bounds (`response_buffer_bytes` in memory, `response_spool_bytes` in all).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from starlette.types import Message, Receive, Scope, Send

from ..problems import Problem
from . import problems
from .spool import BodySpool, DiskBudget
from .waiting import within

#: A key of `http.response.start`: the Problem the client gets instead of this answer, whose
#: status the middleware settles the key by (see `Bounded.send`). The proxy sets it on an
#: upstream answer that cannot be passed on: the request ran, and its status is known.
ANSWER_INSTEAD = "idempotency_asgi.gateway.answer_instead"

#: Where the request's `Bounded` sits in the ASGI scope: the proxy takes a spooled body from it.
BODY_KEY = "idempotency_asgi.gateway.body"


class BodyStalled(Exception):
    """The request body stopped arriving (`body_timeout`), or was not whole in time
    (`body_deadline`): `seconds` and which."""

    def __init__(self, seconds: float, *, whole: bool) -> None:
        super().__init__(seconds)
        self.seconds = seconds
        self.whole = whole
        #: the request and part of its body had gone upstream (a body streamed on)
        self.forwarded = False


class ClientTooSlow(OSError):
    """The client took no part of its response within `send_timeout`. An OSError, as a send
    to a client that has gone is: the middleware then still records the answer."""


class AnswerTooLarge(ClientTooSlow):
    """An answer without a length, held for an HTTP/1.0 client until it is whole, grew past
    its bound: nothing of it was sent, and the client gets a problem instead."""

    def __init__(self, status: int, limit: int) -> None:
        super().__init__(
            f"an answer without a length past {limit} bytes cannot be framed for an HTTP/1.0 client"
        )
        self.status = status
        self.limit = limit


def declares_body(scope: Scope) -> bool:
    """Whether the request has a body to wait for (a length above 0, or chunked)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b"0 ")):
            return True
    return False


class BodyLimits:
    """How a request body is read: per pause, in all, in memory."""

    __slots__ = ("budget", "deadline", "memory", "pause")

    def __init__(
        self, *, pause: float, deadline: float, memory: int, budget: DiskBudget | None = None
    ) -> None:
        self.pause = pause
        self.deadline = deadline
        self.memory = memory
        self.budget = budget  # the process's temporary files, all together


class Bounded:
    """One request's receive and send, each bounded; `started` once the response began.

    The first `receive()` reads the body whole into `spool` (up to `limit` bytes: past it,
    `overflowed`, and the rest is read part by part as it is asked for), then hands it on."""

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        body: BodyLimits,
        response: float,
        whole_answers: WholeLimits | None = None,
    ) -> None:
        self._receive = receive
        self._send = send
        self._body = body
        self._send_seconds = response
        # Past the body's end, receive() only waits for a disconnect, however long.
        self._reading = declares_body(scope)
        self.started = False
        #: the most the body is read ahead before the application has it (None: not at all)
        self.limit: int | None = None
        self.spool: BodySpool | None = None
        self.overflowed = False
        self._ends_at: float | None = None
        self._handing: Iterator[Message] | None = None
        self._instead: bytes | None = None  # the body of an answer sent instead
        self._whole = None if whole_answers is None else _WholeAnswer(whole_answers)

    # -- the request body ------------------------------------------------------------------

    async def receive(self) -> Message:
        if self._handing is not None:
            message = next(self._handing, None)
            if message is not None:
                return message
            self._handing = None
        if not self._reading or self.started:
            return await self._receive()
        if self.spool is None and self.limit is not None:
            return await self._read_ahead()
        message = await self._part()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._reading = False
        return message

    async def _part(self) -> Message:
        """The next message, within the pause allowed and what is left of the deadline."""
        loop = asyncio.get_running_loop()
        if self._ends_at is None:
            self._ends_at = loop.time() + self._body.deadline
        left = self._ends_at - loop.time()
        whole = left < self._body.pause  # the deadline comes before the pause's end
        try:
            return await within(self._receive(), max(left, 0.0) if whole else self._body.pause)
        except asyncio.TimeoutError:
            seconds = self._body.deadline if whole else self._body.pause
            raise BodyStalled(seconds, whole=whole) from None

    async def _read_ahead(self) -> Message:
        assert self.limit is not None
        spool = self.spool = BodySpool(memory=self._body.memory, budget=self._body.budget)
        while True:
            message = await self._part()
            if message["type"] != "http.request":
                self._reading = False
                return message  # gone before its body was whole: nothing to hand on
            spool.write(message.get("body", b""))
            more_body = message.get("more_body", False)
            if not more_body:
                self._reading = False
            if spool.size > self.limit:
                self.overflowed = True
                break
            if not more_body:
                break
        self._handing = self._messages(spool, more_body=self._reading)
        return next(self._handing)

    @property
    def whole(self) -> bool:
        """Whether the body was read to its end."""
        return not self._reading

    def take_spool(self) -> BodySpool | None:
        """The body read ahead, for one who forwards it straight from there: it is no longer
        handed on by `receive()`, which gives the rest of the body, if any, part by part."""
        self._handing = None
        return self.spool

    @staticmethod
    def _messages(spool: BodySpool, *, more_body: bool) -> Iterator[Message]:
        if spool.in_memory:
            yield {"type": "http.request", "body": spool.whole(), "more_body": more_body}
            return
        parts = spool.parts()
        part = next(parts, b"")
        for after in parts:
            yield {"type": "http.request", "body": part, "more_body": True}
            part = after
        yield {"type": "http.request", "body": part, "more_body": more_body}

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()
        if self._whole is not None:
            self._whole.close()

    # -- the answer ------------------------------------------------------------------------

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
            if message.get("more_body", False):
                return
            message = {"type": "http.response.body", "body": self._instead}
        if self._whole is not None:
            try:
                for whole in self._whole.hold(message):
                    await self._deliver(whole)
            except AnswerTooLarge as exc:
                # Raised before any of the answer went out: the client gets a problem instead.
                await problems.http10_answer_too_large(exc.status, exc.limit).send(self._deliver)
                raise
            return
        await self._deliver(message)

    async def _deliver(self, message: Message) -> None:
        try:
            await within(self._send(message), self._send_seconds)
        except asyncio.TimeoutError:
            raise ClientTooSlow(f"the client read nothing for {self._send_seconds:g} s") from None


class WholeLimits:
    """How much of an answer is held for an HTTP/1.0 client until it is whole: in memory up
    to `memory` bytes (`response_buffer_bytes`), then in a temporary file; at most
    `at_most` bytes in all (`response_spool_bytes`, or `memory` when that is larger)."""

    __slots__ = ("at_most", "budget", "memory")

    def __init__(self, *, memory: int, disk: int, budget: DiskBudget | None = None) -> None:
        self.memory = memory
        self.at_most = max(memory, disk)
        self.budget = budget


class _WholeAnswer:
    """For an HTTP/1.0 client: an answer with neither a length nor a transfer coding is held
    until its body is whole, then sent with a `Content-Length` (a chunked body is HTTP/1.1's,
    and uvicorn's httptools writer chunks every answer without a length). Past the limit,
    nothing of it is sent: `AnswerTooLarge`, and the client gets a problem instead."""

    def __init__(self, limits: WholeLimits) -> None:
        self._limits = limits
        self._start: Message | None = None
        self._spool: BodySpool | None = None

    def hold(self, message: Message) -> Iterator[Message]:
        """The messages to send now, in order."""
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", ())}
            framed = b"content-length" in names or b"transfer-encoding" in names
            if framed or message.get("status", 200) in (204, 304):
                yield message
                return
            self._start = message
            self._spool = BodySpool(memory=self._limits.memory, budget=self._limits.budget)
            return
        if self._start is None or self._spool is None:
            yield message
            return
        body = message.get("body", b"")
        if self._spool.size + len(body) > self._limits.at_most:
            status = self._start.get("status", 200)
            self._start = None
            self._spool.close()
            raise AnswerTooLarge(status, self._limits.at_most)
        self._spool.write(body)
        if message.get("more_body", False):
            return
        start, spool = self._start, self._spool
        self._start = None
        headers = [*start.get("headers", ()), (b"content-length", b"%d" % spool.size)]
        yield {**start, "headers": headers}
        for part in spool.parts():
            yield {"type": "http.response.body", "body": part, "more_body": True}
        yield {"type": "http.response.body", "body": b""}

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()


def _closing(start: Message) -> Message:
    headers = [(n, v) for n, v in start.get("headers", ()) if n.lower() != b"connection"]
    return {**start, "headers": [*headers, (b"connection", b"close")]}
