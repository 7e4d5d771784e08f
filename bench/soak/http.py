"""A lean HTTP/1.1 client for the soak: one keep-alive connection, one request at a time.

httpx costs a few hundred microseconds of Python per request; this costs a few tens, which
matters when the client shares two cores with four server workers and PostgreSQL. It speaks
just enough HTTP for the answers the payments API gives: a status line, headers, and a body
of `Content-Length` bytes (no chunked bodies, no pipelining, no redirects). Anything else is a
`ProtocolError`, which the soak counts as a request without an answer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import cast


class ProtocolError(Exception):
    """The server answered something this client does not read, or closed mid-answer."""


@dataclass(slots=True)
class Reply:
    status: int
    #: lower-case header names to values, the ones the soak reads (see `_WANTED`)
    headers: dict[bytes, bytes]
    body: bytes
    #: seconds from the write to the last byte of the body
    latency: float


# Headers the soak reads; every other header is skipped while parsing.
_WANTED = frozenset({b"idempotent-replayed", b"retry-after", b"content-type", b"connection"})


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._waiter: asyncio.Future[Reply] | None = None
        self._sent_at = 0.0
        self._head: tuple[int, dict[bytes, bytes], int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, but behave as one.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(
                ProtocolError(f"connection closed before the answer was complete ({exc})")
            )

    def send(self, request: bytes) -> asyncio.Future[Reply]:
        assert self.transport is not None
        if self._waiter is not None and not self._waiter.done():
            raise RuntimeError("one request at a time on a connection")
        self._waiter = asyncio.get_running_loop().create_future()
        self._buffer.clear()
        self._head = None
        self._sent_at = time.perf_counter()
        self.transport.write(request)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        waiter = self._waiter
        if waiter is None or waiter.done():
            if self._buffer:
                self._fail(ProtocolError(f"unsolicited bytes: {bytes(self._buffer[:80])!r}"))
            return
        try:
            if self._head is None:
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._head = _parse_head(bytes(self._buffer[:end]))
                del self._buffer[: end + 4]
            status, headers, length = self._head
            if len(self._buffer) < length:
                return
            if len(self._buffer) > length:
                raise ProtocolError("more bytes than Content-Length")
            body = bytes(self._buffer)
        except ProtocolError as exc:
            self._fail(exc)
            return
        self._buffer.clear()
        self._head = None
        waiter.set_result(Reply(status, headers, body, time.perf_counter() - self._sent_at))
        if headers.get(b"connection", b"").lower() == b"close" and self.transport is not None:
            self.transport.close()

    def _fail(self, exc: ProtocolError) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


def _parse_head(head: bytes) -> tuple[int, dict[bytes, bytes], int]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"bad status line {lines[0][:80]!r}")
    headers: dict[bytes, bytes] = {}
    length = -1
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ProtocolError(f"bad header line {line[:80]!r}")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip())
        elif name == b"transfer-encoding":
            raise ProtocolError("chunked answers are not read by this client")
        elif name in _WANTED:
            headers[name] = value.strip()
    if length < 0:
        raise ProtocolError("no Content-Length")
    return int(parts[1]), headers, length


class Connection:
    """One keep-alive connection to host:port, reopened when the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._protocol: _Protocol | None = None
        self.opened = 0

    async def _ensure(self) -> _Protocol:
        if self._protocol is None or self._protocol.closed:
            loop = asyncio.get_running_loop()
            _, protocol = await loop.create_connection(_Protocol, self._host, self._port)
            self._protocol = protocol
            self.opened += 1
        return self._protocol

    async def ready(self) -> None:
        """Open the connection now, so that a later `send` writes at once."""
        await self._ensure()

    def send_now(self, request: bytes) -> asyncio.Future[Reply]:
        """Write the request at once on an open connection (see `ready`); the future is
        its answer. Several connections' `send_now` in a row put the requests on the wire
        within microseconds of each other: the soak's concurrent duplicates."""
        if self._protocol is None or self._protocol.closed:
            raise RuntimeError("send_now on a connection that is not open: await ready()")
        return self._protocol.send(request)

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()


def post(host: str, path: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """The bytes of one POST with a body of `Content-Length` bytes."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
