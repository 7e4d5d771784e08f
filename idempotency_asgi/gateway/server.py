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
could.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Any, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .._config import count, positive
from ..problems import Problem
from . import problems
from .options import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_HEADER_BYTES

#: A head ends at its first empty line; h11 accepts bare LF line ends too.
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")

#: After a refusal, how long what the client still sends is read and dropped before the
#: connection closes: closed at once, with bytes unread, it would be reset, and the reset can
#: overtake the answer on its way (nginx calls this a lingering close).
_LINGER_SECONDS = 2.0


def _limits() -> tuple[float, int]:
    """From the environment the command wrote (every worker reads the same)."""
    timeout = os.environ.get("IDEMPOTENCY_GATEWAY_HEADER_TIMEOUT", "")
    size = os.environ.get("IDEMPOTENCY_GATEWAY_MAX_HEADER_BYTES", "")
    return (
        positive(timeout) if timeout else DEFAULT_HEADER_TIMEOUT,
        count(size) if size else DEFAULT_MAX_HEADER_BYTES,
    )


def _raw(problem: Problem) -> bytes:
    headers, body = problem.render()
    lines = [b"HTTP/1.1 %d %s" % (problem.status, problem.title.encode("latin-1"))]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


_MALFORMED = _raw(problems.malformed_request())


class _HeadGuard:
    """The bounds, for a protocol that tells `_in_head()` (the next bytes belong to a head)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    def _guard_start(self) -> None:
        self._head_seconds, self._head_limit = _limits()
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_tail = b""  # the last bytes of a head so far: its end may straddle reads
        self._lingering = False
        self._too_slow = _raw(problems.header_timeout(self._head_seconds))
        self._too_large = _raw(problems.headers_too_large(f"more than {self._head_limit} bytes"))

    def _in_head(self) -> bool:
        raise NotImplementedError

    def _head_timed(self) -> bool:
        """Whether the head's time runs (not while the previous answer is still going out:
        a request pipelined behind it waits its turn)."""
        return self._in_head()

    # The protocol's own callbacks, around its parser's (this class comes first in the MRO).

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._real_transport = cast(asyncio.Transport, transport)
        super().connection_made(_LingeringTransport(self._real_transport, self))  # type: ignore[misc]
        self._guard_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard_disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
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
        """The parser refused the request (uvicorn logged why): a problem, not plain text;
        nothing but a close once a response is under way on the connection."""
        if self.cycle is not None and self.cycle.response_started:
            self._guard_disarm()
            self.transport.close()
        else:
            self._refuse(_MALFORMED)

    def _refuse(self, answer: bytes) -> None:
        self._guard_disarm()
        if self.transport.is_closing() or self._lingering:
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()  # never an answer inside another one
            return
        self._real_transport.write(answer)
        self._linger()

    def _body_unread(self) -> bool:
        """Whether the client may still be sending the current request's body."""
        raise NotImplementedError

    def _linger(self) -> None:
        """Close in stages: the answer goes out, then our end of the connection; what the
        client still sends is read and dropped for `_LINGER_SECONDS` (or until it closes its
        end), so that closing with bytes unread does not reset the connection, and the reset
        overtake the answer."""
        self._guard_disarm()
        self._lingering = True
        transport = self._real_transport
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(_LINGER_SECONDS, transport.close)


class _LingeringTransport:
    """The transport uvicorn's protocol writes to: itself, but a close while the client may
    still be sending a body (an answer that went out before the body was read: a refusal,
    a 413) lingers instead of resetting the connection (see `_HeadGuard._linger`)."""

    def __init__(self, transport: asyncio.Transport, protocol: _HeadGuard) -> None:
        self._transport = transport
        self._protocol = protocol
        # The calls made on every request, bound once.
        self.write = transport.write
        self.get_extra_info = transport.get_extra_info
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        if self._protocol._body_unread():
            self._protocol._linger()
        else:
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
        return self.conn.their_state is h11.SEND_BODY


GatewayProtocol: type[asyncio.Protocol] = GatewayH11Protocol

if importlib.util.find_spec("httptools") is not None:  # pragma: no branch
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GatewayHttpToolsProtocol(_HeadGuard, HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._guard_start()
            self._between_messages = True

        def _in_head(self) -> bool:
            # Unlike h11, uvicorn's httptools protocol goes on parsing what the client
            # pipelines while an answer is under way: such a head is counted too (past the
            # limit the connection closes), or it could grow without bound.
            return self._between_messages

        def _head_timed(self) -> bool:
            return self._between_messages and (self.cycle is None or self.cycle.response_complete)

        def _body_unread(self) -> bool:
            return not self._between_messages

        def send_400_response(self, msg: str) -> None:
            answering = self.cycle is not None and not self.cycle.response_complete
            if self._between_messages and answering:
                # A malformed request pipelined behind one still being answered: the answer
                # on the wire is that one's, so no refusal goes out in its place; closed.
                self._guard_disarm()
                self.transport.close()
            else:
                super().send_400_response(msg)

        def on_headers_complete(self) -> None:
            self._between_messages = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._between_messages = True
            super().on_message_complete()

    GatewayProtocol = GatewayHttpToolsProtocol
