"""The upstream's URL, parsed once, and the request target each request is sent to.

The request target is passed on as the client sent it: the upstream's path prefix, then the
client's raw path, then `?` and the raw query when there is one. Nothing is normalized or
re-escaped (an upstream may give meaning to any byte of it, and a proxy that rewrites targets
makes the upstream see another request than the one the gateway checked); only bytes that
cannot go on the wire as they are (outside visible ASCII) are percent-encoded. A path with a
dot segment never gets this far (see `has_dot_segment`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import quote_from_bytes, unquote_to_bytes

import httpcore
import httpx
from starlette.types import Scope

#: What a request target may hold on the wire (RFC 9112's request-target is visible ASCII).
_VISIBLE_ASCII = bytes(range(0x21, 0x7F))

#: Times a path is percent-decoded when it is read the most ways at once: once, as a server
#: that decodes it does (nginx decodes `%2F` and resolves `..` across it; `%2E`, `%5C` and
#: `%3B` are `.`, `\\` and `;` to others), and again, as a chain of servers that decode one
#: after the other does (`%252e` and `%25%32%65` are each `%2e` once, `.` twice).
_DECODINGS = 3

#: An encoded separator: one reading splits the path there, another does not.
_ENCODED_SEPARATOR = re.compile(rb"%(?:2[fF]|5[cC])")

_DEFAULT_PORTS = {"http": 80, "https": 443}

#: Why a target with a fragment is refused (the command's httptools protocol says it too).
FRAGMENT = "the request target holds a fragment (#...), which a request never carries"

#: Where the target to send upstream sits in the ASGI scope once the gateway checked it.
TARGET_KEY = "idempotency_asgi.gateway.target"


def has_dot_segment(raw_path: bytes) -> bool:
    """Whether any server's reading of the path holds a `.` or `..` segment: as sent, and
    percent-decoded once, twice or three times, each with `\\` as a separator and each
    segment's `;params` dropped (`/x%2F..%2Forders`, `/x/..;/orders`, `/x/%2e%2e;/orders`
    and `/x/%252e%252e/orders` are each `/orders` to some server or chain of servers).

    The upstream (or a proxy before it) would resolve such a path to another one: out of the
    upstream's path prefix, or past the paths the gateway exempts from keys or requires
    them on."""
    if b"." not in raw_path and b"%" not in raw_path:
        return False  # most paths: no dot, no escape, nothing to split
    return any(_dotted(path) for path in _readings(raw_path))


def _dotted(path: bytes) -> bool:
    if b"." not in path:
        return False
    for segment in path.replace(b"\\", b"/").split(b"/"):
        if segment[:1] == b"." and segment.partition(b";")[0] in (b".", b".."):
            return True
    return False


def _readings(raw_path: bytes) -> Iterator[bytes]:
    """The path as sent, then percent-decoded once, twice..., `_DECODINGS` times at most,
    while decoding changes it."""
    path = raw_path
    yield path
    for _ in range(_DECODINGS):
        if b"%" not in path:
            return
        decoded = unquote_to_bytes(path)
        if decoded == path:
            return
        path = decoded
        yield path


def has_encoded_separator(raw_path: bytes) -> bool:
    """Whether the path holds `%2F` or `%5C`, escaped once or more (`%252F`): a separator to
    a server (or a chain of them) that decodes it, part of a segment to one that does not."""
    if b"%" not in raw_path:
        return False
    return any(_ENCODED_SEPARATOR.search(path) for path in _readings(raw_path))


def raw_path(scope: Scope) -> bytes:
    """The path as the client sent it (servers without `raw_path`: the path, UTF-8)."""
    path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    return path


class UpstreamURL:
    """`http[s]://host[:port][/prefix]`: where every request goes."""

    def __init__(self, upstream: str) -> None:
        url = httpx.URL(upstream)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"the upstream must be an http:// or https:// URL, not {upstream!r}")
        if url.query or url.fragment:
            raise ValueError("the upstream URL takes no query string or fragment")
        self._prefix = url.raw_path.rstrip(b"/")
        self.origin = httpcore.Origin(
            url.raw_scheme, url.raw_host, url.port or _DEFAULT_PORTS[url.scheme]
        )
        #: The Host header httpx would send to it (the port only when it is not the default).
        self.netloc = url.netloc

    def target(self, scope: Scope) -> bytes:
        """The request target to send upstream: the prefix, then the client's raw path and
        query. Raises ValueError for a target that is not a path (`*`, an absolute URL)."""
        path = raw_path(scope)
        if not path.startswith(b"/"):
            # Joined to the prefix it would be another path; alone, another kind of target.
            raise ValueError("the request target is not a path")
        query: bytes = scope.get("query_string", b"")
        if b"#" in path or b"#" in query:
            # Never part of a request (RFC 9112, section 3.2): h11 passes it on (in the path,
            # or in the query when a `?` came first), httptools drops it, nginx and Node route
            # the path before it. One meaning under either parser: refused.
            raise ValueError(FRAGMENT)
        target = self._prefix + path + b"?" + query if query else self._prefix + path
        if target.translate(None, _VISIBLE_ASCII):
            # Sent raw by a lax client (or a path without `raw_path`): the same bytes,
            # percent-encoded, since they cannot go on the wire as they are.
            target = quote_from_bytes(target, safe=_VISIBLE_ASCII).encode("ascii")
        return target

    def url(self, target: bytes) -> httpcore.URL:
        origin = self.origin
        return httpcore.URL(scheme=origin.scheme, host=origin.host, port=origin.port, target=target)
