"""Keep-alive connections to the one upstream.

httpx's own transport (httpcore's pool) serves any number of origins and, on every request,
walks all of its connections, checking each idle one for a server-side close with a poll()
system call: with 32 connections busy that walk was half of the gateway's CPU time in the
benchmark's profile. One upstream needs much less: a stack of idle connections (the most
recently used on top, the least likely to have been closed by the upstream's idle timeout),
and a count of open ones. Each request checks only the connection it takes; each return
checks only the oldest idle one, so unused connections still close after `keepalive_expiry`.

The connections are the gateway's own (`connection.py`: HTTP/1.1 spoken directly, so that
each answer's framing and fields are known and checked), on sockets from
`backend.AsyncioBackend` (plain asyncio rather than anyio); the pool dials them itself (TCP,
then TLS for https), so a failure there is a connect failure: nothing was sent.
The proxy sends through `send()` (an `upstream.Upstream`), which takes the request's parts
as they are and makes no httpx objects; the pool is also an httpx transport. Failures
surface as httpx's exceptions either way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import AsyncIterable, AsyncIterator

import httpcore
import httpx

from .backend import AsyncioBackend, AsyncioStream
from .connection import ConnectionResponse, UpstreamConnection, raise_as_httpx
from .upstream import Headers, Timeouts, UpstreamResponse


class UpstreamPool(httpx.AsyncBaseTransport):
    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_expiry: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._max = max_connections
        self._expiry = keepalive_expiry
        self._ssl_context = ssl_context
        self._backend = AsyncioBackend()
        self._idle: list[UpstreamConnection] = []
        self._open = 0  # connections in use or idle
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def send(
        self,
        method: bytes,
        url: httpcore.URL,
        headers: Headers,
        content: bytes | AsyncIterator[bytes] | AsyncIterable[bytes],
        timeouts: Timeouts,
    ) -> UpstreamResponse:
        connection = await self._connection(url.origin, timeouts)
        try:
            response = await connection.send(method, url.target, headers, content, timeouts)
        except BaseException:
            await self._give_back(connection)
            raise
        return _PooledResponse(self, response)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport interface, for use as an httpx client's transport."""
        url = request.url
        stream = request.stream
        assert isinstance(stream, AsyncIterable)
        response = await self.send(
            request.method.encode("ascii"),
            httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            request.headers.raw,
            stream,
            request.extensions.get("timeout", {}),
        )
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_HttpxBody(response),
            extensions=response.extensions,
        )

    async def _connection(self, origin: httpcore.Origin, timeouts: Timeouts) -> UpstreamConnection:
        deadline: float | None = None
        while True:
            while self._idle:
                connection = self._idle.pop()
                if connection.is_idle() and not connection.has_expired():
                    return connection
                await self._discard(connection)
            if self._open < self._max:
                break
            # All busy: wait for one to come back (or close), until `pool` seconds passed.
            loop = asyncio.get_running_loop()
            timeout = timeouts.get("pool")
            if deadline is None and timeout is not None:
                deadline = loop.time() + timeout
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiting.append(waiter)
            try:
                await asyncio.wait_for(
                    waiter, None if deadline is None else max(0.0, deadline - loop.time())
                )
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, but leaving: the turn goes to the next one
                else:
                    with contextlib.suppress(ValueError):
                        self._waiting.remove(waiter)
                if isinstance(exc, asyncio.TimeoutError):
                    raise httpx.PoolTimeout("no free connection to the upstream") from None
                raise
        self._open += 1
        try:
            stream = await self._connect(origin, timeouts.get("connect"))
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise
        return UpstreamConnection(stream, keepalive_expiry=self._expiry)

    async def _connect(self, origin: httpcore.Origin, timeout: float | None) -> AsyncioStream:
        host = origin.host.decode("ascii")
        try:
            stream = await self._backend.connect_tcp(host, origin.port, timeout=timeout)
            if origin.scheme == b"https":
                stream = await stream.start_tls(self._tls(), server_hostname=host, timeout=timeout)
        except Exception as exc:
            raise_as_httpx(exc)
        return stream

    def _tls(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context()
        # As httpcore's own connections do: offer HTTP/1.1 only.
        self._ssl_context.set_alpn_protocols(["http/1.1"])
        return self._ssl_context

    async def _give_back(self, connection: UpstreamConnection) -> None:
        if connection.is_idle() and not connection.is_closed():
            self._idle.append(connection)
        else:
            await self._discard(connection)
        # The oldest idle connection is the first to outlive its keep-alive: prune it.
        if len(self._idle) > 1 and self._idle[0].has_expired():
            await self._discard(self._idle.pop(0))
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _discard(self, connection: UpstreamConnection) -> None:
        self._open -= 1
        with contextlib.suppress(Exception):
            await connection.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await self._discard(connection)


class _PooledResponse(UpstreamResponse):
    """The answer on its connection; closing it gives the connection back."""

    def __init__(self, pool: UpstreamPool, response: ConnectionResponse) -> None:
        super().__init__(response.status, response.headers, response.extensions)
        self.head = response.head
        self._pool = pool
        self._response = response
        self._returned = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._response.__aiter__()

    async def aclose(self) -> None:
        if self._returned:
            return
        self._returned = True
        try:
            await self._response.aclose()
        finally:
            await self._pool._give_back(self._response.connection)


class _HttpxBody(httpx.AsyncByteStream):
    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._response.__aiter__()

    async def aclose(self) -> None:
        await self._response.aclose()
