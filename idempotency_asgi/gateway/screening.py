"""Requests the gateway refuses before anything else, forwarded to nobody (each a 400 or 431
problem, and the connection closed, so that nothing after the head is read as a request):

- a header section past `max_header_bytes` or `max_header_count`: checked here, on what the
  server parsed, so that the bound holds under any server and parser (uvicorn bounds h11's
  buffer only, not httptools');
- both Content-Length and Transfer-Encoding (RFC 9112 section 6.1): the server in front may
  have framed the body one way and the next hop another, and what one reads as the end of a
  body the other reads as a second request;
- the tenant header (or credential) more than once: a layer in front that appends its value
  would lose to the one the client sent;
- `Connection` naming a header the gateway keys or forwards the request by (the credential,
  `Idempotency-Key`, the tenant header, the fingerprinted ones, the body's framing, type and
  encoding, `Host`): the gateway would key the request by it, then drop it as hop-by-hop;
- a control character in a field value (h11 lets one through, httptools does not): it
  cannot be written on to the upstream, and a refusal found only then came after the key
  was claimed, and was recorded and replayed to the corrected retry.
"""

from __future__ import annotations

from collections.abc import Collection

from starlette.types import Scope

from ..problems import Problem
from . import problems
from .answers import CONTROL

#: Headers whose meaning the gateway depends on, whatever the tenant resolver reads.
RELIED_ON = frozenset(
    {
        b"authorization",
        b"idempotency-key",
        b"content-type",
        b"content-encoding",
        b"content-length",
        b"transfer-encoding",
        b"host",
    }
)

#: What each header line adds on the wire besides its name and value: ": " and CRLF.
_LINE_OVERHEAD = 4


class Screen:
    def __init__(
        self,
        *,
        tenant_header: bytes | None,
        relied_on: Collection[bytes],
        max_header_bytes: int,
        max_header_count: int,
    ) -> None:
        self._tenant_header = tenant_header
        self._relied_on = frozenset(relied_on) | RELIED_ON
        self._max_bytes = max_header_bytes
        self._max_count = max_header_count
        self._too_many = problems.headers_too_large(f"more than {max_header_count} fields")
        self._too_large = problems.headers_too_large(f"more than {max_header_bytes} bytes")

    def __call__(self, scope: Scope) -> Problem | None:
        """The problem to answer instead of forwarding, or None."""
        headers = scope["headers"]
        if len(headers) > self._max_count:
            return self._too_many
        # The request line as it came (near enough), then each field as `name: value` CRLF.
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string", b"")) + 16
        length = chunked = False
        tenants = 0
        connection: list[bytes] = []
        for name, value in headers:
            size += len(name) + len(value) + _LINE_OVERHEAD
            if CONTROL.search(value) is not None:
                return problems.cannot_forward(
                    f"a control character in the value of {name.decode('latin-1')!r}"
                )
            if name == b"content-length":
                length = True
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"connection":
                connection.append(value)
            if name == self._tenant_header:
                tenants += 1
        if size > self._max_bytes:
            return self._too_large
        if length and chunked:
            return problems.ambiguous_framing()
        for value in connection:
            for token in value.split(b","):
                token = token.strip().lower()
                if token in self._relied_on or token == self._tenant_header:
                    return problems.connection_names(token.decode("latin-1"))
        if tenants > 1:
            assert self._tenant_header is not None
            return problems.repeated_header(self._tenant_header.decode("latin-1"))
        return None
