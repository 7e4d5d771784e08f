"""Forwarding one request to the upstream, and its answer back.

The request body is whole before an upstream connection is taken (`bounds.py` reads it into
a `BodySpool`) and goes out with its `Content-Length`, at the upstream's pace; the answer's
body is read at the upstream's pace too and sent on at the client's (`relay.py`), raw (never
decompressed: a Content-Encoding'd body passes byte for byte). A request the middleware runs
under a key has its body handed on whole by the middleware, and its answer is captured by
the middleware.

What a failure means depends on whether the middleware is recording the request:

| failure                                  | recorded (keyed)        | not recorded          |
| ---------------------------------------- | ----------------------- | --------------------- |
| connect refused / unreachable / no slot  | 502, the key is freed   | 502                   |
| timeout or broken connection after send  | OutcomeUnknown (504,    | 504 / 502; the client |
|                                          | key kept to its lease)  | may retry with a key  |
| bytes after the response, a body that    | OutcomeUnknown          | passed on; the        |
| differs from its Content-Length, no      |                         | connection is closed  |
| whole answer within `exchange_timeout`   |                         |                       |
| the gateway cannot hold the answer (its  | OutcomeUnknown          | the response ends     |
| temporary file: disk full, no fds)       |                         | short                 |

A recorded response's end is passed to the middleware (which then records it) only once the
upstream's connection has been seen clean after it: an answer followed by bytes the upstream
should not have sent may not be the answer to this request at all.

A body past the gateway's read-ahead (`request_spool_bytes`) gets 413 before anything is
sent, unless the gateway streams bodies (`request_spool_bytes` 0): then what was read ahead
goes first, and the rest as it arrives, chunked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpcore
import httpx
from starlette.types import Receive, Scope, Send

from .._asgi.context import SCOPE_KEY
from .._asgi.execution import RELEASE, UNREPLAYABLE
from .._errors import OutcomeUnknown
from ..problems import Problem
from . import problems
from .answers import Head
from .bounds import ANSWER_INSTEAD, BODY_KEY, BodyStalled, Bounded
from .deadline import DEADLINE_KEY
from .headers import GATEWAYS_OWN, framed, request_headers, response_headers
from .relay import Pump
from .spool import AnswerSpool, DiskBudget
from .strangers import Strangers
from .target import TARGET_KEY, UpstreamURL
from .tenants import TenantResolver
from .upstream import LeftoverBytes, Timeouts, Upstream, UpstreamResponse
from .waiting import within

logger = logging.getLogger("idempotency_asgi.gateway")

#: Failures before a single byte went out: the upstream cannot have seen the request.
_NOTHING_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class UpstreamOutcomeUnknown(OutcomeUnknown):
    """The request reached the upstream (or may have), and no answer came back: the key stays
    reserved until its lease lapses instead of letting a retry run it a second time."""


class ClientDisconnected(Exception):
    """The client went away while its request body was still being forwarded."""


class Proxy:
    """The ASGI app that forwards to one upstream over a pool of keep-alive connections."""

    def __init__(
        self,
        upstream: str,
        *,
        transport: Upstream,
        client_timeout: float,
        upstream_timeout: float,
        connect_timeout: float,
        preserve_host: bool,
        trust_forwarded: bool,
        exchange_timeout: float,
        stream_requests: bool,
        response_buffer_bytes: int,
        response_spool_bytes: int,
        disk_budget: DiskBudget | None = None,
        stored_bytes: int = 0,
        strangers: Strangers | None = None,
        tenant: TenantResolver | None = None,
        own_headers: frozenset[bytes] = GATEWAYS_OWN,
    ) -> None:
        self._url = UpstreamURL(upstream)
        self._transport = transport
        self._client_timeout = client_timeout
        self._exchange_timeout = exchange_timeout
        self._stream_requests = stream_requests
        self._answer_memory = response_buffer_bytes
        self._answer_disk = response_spool_bytes
        self._disk_budget = disk_budget
        self._stored_bytes = stored_bytes
        # With both: answers to a tenant the upstream never accepted are not all stored.
        self._strangers = strangers if tenant is not None else None
        self._tenant = tenant
        self._preserve_host = preserve_host
        self._trust_forwarded = trust_forwarded
        self._own_headers = own_headers  # the gateway's to say: dropped from every answer
        # Recorded requests may take up to `upstream_timeout` between two reads: their client
        # is answered at its own deadline by ClientDeadline, and the answer is still recorded.
        # Everything else has no one to wait for once the client's patience is out.
        self._recorded_timeouts = _timeouts(connect_timeout, upstream_timeout)
        self._passing_timeouts = _timeouts(connect_timeout, client_timeout)

    async def aclose(self) -> None:
        await self._transport.aclose()

    def target(self, scope: Scope) -> bytes:
        """The request target to send upstream; ValueError for one that cannot be sent."""
        return self._url.target(scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        recorded = SCOPE_KEY in scope
        first = await receive()
        if first["type"] == "http.disconnect":
            return
        content: bytes | AsyncIterator[bytes] = first.get("body", b"")
        length: int | None = len(content)  # type: ignore[arg-type]
        read: Bounded | None = None if recorded else scope.get(BODY_KEY)
        spool = None if read is None else read.take_spool()
        if read is not None and spool is not None:
            # Read ahead whole (or as far as the gateway reads ahead) by `Bounded`.
            if read.overflowed and not self._stream_requests:
                await problems.request_too_large(read.limit or 0).send(send)
                return
            if read.overflowed:
                rest = None if read.whole else receive
                content, length = _streamed(spool.stream(), rest), None
            else:
                content = spool.whole() if spool.in_memory else spool.stream()
                length = spool.size
        elif first.get("more_body", False):
            # A body in parts, not read ahead (the proxy under a server of one's own).
            content, length = _streamed(_one(content), receive), None  # type: ignore[arg-type]
        # As received: methods are case-sensitive (RFC 9110), and upper-casing one would turn
        # a method the gateway does not cover ("post") into one it does.
        method: str = scope["method"]
        target: bytes | None = scope.get(TARGET_KEY)
        if target is None:  # the proxy on its own: the gateway checks the target first
            try:
                target = self._url.target(scope)
            except ValueError as exc:
                await _refuse(problems.cannot_forward(str(exc)), send, recorded=recorded)
                return
        headers = request_headers(
            scope["headers"],
            client=scope.get("client"),
            scheme=scope.get("scheme", "http"),
            preserve_host=self._preserve_host,
            trust_forwarded=self._trust_forwarded,
        )
        if recorded and DEADLINE_KEY in scope:
            # The body is read and the key claimed: from now on the upstream may be working,
            # and its answer will be recorded. (A keyed request the middleware passed through,
            # an exempt path, is never armed: nothing will be recorded for it.)
            scope[DEADLINE_KEY].arm()
        request = _Request(
            method.encode("ascii"),
            self._url.url(target),
            framed(headers, method=method, length=length, host=self._url.netloc),
            content,
        )
        if recorded and self._tenant is not None:
            request.tenant = self._tenant(scope)
        await self._exchange(request, receive, send, recorded=recorded)

    async def _exchange(
        self, request: _Request, receive: Receive, send: Send, *, recorded: bool
    ) -> None:
        sending = self._transport.send(
            request.method,
            request.url,
            request.headers,
            request.content,
            self._recorded_timeouts if recorded else self._passing_timeouts,
        )
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + self._exchange_timeout
        try:
            response = await (within(sending, self._exchange_timeout) if recorded else sending)
        except ClientDisconnected:
            return
        except asyncio.TimeoutError:
            raise UpstreamOutcomeUnknown(
                f"no answer from the upstream within {self._exchange_timeout:g} s"
            ) from None
        except _NOTHING_SENT as exc:
            logger.warning("upstream unavailable: %r", exc)
            await problems.upstream_unavailable(_reason(exc)).send(send)
            return
        except httpx.LocalProtocolError as exc:
            # The request cannot be written as it is (nothing went out): it is malformed.
            await _refuse(problems.cannot_forward(str(exc)), send, recorded=recorded)
            return
        except httpx.TransportError as exc:
            await self._no_answer(exc, send, recorded=recorded, started=False)
            return
        # A recorded answer must be whole within the exchange's deadline, from forwarding.
        seconds = max(0.0, ends_at - loop.time()) if recorded else None
        await self._relay(response, request, receive, send, recorded, seconds)

    async def _relay(
        self,
        response: UpstreamResponse,
        request: _Request,
        receive: Receive,
        send: Send,
        recorded: bool,
        seconds: float | None,
    ) -> None:
        method = request.method
        head: Head | None = getattr(response, "head", None)  # None: a transport of one's own
        if head is not None and (head.invalid is not None or head.phantom_length):
            await self._unusable(response, head, request, send, recorded=recorded)
            return
        headers = response_headers(response.headers, self._own_headers)
        start = {"type": "http.response.start", "status": response.status, "headers": headers}
        has_body = _has_body(method, response)
        if recorded and has_body and _ends_at_close(response.headers):
            # Its end is the connection's close, which a crash half way through looks like
            # too: it is passed on as it comes, and recorded as done, but never replayed.
            start[UNREPLAYABLE] = True
        if not self._storable(request, response.status):
            # The middleware frees the key, and passes the answer on as it is.
            start[RELEASE] = True
        # A recorded answer unlike its Content-Length is never recorded (a transport of one's
        # own may hand one over; the gateway's connections refuse one themselves).
        declared = _content_length(headers) if has_body else None
        spool = AnswerSpool(
            memory=self._answer_memory,
            disk=self._answer_disk,
            budget=self._disk_budget,
            # A recorded answer never fails for want of disk: the middleware gets it whole
            # (within what it stores) from memory, and records it.
            fallback=self._stored_bytes + 1 if recorded else 0,
        )
        pump = Pump(response, spool)
        try:
            await pump.start(seconds)
            await send(start)
            await self._drain(spool, pump, declared, receive, send, recorded=recorded)
        finally:
            await pump.stop()
            spool.close()

    async def _drain(
        self,
        spool: AnswerSpool,
        pump: Pump,
        declared: int | None,
        receive: Receive,
        send: Send,
        *,
        recorded: bool,
    ) -> None:
        """Send the body's parts on as they come. The last one, when a Content-Length says
        which it is, ends a passing response: the common one-part answer takes one send.
        Otherwise an empty message ends it; always so for a recorded one, whose end waits
        until the connection was seen clean after it (by the pump)."""
        length = None if recorded else declared
        sent = 0
        # A recorded response is read to its end (the middleware stores it, whoever
        # listens); a passing one stops as soon as its client has gone.
        gone: asyncio.Future[None] | None = None
        try:
            while True:
                try:
                    part = await spool.get()
                except LeftoverBytes as exc:
                    if recorded:
                        raise UpstreamOutcomeUnknown(
                            f"the upstream's answer is suspect: {exc}"
                        ) from exc
                    # Passing: the answer went on as it came; the connection is closed.
                    logger.warning("upstream sent bytes after its response; connection closed")
                    break
                except httpx.TransportError as exc:
                    await self._no_answer(exc, send, recorded=recorded, started=True)
                    return
                except Exception as exc:
                    # The gateway's own failure while it held the answer (its temporary
                    # file: a full disk, no descriptors left), after the request went
                    # upstream: for a recorded one, what the upstream did is as unknown as
                    # when the answer breaks off, and its key is held, not released.
                    if recorded:
                        raise UpstreamOutcomeUnknown(
                            f"the gateway could not hold the upstream's answer: {exc!r}"
                        ) from exc
                    logger.warning("answer abandoned, the gateway could not hold it: %r", exc)
                    return
                if part is None:
                    break
                sent += len(part)
                complete = sent == length
                await send({"type": "http.response.body", "body": part, "more_body": not complete})
                if complete:
                    await pump.finish()  # the body is whole: only the look after it is left
                    return
                if recorded:
                    continue
                if gone is None:
                    gone = asyncio.ensure_future(_client_left(receive))
                elif gone.done():
                    return
        finally:
            if gone is not None:
                gone.cancel()
        if recorded and declared is not None and declared != sent:
            raise UpstreamOutcomeUnknown(f"the upstream declared {declared} bytes and sent {sent}")
        await send({"type": "http.response.body", "body": b""})

    def _storable(self, request: _Request, status: int) -> bool:
        """False for an answer that must not be stored: one to a tenant the upstream has not
        answered a 2xx yet (see `strangers.py`)."""
        if request.tenant is None or self._strangers is None:
            return True
        storable = self._strangers.storable(request.tenant, status)
        if not storable:
            logger.info("not stored: %d to a tenant the upstream has not accepted yet", status)
        return storable

    async def _unusable(
        self,
        response: UpstreamResponse,
        head: Head,
        request: _Request,
        send: Send,
        *,
        recorded: bool,
    ) -> None:
        """An answer that cannot be passed on as it came: its fields cannot be written (or
        trusted), or where its body ends is in doubt. Nothing of its body is read, and its
        connection is closed."""
        await response.aclose()
        if head.invalid is None:
            # A 204 or 304 declaring a body it cannot have: passing, it goes on without the
            # length (which the server could not write); recorded, its length is unlike its
            # body, and such an answer is never recorded.
            if recorded:
                raise UpstreamOutcomeUnknown(
                    f"the upstream's {head.status} declared a body it cannot have"
                )
            kept = response_headers(head.headers, self._own_headers)
            headers = [(n, v) for n, v in kept if n != b"content-length"]
            await send({"type": "http.response.start", "status": head.status, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        logger.warning("upstream answer refused (%d): %s", head.status, head.invalid)
        if recorded and not 200 <= head.status <= 599:
            # No final status to settle the key by (a 101 nobody asked for, 600 or more):
            # the upstream did act, so what came of it is unknown, and the key is held, not
            # freed for a retry that would run it again.
            raise UpstreamOutcomeUnknown(
                f"the upstream answered status {head.status}, which is not a final one"
            )
        problem = problems.answer_invalid(head.invalid, head.status, recorded=recorded)
        if recorded and 200 <= head.status <= 599:
            # It ran, and its status is known: the middleware settles the key by it (stored
            # without a body, or released), and the client gets the problem instead.
            await send(
                {
                    "type": "http.response.start",
                    "status": head.status,
                    "headers": [],
                    UNREPLAYABLE: True,
                    RELEASE: not self._storable(request, head.status),
                    ANSWER_INSTEAD: problem,
                }
            )
            await send({"type": "http.response.body", "body": b""})
        else:
            await problem.send(send)

    async def _no_answer(
        self, exc: httpx.TransportError, send: Send, *, recorded: bool, started: bool
    ) -> None:
        """The request went out (or may have) and its answer did not come back whole."""
        if recorded:
            raise UpstreamOutcomeUnknown(f"the upstream did not answer: {exc!r}") from exc
        if started:
            # Too late for a problem answer: the server ends the response short, which tells
            # the client it is incomplete.
            logger.warning("upstream response broke off: %r", exc)
            return
        logger.warning("upstream did not answer: %r", exc)
        if isinstance(exc, httpx.TimeoutException):
            await problems.upstream_timeout(self._client_timeout).send(send)
        else:
            await problems.upstream_failed().send(send)


async def _refuse(problem: Problem, send: Send, *, recorded: bool) -> None:
    """The gateway's own refusal of a request nothing of which went upstream: under a key, the
    key is freed (never recorded), so that the corrected retry runs. (The gateway refuses
    what it can see before the key is claimed: this is for what it cannot.)"""
    if not recorded:
        await problem.send(send)
        return
    headers, body = problem.render()
    start = {"type": "http.response.start", "status": problem.status, "headers": headers}
    await send({**start, RELEASE: True})
    await send({"type": "http.response.body", "body": body})


def _streamed(first: AsyncIterator[bytes], rest: Receive | None) -> AsyncIterator[bytes]:
    """What was read ahead, then the rest of the body (if any: `rest`) as it arrives."""

    async def parts() -> AsyncIterator[bytes]:
        async for part in first:
            yield part
        if rest is None:
            return
        try:
            async for part in _stream_body(rest):
                yield part
        except BodyStalled as exc:
            # The request and what came of its body are upstream already.
            exc.forwarded = True
            raise

    return parts()


async def _one(part: bytes) -> AsyncIterator[bytes]:
    yield part


class _Request:
    """One request as it goes upstream."""

    __slots__ = ("content", "headers", "method", "tenant", "url")

    def __init__(
        self,
        method: bytes,
        url: httpcore.URL,
        headers: list[tuple[bytes, bytes]],
        content: bytes | AsyncIterator[bytes],
    ) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.content = content
        self.tenant: str | None = None  # a recorded request's, when strangers are told apart


def _has_body(method: bytes, response: UpstreamResponse) -> bool:
    """Whether the response can have a body at all (RFC 9110, section 6.4.1)."""
    status = response.status
    return method != b"HEAD" and status >= 200 and status not in (204, 304)


def _ends_at_close(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a response's body has neither a length nor a transfer coding (RFC 9112,
    section 6.3): it ends where the connection does, whole or not."""
    framing = (b"content-length", b"transfer-encoding")
    return not any(name.lower() in framing for name, _ in headers)


def _timeouts(connect: float, read: float) -> Timeouts:
    # `pool`: the wait for a free connection when all `max_connections` are busy.
    return {"connect": connect, "read": read, "write": read, "pool": connect}


def _reason(exc: Exception) -> str:
    if isinstance(exc, httpx.PoolTimeout):
        return "no free connection to it in time"
    if isinstance(exc, httpx.ConnectTimeout):
        return "connecting timed out"
    return "connection refused or unreachable"


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _client_left(receive: Receive) -> None:
    """Returns once the client has gone. Only `http.disconnect` says so: anything else (the
    rest of a request body the upstream answered without reading) is not the client leaving."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _stream_body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return
