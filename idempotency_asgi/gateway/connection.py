"""One keep-alive HTTP/1.1 connection to the upstream: a request written, its answer read.

The gateway talks to one upstream, one request at a time per connection, and needs to know
more about each answer than a general HTTP client says: how its body is framed (see
`answers.py`), whether bytes came after it, whether its fields can be written on. So it
speaks HTTP/1.1 itself, on the sockets of `backend.py`:

- the request goes out as one write when its body is in hand (head and body together), or
  head first and then its body from an iterator, with a `Content-Length` or in chunks as the
  request's headers say;
- the answer's head is read whole (at most `MAX_HEAD_BYTES`), interim answers (100, 103)
  skipped, and checked; its body is read by its framing and handed on as it arrives;
- after a body's end, the connection is looked at: bytes past the end (read with the answer,
  or waiting on the socket) are `LeftoverBytes`, and such a connection is never reused;
- a connection is reused only after an answer that was read to its end, framed by a length
  or chunks, from an HTTP/1.1 upstream that did not say `Connection: close`.

Failures are httpx's exceptions: WriteError and WriteTimeout while the request goes out,
ReadError, ReadTimeout and RemoteProtocolError (MalformedAnswer among them) while the answer
comes back, LocalProtocolError for a request that cannot be written (nothing was sent).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, NoReturn

import httpcore
import httpx

from .answers import CONTROL, Head, is_token, parse_head
from .backend import AsyncioStream
from .chunks import MAX_LINE, ChunkedDecoder
from .upstream import Headers, LeftoverBytes, MalformedAnswer, Timeouts, UpstreamResponse

#: The longest answer head read (nginx's proxy_buffer_size is 4 or 8 KiB; Node's own
#: limit on what it sends is 16 KiB).
MAX_HEAD_BYTES = 64 * 1024

#: Interim answers (100 Continue, 103 Early Hints) skipped before the final one, at most.
MAX_INTERIM = 8

#: The longest trailer section read.
_MAX_TRAILERS = 16 * 1024

#: The most read from the socket at once while the body's length allows it.
_READ_SIZE = 256 * 1024

_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.TimeoutException, httpx.TimeoutException),
)


def raise_as_httpx(exc: Exception) -> NoReturn:
    """Raise httpx's counterpart of one of httpcore's exceptions, anything else as it is."""
    for core, mapped in _ERRORS:
        if isinstance(exc, core):
            raise mapped(str(exc)) from exc
    raise exc


class UpstreamConnection:
    """Idle, busy with one exchange, or closed; built on a connected stream."""

    def __init__(self, stream: AsyncioStream, *, keepalive_expiry: float) -> None:
        self.stream = self._stream = stream
        self._expiry = keepalive_expiry
        self._loop = asyncio.get_running_loop()
        self._buffer = b""  # read from the socket, not yet parsed
        self._busy = False
        self._closed = False
        self._idle_since = self._loop.time()

    # -- state -------------------------------------------------------------------------------

    def is_idle(self) -> bool:
        return not self._busy and not self._closed

    def is_closed(self) -> bool:
        return self._closed

    def has_expired(self) -> bool:
        """Idle past the keep-alive expiry, or seen closed (or sending) by the upstream."""
        if self._loop.time() - self._idle_since >= self._expiry:
            return True
        return bool(self._buffer) or bool(self._stream.get_extra_info("is_readable"))

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._buffer = b""
            await self._stream.aclose()

    # -- an exchange -----------------------------------------------------------------------

    async def send(
        self,
        method: bytes,
        target: bytes,
        headers: Headers,
        content: bytes | AsyncIterable[bytes],
        timeouts: Timeouts,
    ) -> ConnectionResponse:
        """Write the request and read its answer's head. The connection is busy until the
        response's body is read to its end (then idle again, or closed) or it is closed."""
        assert not self._busy and not self._closed, "one exchange at a time"
        head = _request_head(method, target, headers)  # LocalProtocolError: nothing sent
        self._busy = True
        read_timeout = timeouts.get("read")
        write_timeout = timeouts.get("write")
        try:
            if isinstance(content, bytes):
                await self._write(head + content, write_timeout)
            else:
                await self._write(head, write_timeout)
                try:
                    await self._write_body(content, _chunked(headers), write_timeout)
                except httpx.WriteError:
                    # The upstream may have answered without reading all of it (a 413),
                    # and closed: its answer is worth more than the error.
                    answer = await self._early_answer(method, read_timeout)
                    if answer is None:
                        raise
                    return answer
            return await self._answer(method, read_timeout)
        except BaseException:
            await self.aclose()
            raise

    async def _early_answer(
        self, method: bytes, read_timeout: float | None
    ) -> ConnectionResponse | None:
        try:
            answer = await self._answer(method, read_timeout)
        except httpx.TransportError:
            return None
        answer.head.keep_alive = False
        return answer

    async def _answer(self, method: bytes, read_timeout: float | None) -> ConnectionResponse:
        head_request = method == b"HEAD"
        for _ in range(MAX_INTERIM + 1):
            head = parse_head(await self._read_head(read_timeout), head_request=head_request)
            if not head.interim:
                return ConnectionResponse(self, head, read_timeout)
        raise MalformedAnswer(f"more than {MAX_INTERIM} interim answers")

    async def _write(self, data: bytes, timeout: float | None) -> None:
        try:
            await self._stream.write(data, timeout)
        except Exception as exc:
            raise_as_httpx(exc)

    async def _write_body(
        self, content: AsyncIterable[bytes], chunked: bool, timeout: float | None
    ) -> None:
        async for part in content:
            if not part:
                continue
            await self._write(b"%x\r\n%b\r\n" % (len(part), part) if chunked else part, timeout)
        if chunked:
            await self._write(b"0\r\n\r\n", timeout)

    async def _read(self, timeout: float | None) -> bytes:
        try:
            return await self._stream.read(_READ_SIZE, timeout)
        except Exception as exc:
            raise_as_httpx(exc)

    async def _read_head(self, timeout: float | None) -> bytes:
        buffer = self._buffer
        searched = 0
        while True:
            end = buffer.find(b"\n", searched)
            while end >= 0:
                # The head ends at an empty line: "\n\n" or "\n\r\n".
                after = buffer[end + 1 : end + 3]
                if after[:1] == b"\n" or after == b"\r\n":
                    if end > MAX_HEAD_BYTES:
                        # Whole, but past the bound: as if its end had not come in time.
                        raise MalformedAnswer(f"an answer head of more than {MAX_HEAD_BYTES} bytes")
                    stop = end + (2 if after[:1] == b"\n" else 3)
                    self._buffer = buffer[stop:]
                    return buffer[:end]
                end = buffer.find(b"\n", end + 1)
            searched = max(0, len(buffer) - 2)
            if len(buffer) > MAX_HEAD_BYTES:
                raise MalformedAnswer(f"an answer head of more than {MAX_HEAD_BYTES} bytes")
            data = await self._read(timeout)
            if not data:
                if buffer:
                    raise MalformedAnswer("the upstream closed the connection inside a head")
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            buffer += data

    # -- the body ----------------------------------------------------------------------------

    async def body(self, head: Head, read_timeout: float | None) -> AsyncIterator[bytes]:
        framing = head.framing
        if framing == "length":
            assert head.length is not None
            async for part in self._by_length(head.length, read_timeout):
                yield part
        elif framing == "chunked":
            async for part in self._by_chunks(read_timeout):
                yield part
        elif framing == "close":
            if self._buffer:
                yield self._buffer
                self._buffer = b""
            while data := await self._read(read_timeout):
                yield data
        await self._ended(head)

    async def _by_length(self, length: int, read_timeout: float | None) -> AsyncIterator[bytes]:
        remaining = length
        if self._buffer and remaining:
            part, self._buffer = self._buffer[:remaining], self._buffer[remaining:]
            remaining -= len(part)
            yield part
        while remaining:
            data = await self._read(read_timeout)
            if not data:
                raise httpx.RemoteProtocolError(
                    f"the upstream closed the connection {remaining} bytes short of the "
                    f"{length} it declared"
                )
            if len(data) > remaining:
                data, self._buffer = data[:remaining], data[remaining:]
            remaining -= len(data)
            yield data

    async def _by_chunks(self, read_timeout: float | None) -> AsyncIterator[bytes]:
        """Each read's share of the body as one part, decoded in one pass (`chunks.py`); in
        several, when its chunks are ones decoded one by one (each feed of the decoder then
        does a bounded share of the read, see `chunks.ONE_BY_ONE`)."""
        decoder = ChunkedDecoder()
        data, self._buffer = self._buffer, b""
        while True:
            if data:
                part, data = decoder.feed(data)
                if part:
                    yield part
                if decoder.ended:
                    self._buffer = data  # what follows the last chunk: its trailers
                    break
                if decoder.paused:
                    continue  # more of this read, once the pump had its say (relay.py)
            more = await self._read(read_timeout)
            if not more:
                raise httpx.RemoteProtocolError("the upstream closed the connection mid-body")
            # What was left is at most an unfinished line: joining it to the next read costs
            # that read's copy once, not a copy per chunk.
            data = data + more if data else more
        trailers = 0
        while line := await self._line(read_timeout, MAX_LINE):
            trailers += len(line)
            if trailers > _MAX_TRAILERS:
                raise MalformedAnswer("a trailer section past its bound")

    async def _line(self, read_timeout: float | None, limit: int) -> bytes:
        """The next line (without its CRLF or LF); MalformedAnswer past `limit` bytes."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line, self._buffer = self._buffer[:end], self._buffer[end + 1 :]
                return line.removesuffix(b"\r")
            if len(self._buffer) > limit:
                raise MalformedAnswer("a line of the chunked body past its bound")
            data = await self._read(read_timeout)
            if not data:
                raise httpx.RemoteProtocolError("the upstream closed the connection mid-body")
            self._buffer += data

    async def _ended(self, head: Head) -> None:
        """The body is whole: bytes past it mean the connection is not to be trusted."""
        if head.framing != "close" and self._leftover():
            await self.aclose()
            raise LeftoverBytes("the upstream sent bytes after its whole response")
        if head.keep_alive and head.framing != "close":
            self._busy = False
            self._idle_since = self._loop.time()
        else:
            await self.aclose()

    def _leftover(self) -> bool:
        return bool(self._buffer) or self._stream.has_leftover()


class ConnectionResponse(UpstreamResponse):
    """An answer on its connection: iterate it for the body (once)."""

    def __init__(
        self, connection: UpstreamConnection, head: Head, read_timeout: float | None
    ) -> None:
        version = b"HTTP/1.0" if head.http10 else b"HTTP/1.1"
        extensions: dict[str, Any] = {
            "http_version": version,
            "reason_phrase": head.reason,
            "network_stream": connection.stream,
        }
        super().__init__(head.status, head.headers, extensions)
        self.head = head
        self.connection = connection
        self._read_timeout = read_timeout

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.connection.body(self.head, self._read_timeout)

    async def aclose(self) -> None:
        """Done with it: a connection whose answer was not read to its end is closed."""
        if not self.connection.is_idle():
            await self.connection.aclose()


def _chunked(headers: Headers) -> bool:
    return any(name.lower() == b"transfer-encoding" for name, _ in headers)


def _request_head(method: bytes, target: bytes, headers: Headers) -> bytes:
    """The request line and fields as they go on the wire; LocalProtocolError for one that
    could not be read back as it was meant (nothing is sent then)."""
    if not is_token(method):
        raise httpx.LocalProtocolError(f"the method {method!r} is not a token")
    lines = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        if not is_token(name):
            raise httpx.LocalProtocolError(f"the header name {name!r} is not a token")
        if CONTROL.search(value) is not None:
            raise httpx.LocalProtocolError(f"a control character in the value of {name!r}")
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)
