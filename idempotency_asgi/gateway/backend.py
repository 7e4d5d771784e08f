"""httpcore's network layer on plain asyncio: a Protocol with a buffer, no anyio.

httpcore's default backend runs on anyio, which opens a cancel scope (a context manager, a
deadline, checkpoints) around every read and every write, and pauses and resumes the socket
around every read that waits: in the benchmark's profile that machinery was about a quarter of
the gateway's CPU time on a pass-through request. This backend does the same job with what
asyncio offers directly:

- reads take from a buffer the protocol fills; a read waits (on a future, with a timer only
  while it waits and only when a timeout is set) when the buffer is empty, and the transport
  stops reading while more than `_HIGH_WATER` bytes are buffered and unread, so that a large
  body streams in constant memory;
- a write hands the bytes to the transport and, as anyio's does, returns once the kernel has
  taken them all (the transport's write buffer limit is 0): usually at once;
- connecting and TLS (`start_tls`) are the event loop's own calls, under `wait_for`; a host
  name with several addresses is tried one address after the other (anyio raced them), all
  within the connect timeout;
- closing aborts the transport, as anyio's streams do.

Failures are httpcore's exceptions, as from httpcore's own backends, so that what they mean
stays the same: ConnectError and ConnectTimeout while connecting (nothing was sent); ReadError,
ReadTimeout, WriteError and WriteTimeout afterwards. A read at the end of the stream returns
b"", as httpcore expects.
"""

from __future__ import annotations

import asyncio
import collections
import os
import select
import socket
import ssl
from collections.abc import Iterable
from typing import Any, cast

import httpcore

#: Stop reading from the socket while more than this is buffered and unread.
_HIGH_WATER = 256 * 1024


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> AsyncioStream:
        loop = asyncio.get_running_loop()
        connecting = loop.create_connection(
            _Buffer, host, port, local_addr=(local_address, 0) if local_address else None
        )
        try:
            transport, buffer = await asyncio.wait_for(connecting, timeout)
        except asyncio.TimeoutError:
            raise httpcore.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc) or repr(exc)) from exc
        sock = transport.get_extra_info("socket")
        # Both asyncio and uvloop set it already; a request must never wait for Nagle.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in socket_options or ():
            sock.setsockopt(*option)
        return AsyncioStream(transport, buffer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, transport: asyncio.Transport, buffer: _Buffer) -> None:
        self._transport = transport
        self._buffer = buffer
        self._closed = False
        self._poll: select.poll | None = None
        # As anyio's streams: a write is done when the kernel has taken every byte of it.
        transport.set_write_buffer_limits(0)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        buffer = self._buffer
        deadline = None
        while not buffer.chunks:
            if self._closed:
                raise httpcore.ReadError("the connection was closed")
            if buffer.error is not None:
                raise httpcore.ReadError(_describe(buffer.error)) from buffer.error
            if buffer.eof or buffer.lost:
                return b""
            if timeout is not None and deadline is None:
                deadline = buffer.loop.time() + timeout
            if not await buffer.wait(deadline):
                raise httpcore.ReadTimeout(f"nothing to read for {timeout:g} s")
        return buffer.take(max_bytes)

    async def write(self, data: bytes, timeout: float | None = None) -> None:
        if not data:
            return
        buffer = self._buffer
        if self._closed or buffer.lost or self._transport.is_closing():
            raise httpcore.WriteError(_describe(buffer.error) if buffer.error else "closed")
        self._transport.write(data)
        deadline = None
        while buffer.writing_paused:
            if buffer.lost:
                raise httpcore.WriteError(_describe(buffer.error) if buffer.error else "closed")
            if timeout is not None and deadline is None:
                deadline = buffer.loop.time() + timeout
            if not await buffer.wait(deadline):
                raise httpcore.WriteTimeout(f"could not write for {timeout:g} s")

    async def aclose(self) -> None:
        self._closed = True
        self._transport.abort()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> AsyncioStream:
        loop = self._buffer.loop
        starting = loop.start_tls(
            self._transport, self._buffer, ssl_context, server_hostname=server_hostname
        )
        try:
            transport = await asyncio.wait_for(starting, timeout)
        except asyncio.TimeoutError:
            await self.aclose()
            raise httpcore.ConnectTimeout("the TLS handshake timed out") from None
        except OSError as exc:  # ssl.SSLError included
            await self.aclose()
            raise httpcore.ConnectError(_describe(exc)) from exc
        self._buffer.transport = cast(asyncio.Transport, transport)
        return AsyncioStream(self._buffer.transport, self._buffer)

    def has_leftover(self) -> bool:
        """Whether bytes arrived that nobody has read: after a whole response, they are data
        the upstream should not have sent (a body on a HEAD or a 204, a short Content-Length,
        a second response). An end of stream is not data; under TLS only what was decrypted
        is seen here (a close_notify or a late record shows as readable at the next use)."""
        buffer = self._buffer
        if buffer.chunks:
            return True
        if buffer.eof or buffer.lost or self._closed or self._transport.is_closing():
            # Ended (a body that ends at the close ends so): nothing more can arrive, and
            # the socket may be gone already.
            return False
        if self._transport.get_extra_info("sslcontext") is not None or not self._kernel_readable():
            return False
        # Readable: data, or the upstream's FIN. Only a peek tells which.
        fd = self._transport.get_extra_info("socket").fileno()
        try:
            with socket.socket(fileno=os.dup(fd)) as peek:
                return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:
            # Nothing after all, or a reset: either way the next use finds out.
            return False

    def _kernel_readable(self) -> bool:
        if self._poll is None:
            fd = self._transport.get_extra_info("socket").fileno()
            if not hasattr(select, "poll"):  # Windows
                return bool(select.select([fd], [], [], 0)[0])
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)
        return bool(self._poll.poll(0))

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            # On an idle connection, only a close (or a protocol error) can be readable: what
            # the event loop delivered already, or what the kernel holds that it has not read
            # yet (the loop may not have polled since the upstream closed).
            buffer = self._buffer
            return bool(buffer.chunks) or buffer.eof or buffer.lost or self._kernel_readable()
        name = {"client_addr": "sockname", "server_addr": "peername"}.get(info, info)
        if name in ("ssl_object", "sockname", "peername", "socket"):
            return self._transport.get_extra_info(name)
        return None


class _Buffer(asyncio.Protocol):
    """What arrived on the connection and was not read yet, and how the connection ended."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.eof = False
        self.lost = False
        self.error: Exception | None = None
        self.reading_paused = False
        self.writing_paused = False
        self._waiter: asyncio.Future[bool] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without deriving from it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > _HIGH_WATER and not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> None:
        # The server has finished: returning None lets the transport close.
        self.eof = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.error = exc
        self._wake()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(True)

    async def wait(self, deadline: float | None) -> bool:
        """Wait for the next event on the connection: False if the deadline came first."""
        waiter: asyncio.Future[bool] = self.loop.create_future()
        self._waiter = waiter
        if deadline is None:
            return await waiter
        timer = self.loop.call_at(deadline, _expire, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()

    def take(self, max_bytes: int) -> bytes:
        chunk = self.chunks.popleft()
        if len(chunk) > max_bytes:
            self.chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        self.size -= len(chunk)
        if self.reading_paused and self.size <= _HIGH_WATER and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        return chunk


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


def _describe(exc: BaseException) -> str:
    return str(exc) or repr(exc)
