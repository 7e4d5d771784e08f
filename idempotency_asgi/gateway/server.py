"""uvicorn's HTTP/1.1 protocols, with the bounds only a server can set: how long a request's
head may take to arrive (`header_timeout`, from when the connection opens, or from a new
request's first byte) and how large it may grow (`max_header_bytes`) before the ASGI app sees
anything. The `idempotency-asgi gateway` command runs uvicorn with `--http` set to
`GatewayProtocol`: httptools' protocol when httptools is installed, h11's otherwise, as
uvicorn's "auto" chooses.

Without it, uvicorn waits for a head forever (its keep-alive timeout runs only after a
response, and any byte stops it: a head trickled a byte every few seconds is never cut), and
bounds its size under h11 only. Under a server of your own, bound both there (or in nginx in
front, as the tested deployment does); the gateway app refuses a head past
`max_header_bytes` either way, but only once the server has read it.

Both answers are problems written straight to the socket, and the connection is closed:
408 when part of a head arrived too slowly (a connection that sent nothing is just closed),
431 when the head grew too large. So is the parser's own refusal (uvicorn's is plain text):
400 `malformed-request`, which is how httptools refuses a body framed twice before the app
could. A refusal never goes out in place of an answer still owed to an earlier request on
the connection: it waits until that answer is out.

What a client pipelines behind a request still owed its answer: h11 parses it only in its
turn. uvicorn's httptools protocol parsed all of a read at once, making a request (a scope,
its headers, a task later) of every head in it: 256 KiB of small GETs behind a slow POST took
13.5 MiB. Here, as under h11, bytes that arrive behind an owed answer are held as they are
(reading paused, so the kernel holds the rest) and parsed in their turn; within the read
that ends a request, at most `_MAX_PIPELINED` more are parsed, and past that (or past
`_MAX_HELD` bytes held) the connection closes once the answers owed are out.

Closing after an answer sent before the request's body was read (a refusal, a 413) lingers:
the answer, then our end of the connection, then what the client still sends is read and
dropped for a while, so that the kernel does not reset the connection over the answer.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections import deque
from typing import Any, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .._asgi.config import count, positive
from ..problems import Problem
from . import problems
from .options import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CLIENT_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
)
from .target import FRAGMENT

#: A head ends at its first empty line; h11 and httptools accept bare LF line ends too, on
#: the last field's line (`\n\r\n`) or on both (`\n\n`).
_HEAD_ENDS = (b"\r\n\r\n", b"\n\r\n", b"\n\n")

#: Requests parsed behind one still owed its answer (under httptools, which parses all of a
#: read at once), and bytes held unparsed behind it: past either, the connection closes once
#: the answers owed are out.
_MAX_PIPELINED = 16
_MAX_HELD = 64 * 1024

#: Bytes written in one turn of the event loop past which they go out at once.
_COALESCE_BYTES = 64 * 1024

#: After a refusal, how long what the client still sends is read and dropped before the
#: connection closes: closed at once, with bytes unread, it would be reset, and the reset can
#: overtake the answer on its way (nginx calls this a lingering close).
_LINGER_SECONDS = 2.0


def _raw(problem: Problem) -> bytes:
    headers, body = problem.render()
    lines = [b"HTTP/1.1 %d %s" % (problem.status, problem.title.encode("latin-1"))]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


_MALFORMED = _raw(problems.malformed_request())
_FRAGMENT = _raw(problems.cannot_forward(FRAGMENT))


class _Limits:
    """From the environment the command wrote (every worker reads the same), once."""

    def __init__(self) -> None:
        def read(name: str, parse: Any, default: Any) -> Any:
            text = os.environ.get("IDEMPOTENCY_GATEWAY_" + name, "")
            return parse(text) if text else default

        self.head_seconds: float = read("HEADER_TIMEOUT", positive, DEFAULT_HEADER_TIMEOUT)
        self.head_bytes: int = read("MAX_HEADER_BYTES", count, DEFAULT_MAX_HEADER_BYTES)
        self.connections: int = read(
            "MAX_CLIENT_CONNECTIONS", count, DEFAULT_MAX_CLIENT_CONNECTIONS
        )
        self.too_slow = _raw(problems.header_timeout(self.head_seconds))
        self.too_large = _raw(problems.headers_too_large(f"more than {self.head_bytes} bytes"))
        self.too_many = _raw(problems.too_many_connections(self.connections))


_limits: _Limits | None = None


def limits() -> _Limits:
    global _limits
    if _limits is None:
        _limits = _Limits()
    return _limits


class _HeadGuard:
    """The bounds, for a protocol that tells `_in_head()` (the next bytes belong to a head)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    flow: Any
    connections: set[Any]

    def _guard_start(self) -> None:
        bounds = self._bounds = limits()
        self._head_seconds, self._head_limit = bounds.head_seconds, bounds.head_bytes
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_tail = b""  # the last bytes of a head so far: its end may straddle reads
        self._lingering = False
        #: a refusal (or b"": a close) waiting for the answers owed before it
        self._refusal: bytes | None = None
        self._too_slow = bounds.too_slow
        self._too_large = bounds.too_large

    def _in_head(self) -> bool:
        raise NotImplementedError

    def _head_timed(self) -> bool:
        """Whether the head's time runs (not while the previous answer is still going out:
        a request pipelined behind it waits its turn)."""
        return self._in_head()

    # The protocol's own callbacks, around its parser's (this class comes first in the MRO).

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._real_transport = cast(asyncio.Transport, transport)
        self._gateway_transport = _GatewayTransport(self._real_transport, self)
        super().connection_made(self._gateway_transport)  # type: ignore[misc]
        if len(self.connections) > self._bounds.connections:
            # Past the bound on open connections: 503, closed, before anything is read.
            self._refuse(self._bounds.too_many)
            return
        self._guard_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard_disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            # Refused: nothing more is read as a request, nor read at all while the answers
            # owed before the refusal go out (uvicorn resumes reading when its app waits).
            self.flow.pause_reading()
            return
        cycle = self.cycle
        if self._guard_before(data):
            super().data_received(data)  # type: ignore[misc]
            self._guard_after(cycle)

    def _guard_arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._head_seconds, self._head_timed_out)

    def _guard_disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_bytes = 0
        self._head_tail = b""

    def _guard_before(self, data: bytes) -> bool:
        """Count what `data` adds to a head; False (and the connection answered and closed)
        when it grows past the limit, or was refused already."""
        if self._lingering:
            return False
        if not self._in_head():
            return True
        if self._head_timed():
            self._guard_arm()
        self._head_bytes += self._head_part(data)
        if self._head_bytes <= self._head_limit:
            return True
        self._refuse(self._too_large)
        return False

    def _head_part(self, data: bytes) -> int:
        """How many bytes of `data` belong to the head: up to its end, or all of them."""
        seen = self._head_tail + data
        ends = [i + len(end) for end in _HEAD_ENDS if (i := seen.find(end)) >= 0]
        if not ends:
            self._head_tail = seen[-3:]
            return len(data)
        self._head_tail = b""
        return min(ends) - (len(seen) - len(data))

    def _guard_after(self, cycle: Any) -> None:
        if self.cycle is not cycle:
            self._guard_disarm()  # a head was whole: the app has the request

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_bytes:
            self._refuse(self._too_slow)
        elif not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """The parser refused what the client sent (uvicorn logged why): a problem, not
        plain text."""
        self._refuse(_MALFORMED)

    def _refuse(self, answer: bytes) -> None:
        """Answer `answer` and close. For the request whose body is being read, at once when
        it is the one being answered (its application, if it runs, is told the client has
        gone: whatever it answers later is dropped), or by a close alone once its answer has
        begun (never an answer inside another one). For a request queued behind an answer
        still owed (its body is being read, its application has not started), and for a
        request after it, once every answer owed before it is out."""
        self._guard_disarm()
        if self.transport.is_closing() or self._lingering or self._refusal is not None:
            return
        cycle = self.cycle
        if self._body_unread() and cycle is not None and self._dequeue(cycle):
            # Queued behind an answer still owed: it never runs; its refusal goes out after
            # that answer, not in its place.
            cycle.disconnected = True
            cycle.response_complete = True
            self._refusal = answer
            self.flow.pause_reading()
            return
        if self._body_unread() and cycle is not None:
            if cycle.response_started:
                self.transport.close()
                return
            cycle.disconnected = True
            cycle.message_event.set()
        elif self._owed():
            # Pipelined behind an answer still owed: it goes out first, then this one.
            self._refusal = answer
            self.flow.pause_reading()
            return
        self._gateway_transport.write(answer)
        self._linger()

    def _owed(self) -> bool:
        """Whether an answer is still owed to a request read on this connection."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def on_response_complete(self) -> None:
        # The answer is whole: out now, not at the end of the loop's turn (which, under load,
        # comes after every other request's callbacks of that turn).
        self._gateway_transport.flush()
        super().on_response_complete()  # type: ignore[misc]
        refusal = self._refusal
        if refusal is None or self._owed() or self.transport.is_closing():
            return
        self._refusal = None
        if refusal:
            self._gateway_transport.write(refusal)
        self._linger()

    def _body_unread(self) -> bool:
        """Whether the client may still be sending the current request's body."""
        raise NotImplementedError

    def _dequeue(self, cycle: Any) -> bool:
        """Take `cycle` out of the requests waiting for their turn, if it is one of them (its
        application never started): True then."""
        return False

    def _linger(self) -> None:
        """Close in stages: the answer goes out, then our end of the connection; what the
        client still sends is read and dropped for `_LINGER_SECONDS` (or until it closes its
        end), so that closing with bytes unread does not reset the connection, and the reset
        overtake the answer."""
        self._guard_disarm()
        self._lingering = True
        self._gateway_transport.flush()
        transport = self._real_transport
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()  # to drop it: paused, the client's sending would stall
        self.loop.call_later(_LINGER_SECONDS, transport.close)


