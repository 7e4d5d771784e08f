"""The upstream's URL, parsed once, and the request target each request is sent to.

The gateway used to build every request's URL as a string and let httpx parse it (about a
fifth of a pass-through request's CPU went to httpx's URL and Request objects). The upstream's
part never changes, so it is parsed once here; the request's own part (the client's raw path
and query, under the upstream's path prefix) is passed on as it came when it is plainly
valid, which is what httpx's parser leaves unchanged; anything else (a dot segment, a
character that must be escaped, a fragment mark, non-ASCII bytes) still goes through httpx's
parser, so the upstream receives exactly what it did before.
"""

from __future__ import annotations

import re
from urllib.parse import quote_from_bytes

import httpcore
import httpx
from starlette.types import Scope

_VISIBLE_ASCII = bytes(range(0x21, 0x7F))

#: Paths and queries that httpx's parser passes on unchanged: RFC 3986's unreserved and
#: sub-delimiter characters, ":", "@", "/", "%", "[" and "]" (and "?" in the query). A path
#: with "/." in it may hold a dot segment, which httpx removes: it takes the parser's way.
_PLAIN_PATH = re.compile(rb"/[A-Za-z0-9\-._~!$&'()*+,;=:@/%\[\]]*")
_PLAIN_QUERY = re.compile(rb"[A-Za-z0-9\-._~!$&'()*+,;=:@/%\[\]?]*")
#: Far below httpx's own limit for a whole URL (64 KiB); longer targets take the parser's way.
_PLAIN_LENGTH = 8192

_DEFAULT_PORTS = {"http": 80, "https": 443}


class UpstreamURL:
    """`http[s]://host[:port][/prefix]`: where every request goes."""

    def __init__(self, upstream: str) -> None:
        url = httpx.URL(upstream)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"the upstream must be an http:// or https:// URL, not {upstream!r}")
        if url.query or url.fragment:
            raise ValueError("the upstream URL takes no query string or fragment")
        self._base = str(url.copy_with(raw_path=b"")).rstrip("/")
        self._prefix = url.raw_path.rstrip(b"/")
        self.origin = httpcore.Origin(
            url.raw_scheme, url.raw_host, url.port or _DEFAULT_PORTS[url.scheme]
        )
        #: The Host header httpx would send to it (the port only when it is not the default).
        self.netloc = url.netloc

    def target(self, scope: Scope) -> bytes:
        """The request target to send upstream: the prefix, then the client's raw path and
        query. Raises httpx.InvalidURL (or UnicodeError) for one that cannot be sent."""
        path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
        query: bytes = scope.get("query_string", b"")
        if (
            len(path) + len(query) < _PLAIN_LENGTH
            and _PLAIN_PATH.fullmatch(path)
            and b"/." not in path
            and (not query or _PLAIN_QUERY.fullmatch(query))
        ):
            return self._prefix + path + b"?" + query if query else self._prefix + path
        return self._parsed(path + b"?" + query if query else path)

    def _parsed(self, target: bytes) -> bytes:
        if not target.isascii():
            # Sent raw by a lax client: pass the same bytes on, percent-encoded, rather than
            # let the URL parser re-encode them as something else.
            target = quote_from_bytes(target, safe=_VISIBLE_ASCII).encode("ascii")
        url = httpx.URL(self._base + self._prefix.decode("ascii") + target.decode("ascii"))
        return url.raw_path

    def url(self, target: bytes) -> httpcore.URL:
        origin = self.origin
        return httpcore.URL(scheme=origin.scheme, host=origin.host, port=origin.port, target=target)
