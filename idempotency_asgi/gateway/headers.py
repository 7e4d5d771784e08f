"""Headers across the gateway: hop-by-hop headers dropped both ways, X-Forwarded-* set.

Hop-by-hop headers describe one connection (RFC 9110 section 7.6.1): the gateway's connection
to the upstream is another one, so they are dropped both ways, together with every header the
Connection header names and every `Proxy-*` header (each is about one proxy hop: credentials
for a proxy, its challenge, its connection; none is the upstream's or the client's business).
Everything else is end to end and passes unchanged, in order, repeated headers included. ASGI
gives and takes header names in lowercase; values are never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from .._asgi.config import DEFAULT_REPLAY_HEADERS
from .._asgi.keys import HEADER as KEY_HEADER
from .._asgi.keys import InvalidKey, read_key

Headers = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)


def gateways_own(
    replay_headers: Iterable[str], omitted_replay_header: str | None = None
) -> frozenset[bytes]:
    """Response headers only the gateway (its middleware) says: the replay headers it is
    configured with (`replay_headers`, and `omitted_replay_header` when set) and
    `Idempotency-Key-Expires`. An upstream's own would make a first run look like a replay,
    and a replay carry two of each."""
    names = [name.lower().encode("latin-1") for name in replay_headers]
    if omitted_replay_header:
        names.append(omitted_replay_header.lower().encode("latin-1"))
    return frozenset({b"idempotency-key-expires", *names})


#: The gateway's own response headers with the default `replay_headers`.
GATEWAYS_OWN = gateways_own(DEFAULT_REPLAY_HEADERS)

#: Every header named so is hop-by-hop too (Proxy-Authorization, Proxy-Authenticate,
#: Proxy-Connection, Proxy-Authentication-Info...).
_PROXY = b"proxy-"

#: Request headers the gateway answers itself instead of passing on: the server in front of
#: it already honoured `Expect: 100-continue` when the body was read.
_REQUEST_ONLY = frozenset({b"expect"})

#: Forwarding headers a proxy in front would set, and a client could claim: dropped unless
#: `trust_forwarded` (the gateway sets X-Forwarded-For, -Proto and -Host itself).
_CLAIMED_FORWARDING = frozenset(
    {b"forwarded", b"x-real-ip", b"x-forwarded-port", b"x-forwarded-prefix"}
)

_FORWARDED_FOR = b"x-forwarded-for"
_FORWARDED_PROTO = b"x-forwarded-proto"
_FORWARDED_HOST = b"x-forwarded-host"


def connection_named(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names listed in Connection headers (lowercased): hop-by-hop as well."""
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    named.discard(b"")
    return frozenset(named)


def request_headers(
    headers: Iterable[tuple[bytes, bytes]],
    *,
    client: tuple[str, int] | None,
    scheme: str,
    preserve_host: bool,
    trust_forwarded: bool,
) -> Headers:
    """What the upstream receives: the client's end-to-end headers, nothing added but
    X-Forwarded-For (the client's address appended to any earlier hops), X-Forwarded-Proto
    and X-Forwarded-Host.

    Host: by default the upstream's own (the transport sets it from the upstream URL), as most
    reverse proxies do; with `preserve_host` the client's. X-Forwarded-Proto and -Host are the
    gateway's own observation unless `trust_forwarded` (a proxy in front that sets them);
    Forwarded, X-Real-IP, X-Forwarded-Port and X-Forwarded-Prefix are dropped unless
    `trust_forwarded`, since only a proxy in front may say them."""
    received = list(headers)
    dropped = HOP_BY_HOP | _REQUEST_ONLY | connection_named(received)
    if not trust_forwarded:
        dropped |= _CLAIMED_FORWARDING
    out: Headers = []
    host = forwarded_for = forwarded_proto = forwarded_host = None
    for name, value in received:
        if name in dropped or name.startswith(_PROXY):
            continue
        if name == KEY_HEADER and value[:1] == b'"':
            # The key as the gateway reads it: "abc" and abc are one key, and an upstream
            # that dedupes on the header must see one too.
            with contextlib.suppress(InvalidKey):
                value = (read_key([(name, value)]) or "").encode("ascii") or value
            out.append((name, value))
        elif name == b"host":
            host = value
        elif name == _FORWARDED_FOR:
            forwarded_for = value if forwarded_for is None else forwarded_for + b", " + value
        elif name == _FORWARDED_PROTO:
            forwarded_proto = value
        elif name == _FORWARDED_HOST:
            forwarded_host = value
        else:
            out.append((name, value))
    if preserve_host and host is not None:
        out.append((b"host", host))
    if client is not None:
        address = client[0].encode("latin-1")
        forwarded_for = address if forwarded_for is None else forwarded_for + b", " + address
    if forwarded_for is not None:
        out.append((_FORWARDED_FOR, forwarded_for))
    if not trust_forwarded or forwarded_proto is None:
        forwarded_proto = scheme.encode("latin-1")
    out.append((_FORWARDED_PROTO, forwarded_proto))
    if not trust_forwarded or forwarded_host is None:
        forwarded_host = host
    if forwarded_host is not None:
        out.append((_FORWARDED_HOST, forwarded_host))
    return out


def response_headers(
    raw: Iterable[tuple[bytes, bytes]], own: frozenset[bytes] = GATEWAYS_OWN
) -> Headers:
    """What the client receives: the upstream's end-to-end headers, byte for byte (names in
    lowercase, as ASGI wants them), in their order, repeated ones included. A Content-Length
    that came with a Transfer-Encoding is dropped: the transfer coding framed the body, and the
    length is wrong (RFC 9112, section 6.3). The gateway's own headers (`own`: see
    `gateways_own`) are dropped: only the gateway says those."""
    received = [(name.lower(), value) for name, value in raw]
    dropped = HOP_BY_HOP | own | connection_named(received)
    if any(name == b"transfer-encoding" for name, _ in received):
        dropped |= {b"content-length"}
    return [
        (name, value)
        for name, value in received
        if name not in dropped and not name.startswith(_PROXY)
    ]


def framed(headers: Headers, *, method: str, length: int | None, host: bytes) -> Headers:
    """The request headers with what an HTTP client adds when none were sent: `Host` (the
    upstream's) and `Content-Length: 0` for a POST, PUT or PATCH without a body, in front;
    `Content-Length` for a body of known `length`, or `Transfer-Encoding: chunked` for one
    that streams (`length` None), at the end. A Content-Length the client sent is the body's
    (the server framed the body by it)."""
    has_host = has_length = has_chunked = False
    for name, _ in headers:
        lowered = name.lower()
        if lowered == b"host":
            has_host = True
        elif lowered == b"content-length":
            has_length = True
        elif lowered == b"transfer-encoding":
            has_chunked = True
    if length is None:
        if not has_length and not has_chunked:
            headers.append((b"Transfer-Encoding", b"chunked"))
            has_chunked = True
    elif length and not has_length:
        headers.append((b"Content-Length", str(length).encode("ascii")))
        has_length = True
    if has_host and (has_length or has_chunked or method not in _EMPTY_BODY_LENGTH):
        return headers
    front = [] if has_host else [(b"Host", host)]
    if not has_length and not has_chunked and method in _EMPTY_BODY_LENGTH:
        front.append((b"Content-Length", b"0"))
    return front + headers


#: Methods that httpx sends a `Content-Length: 0` for when they have no body.
_EMPTY_BODY_LENGTH = frozenset({"POST", "PUT", "PATCH"})
