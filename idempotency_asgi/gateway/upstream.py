"""What the proxy asks of its way to the upstream: send one request, get its answer.

`UpstreamPool` does it natively (httpcore connections of its own, no httpx Request or
Response objects per request). Any other httpx transport given to `build_gateway` is driven
through `HttpxUpstream`. Either way the failures are httpx's exceptions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, MutableMapping
from typing import Any, Protocol

import httpcore
import httpx

Headers = list[tuple[bytes, bytes]]
#: httpcore's "timeout" extension: "connect", "read", "write" and "pool", in seconds.
Timeouts = dict[str, Any]


class LeftoverBytes(httpx.RemoteProtocolError):
    """The upstream sent bytes after a whole response (a body on a HEAD, a 204 or a 304, more
    than its Content-Length said, a second response in the same write): the connection is
    closed, never reused, since those bytes would be read as the next request's answer. The
    response they followed is suspect too (RFC 9112, section 6.3)."""


class MalformedAnswer(httpx.RemoteProtocolError):
    """What the upstream sent is not an HTTP/1.1 answer at all (no status line, a head past
    its bound, a chunk that is not one): nothing of it can be trusted, its status included."""


class UpstreamResponse:
    """The upstream's status and headers (as received); iterate it for the body, then close
    it (which gives the connection back)."""

    def __init__(self, status: int, headers: Headers, extensions: MutableMapping[str, Any]) -> None:
        self.status = status
        self.headers = headers
        self.extensions = extensions

    def __aiter__(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class Upstream(Protocol):
    async def send(
        self,
        method: bytes,
        url: httpcore.URL,
        headers: Headers,
        content: bytes | AsyncIterator[bytes],
        timeouts: Timeouts,
    ) -> UpstreamResponse:
        """Send the request (its headers as they are: nothing is added) and return once the
        answer's status and headers are in."""

    async def aclose(self) -> None: ...


class HttpxUpstream:
    """Any httpx transport, as an Upstream."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._transport = transport

    async def send(
        self,
        method: bytes,
        url: httpcore.URL,
        headers: Headers,
        content: bytes | AsyncIterator[bytes],
        timeouts: Timeouts,
    ) -> UpstreamResponse:
        request = httpx.Request(
            method.decode("ascii"),
            httpx.URL(
                scheme=url.scheme.decode("ascii"),
                host=url.host.decode("ascii"),
                port=url.port,
                raw_path=url.target,
            ),
            headers=headers,
            content=content,
            extensions={"timeout": timeouts},
        )
        response = await self._transport.handle_async_request(request)
        return _HttpxResponse(response)

    async def aclose(self) -> None:
        await self._transport.aclose()


class _HttpxResponse(UpstreamResponse):
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code, response.headers.raw, response.extensions)
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        self._stream = stream

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        await self._stream.aclose()
