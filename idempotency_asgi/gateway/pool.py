"""Keep-alive connections to the one upstream, as an httpx transport.

httpx's own transport (httpcore's pool) serves any number of origins and, on every request,
walks all of its connections, checking each idle one for a server-side close with a poll()
system call: with 32 connections busy that walk was half of the gateway's CPU time in the
benchmark's profile. One upstream needs much less: a stack of idle connections (the most
recently used on top, the least likely to have been closed by the upstream's idle timeout),
and a count of open ones. Each request checks only the connection it takes; each return
checks only the oldest idle one, so unused connections still close after `keepalive_expiry`.

The connections themselves are httpcore's HTTP/1.1 connections (the engine under httpx), on
sockets from `backend.AsyncioBackend` (plain asyncio rather than anyio); the pool dials them
itself (TCP, then TLS for https), so a failure there is a connect failure: nothing was sent.
Failures surface as httpx's exceptions, so the proxy works with this transport or any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator

import httpcore
import httpx

from .backend import AsyncioBackend

_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.TimeoutException, httpx.TimeoutException),
)


@contextlib.contextmanager
def _as_httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for core, mapped in _ERRORS:
            if isinstance(exc, core):
                raise mapped(str(exc)) from exc
        raise


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
        self._idle: list[httpcore.AsyncHTTP11Connection] = []
        self._open = 0  # connections in use or idle
        self._freed: asyncio.Condition | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        url = request.url
        origin = httpcore.Origin(url.raw_scheme, url.raw_host, url.port or _PORTS[url.scheme])
        connection = await self._connection(origin, timeouts)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            with _as_httpx_errors():
                response = await connection.handle_async_request(core_request)
        except BaseException:
            await self._give_back(connection)
            raise
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Body(self, connection, response.stream),  # type: ignore[arg-type]
            extensions=response.extensions,
        )

    async def _connection(
        self, origin: httpcore.Origin, timeouts: dict[str, float | None]
    ) -> httpcore.AsyncHTTP11Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.has_expired() and connection.is_idle():
                return connection
            await self._discard(connection)
        if self._open >= self._max:
            if self._freed is None:
                self._freed = asyncio.Condition()
            async with self._freed:
                try:
                    await asyncio.wait_for(
                        self._freed.wait_for(lambda: self._idle or self._open < self._max),
                        timeouts.get("pool"),
                    )
                except asyncio.TimeoutError:
                    raise httpx.PoolTimeout("no free connection to the upstream") from None
            return await self._connection(origin, timeouts)
        self._open += 1
        try:
            stream = await self._connect(origin, timeouts.get("connect"))
        except BaseException:
            self._open -= 1
            await self._notify()
            raise
        return httpcore.AsyncHTTP11Connection(origin, stream, keepalive_expiry=self._expiry)

    async def _connect(
        self, origin: httpcore.Origin, timeout: float | None
    ) -> httpcore.AsyncNetworkStream:
        host = origin.host.decode("ascii")
        with _as_httpx_errors():
            stream = await self._backend.connect_tcp(host, origin.port, timeout=timeout)
            if origin.scheme == b"https":
                stream = await stream.start_tls(self._tls(), server_hostname=host, timeout=timeout)
        return stream

    def _tls(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context()
        # As httpcore's own connections do: offer HTTP/1.1 only.
        self._ssl_context.set_alpn_protocols(["http/1.1"])
        return self._ssl_context

    async def _give_back(self, connection: httpcore.AsyncHTTP11Connection) -> None:
        if connection.is_idle() and not connection.is_closed():
            self._idle.append(connection)
        else:
            await self._discard(connection)
        # The oldest idle connection is the first to outlive its keep-alive: prune it.
        if len(self._idle) > 1 and self._idle[0].has_expired():
            await self._discard(self._idle.pop(0))
        await self._notify()

    async def _notify(self) -> None:
        if self._freed is not None:
            async with self._freed:
                self._freed.notify()

    async def _discard(self, connection: httpcore.AsyncHTTP11Connection) -> None:
        self._open -= 1
        with contextlib.suppress(Exception):
            await connection.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await self._discard(connection)


_PORTS = {"http": 80, "https": 443}


class _Body(httpx.AsyncByteStream):
    """The response body; the connection goes back to the pool when it is closed."""

    def __init__(
        self,
        pool: UpstreamPool,
        connection: httpcore.AsyncHTTP11Connection,
        stream: AsyncIterator[bytes],
    ) -> None:
        self._pool = pool
        self._connection = connection
        self._stream = stream
        self._returned = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors():
            async for chunk in self._stream:
                yield chunk

    async def aclose(self) -> None:
        if self._returned:
            return
        self._returned = True
        try:
            with _as_httpx_errors():
                await self._stream.aclose()  # type: ignore[attr-defined]
        finally:
            await self._pool._give_back(self._connection)