class _GatewayTransport:
    """The transport uvicorn's protocol writes to: the connection's own, with two changes.

    - A close while the client may still be sending a body (an answer that went out before
      the body was read: a refusal, a 413) lingers instead of resetting the connection (see
      `_HeadGuard._linger`).
    - Writes made in one turn of the event loop go out in one system call: uvicorn writes an
      answer's head and its body apart (two sends on the socket, each a trip through the
      kernel's network stack), and a small answer is both in one turn. What waits is flushed
      when the answer is whole, at the end of the turn, at once past `_COALESCE_BYTES`, and
      before a close.
    """

    def __init__(self, transport: asyncio.Transport, protocol: _HeadGuard) -> None:
        self._transport = transport
        self._protocol = protocol
        self._loop = protocol.loop
        self._waiting: list[bytes] = []
        self._waiting_bytes = 0
        # The calls made on every request, bound once.
        self.get_extra_info = transport.get_extra_info
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._waiting:
            self._loop.call_soon(self.flush)
        self._waiting.append(bytes(data))
        self._waiting_bytes += len(data)
        if self._waiting_bytes >= _COALESCE_BYTES:
            self.flush()  # and the transport's own flow control takes over

    def flush(self) -> None:
        if not self._waiting:
            return
        waiting = self._waiting
        data = waiting[0] if len(waiting) == 1 else b"".join(waiting)
        self._waiting = []
        self._waiting_bytes = 0
        if not self._transport.is_closing():
            self._transport.write(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        if self._protocol._body_unread():
            self._protocol._linger()
        else:
            self.flush()
            self._transport.close()


class GatewayH11Protocol(_HeadGuard, H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard_start()

    def _in_head(self) -> bool:
        # Waiting for a request. (What a client sends while its response is under way is a
        # pipelined request, held by h11 within its own cap until that response is done.)
        return self.conn.their_state is h11.IDLE

    def _body_unread(self) -> bool:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return True
        # A body h11 could not parse: it is in ERROR before uvicorn calls send_400_response.
        # (A head is parsed only once the answer before it is whole, so while an answer is
        # owed, the error is in that request's body.)
        cycle = self.cycle
        return state is h11.ERROR and cycle is not None and not cycle.response_complete


GatewayProtocol: type[asyncio.Protocol] = GatewayH11Protocol

if importlib.util.find_spec("httptools") is not None:  # pragma: no branch
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _TooManyPipelined(Exception):
        """Raised inside httptools' parse to stop it: it parses all it is given at once."""

    class _Fragment(Exception):
        """Raised inside httptools' parse: the target holds a fragment, which httptools would
        drop (h11 keeps it, and the app refuses it there: one answer for both)."""

    class GatewayHttpToolsProtocol(_HeadGuard, HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._guard_start()
            self._between_messages = True
            self._held = b""  # received behind a request still owed its answer, not parsed
            self._cycles: deque[Any] = deque()  # the requests made, oldest first, until answered

        def _in_head(self) -> bool:
            # Unlike h11, uvicorn's httptools protocol parses what the client pipelines while
            # an answer is under way: the bytes of a head are counted from its first one.
            return self._between_messages

        def _head_timed(self) -> bool:
            return self._between_messages and not self._owed()

        def _body_unread(self) -> bool:
            return not self._between_messages

        def _owed(self) -> bool:
            # uvicorn's `cycle` is the newest request's, and those before it wait in
            # `pipeline`; but a refused request taken out of the pipeline is newer than the
            # one being answered, so every request made is kept until it is answered.
            cycles = self._cycles
            while cycles and cycles[0].response_complete:
                cycles.popleft()
            return bool(cycles) or bool(self.pipeline)

        def _dequeue(self, cycle: Any) -> bool:
            for queued in self.pipeline:
                if queued[0] is cycle:
                    self.pipeline.remove(queued)
                    return True
            return False

        def data_received(self, data: bytes) -> None:
            if self._between_messages and self._owed() and self._refusal is None:
                # As h11 does: what comes behind a request still owed its answer is parsed
                # only after that answer (uvicorn would make a request of every head in it
                # at once, each a scope and more: fifty times its size). Held as bytes,
                # with reading paused, so that the kernel holds the rest.
                self._held += data
                self.flow.pause_reading()
                if len(self._held) > max(self._head_limit, _MAX_HELD):
                    self._held = b""
                    self._refusal = b""  # close once the owed answers are out
                return
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._held and not self._owed() and not self.transport.is_closing():
                held, self._held = self._held, b""
                self.data_received(held)

        def on_headers_complete(self) -> None:
            if b"#" in self.url:
                # Refused as a head, with no request made of it (the body, if any, is
                # dropped by the lingering close).
                self._refuse(_FRAGMENT)
                raise _Fragment
            self._between_messages = False
            if len(self.pipeline) >= _MAX_PIPELINED:
                # One read held that many heads behind a request still owed its answer:
                # they are not parsed (the parse stops here), and the connection closes once
                # the answers owed are out; a client that pipelines sends the rest again.
                self._refusal = b""
                raise _TooManyPipelined
            cycle = self.cycle
            super().on_headers_complete()
            if self.cycle is not cycle:
                self._cycles.append(self.cycle)

        def on_message_complete(self) -> None:
            self._between_messages = True
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            if self._lingering or (self._refusal is not None and self._refusal != b""):
                return  # refused already (a fragment), and answered or waiting its turn
            if self._refusal == b"":
                self.flow.pause_reading()
                return  # stopped on purpose (_TooManyPipelined), not a malformed request
            super().send_400_response(msg)

    GatewayProtocol = GatewayHttpToolsProtocol
