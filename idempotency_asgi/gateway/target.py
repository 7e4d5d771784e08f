"""The upstream's URL, parsed once, and the request target each request is sent to.

The request target is passed on as the client sent it: the upstream's path prefix, then the
client's raw path, then `?` and the raw query when there is one. Nothing is normalized or
re-escaped (an upstream may give meaning to any byte of it, and a proxy that rewrites targets
makes the upstream see another request than the one the gateway checked); only bytes that
cannot go on the wire as they are (outside visible ASCII) are percent-encoded. A path with a
dot segment never gets this far (see `has_dot_segment`).
"""

from __future__ import annotations

from urllib.parse import quote_from_bytes

import httpcore
import httpx
from starlette.types import Scope

#: What a request target may hold on the wire (RFC 9112's request-target is visible ASCII).
_VISIBLE_ASCII = bytes(range(0x21, 0x7F))

#: "." and "..", in every spelling of their dots (percent-encoded, either case once lowered).
_DOT_SEGMENTS = frozenset({b".", b"..", b"%2e", b".%2e", b"%2e.", b"%2e%2e"})
_LONGEST_DOT_SEGMENT = max(len(segment) for segment in _DOT_SEGMENTS)

_DEFAULT_PORTS = {"http": 80, "https": 443}


def has_dot_segment(raw_path: bytes) -> bool:
    """Whether the path holds a `.` or `..` segment, its dots maybe percent-encoded, with `\\`
    counted as a separator too (WHATWG URL parsers, Node's among them, read it as `/`).

    The upstream would resolve such a path to another one: out of the upstream's path prefix,
    or past the paths the gateway exempts from keys or requires them on."""
    if b"." not in raw_path and b"%" not in raw_path:
        return False  # most paths: no dot, no escape, nothing to split
    for segment in raw_path.replace(b"\\", b"/").split(b"/"):
        if len(segment) <= _LONGEST_DOT_SEGMENT and segment.lower() in _DOT_SEGMENTS:
            return True
    return False


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
        target = self._prefix + path + b"?" + query if query else self._prefix + path
        if target.translate(None, _VISIBLE_ASCII):
            # Sent raw by a lax client (or a path without `raw_path`): the same bytes,
            # percent-encoded, since they cannot go on the wire as they are.
            target = quote_from_bytes(target, safe=_VISIBLE_ASCII).encode("ascii")
        return target

    def url(self, target: bytes) -> httpcore.URL:
        origin = self.origin
        return httpcore.URL(scheme=origin.scheme, host=origin.host, port=origin.port, target=target)
