"""Calling a service this middleware protects: httpx transports that retry safely
(`pip install 'idempotency-asgi[client]'`).

    transport = AsyncIdempotentTransport()
    async with httpx.AsyncClient(transport=transport, base_url=...) as http:
        answer = await http.post("/payments", json=...)
        replayed(answer)  # True when the answer is the stored one of an earlier attempt

For each request of a covered method (POST and PATCH by default) the transport:

- uses the request's own `Idempotency-Key`, or sets a new one (a UUID) when it has none:
  one key per logical request, the same on every attempt;
- retries, with that key, when the attempt may not have reached the service or its answer
  did not arrive whole (a connection error, a timeout, the connection closed before the
  answer's head or in the middle of its body), and when the service says to retry later:
  409 with `Retry-After` (the key's first request is still running), 503 and 504 (nothing
  was processed, or the outcome is unknown: the key holds it, and the retry gets the
  answer). `Retry-After` is honoured; without one the wait is a jittered exponential
  backoff;
- never retries any other answer: a 422 (the key was used for another request), a 409
  without `Retry-After` (the application's own), any other 4xx, a 500;
- stops after `max_attempts` attempts or `max_elapsed` seconds, whichever comes first,
  returning the last answer or raising the last error.

A success (a 2xx: the service recorded it) or an answer retried anyway is read whole before it
is returned, within the retries (a body cut half-way is a lost answer, and the retry gets the
stored one): it is held in memory, and `client.stream(...)` iterates it once read. Any other
answer (a 3xx: a 307 or 308 is never recorded, and a gateway may not record another; a 4xx,
a 500: never retried, so a cut in its
body is the caller's error) and an event stream (`text/event-stream`, read as it comes) are
returned as they come. Other methods go
through untouched, without a key and without retries, and stream as they come.
"""

from __future__ import annotations

import email.utils
import random
import time
import uuid
from collections.abc import Callable, Collection
from datetime import datetime, timezone

try:
    import anyio
    import httpx
except ImportError as exc:  # pragma: no cover - tested in a subprocess without httpx
    raise ImportError(
        "idempotency_asgi.client needs httpx: pip install 'idempotency-asgi[client]'"
    ) from exc

#: The errors after which an attempt may or may not have reached the service: with the same
#: key, a retry cannot run the request twice. (Not: an invalid URL, an unsupported
#: protocol, a request httpx could not write: those fail again.)
RETRIED_ERRORS: tuple[type[Exception], ...] = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
)

#: 409 only with Retry-After (the middleware's "in progress"); 503 and 504 with or without.
DEFAULT_RETRY_STATUSES = frozenset({409, 503, 504})

#: The response extension holding how many attempts a request took.
ATTEMPTS = "idempotency_attempts"


def replayed(response: httpx.Response) -> bool:
    """Whether `response` is the stored answer of an earlier request with the same key (the
    service ran it once, before; this attempt ran nothing)."""
    return str(response.headers.get("idempotent-replayed", "")).lower() == "true"


def attempts(response: httpx.Response) -> int:
    """How many attempts the transport made for `response` (1 when it was not retried)."""
    return int(response.extensions.get(ATTEMPTS, 1))


class _Policy:
    """What both transports decide alike: which requests, which answers, how long to wait."""

    def __init__(
        self,
        *,
        methods: Collection[str],
        max_attempts: int,
        max_elapsed: float,
        backoff: float,
        max_backoff: float,
        retry_statuses: Collection[int],
        key_header: str,
        new_key: Callable[[], str],
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be 1 or more")
        if not (max_elapsed > 0 and backoff >= 0 and max_backoff >= 0):
            raise ValueError("max_elapsed must be positive; backoff and max_backoff not negative")
        self.methods = frozenset(method.upper() for method in methods)
        self.max_attempts = max_attempts
        self.max_elapsed = max_elapsed
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.retry_statuses = frozenset(retry_statuses)
        self.key_header = key_header
        self.new_key = new_key

    def covers(self, request: httpx.Request) -> bool:
        return request.method.upper() in self.methods

    def keyed(self, request: httpx.Request) -> None:
        if self.key_header not in request.headers:
            request.headers[self.key_header] = self.new_key()

    def reads_whole(self, response: httpx.Response) -> bool:
        """Whether an answer's body is read within the retries (see the module): a success,
        which the service recorded (its retry is its replay), or one retried anyway; not an
        event stream, which the caller reads as it comes."""
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return False
        return 200 <= response.status_code < 300 or self.retried_status(response)

    def retried_status(self, response: httpx.Response) -> bool:
        if response.status_code not in self.retry_statuses:
            return False
        # A 409 without Retry-After is the application's own answer, recorded: final.
        return response.status_code != 409 or "retry-after" in response.headers

    def wait(self, attempt: int, started: float, response: httpx.Response | None) -> float | None:
        """Seconds to wait before attempt `attempt + 1`; None when no attempt is left
        within the bounds (or the service asks for a wait past them)."""
        if attempt >= self.max_attempts:
            return None
        asked = None if response is None else _retry_after(response)
        if asked is None:
            # Full jitter: many callers retrying after one outage do not come back at once.
            ceiling = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
            delay = random.uniform(0, ceiling)
        else:
            delay = asked
        if time.monotonic() - started + delay >= self.max_elapsed:
            return None
        return delay


def _read(response: httpx.Response) -> httpx.Response:
    """`response` with its body read whole, as it came (still encoded): a new response over
    the bytes, which the client decodes, reads or streams as it would the original. One
    made already read (`httpx.Response(content=...)`, a mock's) is returned as it is."""
    if response.is_stream_consumed:
        return response
    try:
        raw = b"".join(response.iter_raw())
    finally:
        response.close()
    return _over(response, raw)


async def _aread(response: httpx.Response) -> httpx.Response:
    """`_read` for an async response."""
    if response.is_stream_consumed:
        return response
    try:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()
    return _over(response, raw)


def _over(response: httpx.Response, raw: bytes) -> httpx.Response:
    # stream=, not content=: no header is added, and the client reads it as any other. Not
    # the network stream: its connection went back to the pool with the original's close.
    extensions = {k: v for k, v in response.extensions.items() if k != "network_stream"}
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=httpx.ByteStream(raw),
        extensions=extensions,
    )


def _retry_after(response: httpx.Response) -> float | None:
    """Retry-After in seconds (delta-seconds or an HTTP date), None when absent or unreadable."""
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


class IdempotentTransport(httpx.BaseTransport):
    """A sync httpx transport that keys and retries covered requests (see the module):
    `httpx.Client(transport=IdempotentTransport())`. `transport` is the one that sends
    (default: `httpx.HTTPTransport()`)."""

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        methods: Collection[str] = ("POST", "PATCH"),
        max_attempts: int = 5,
        max_elapsed: float = 30.0,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        retry_statuses: Collection[int] = DEFAULT_RETRY_STATUSES,
        key_header: str = "Idempotency-Key",
        new_key: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self._transport = transport if transport is not None else httpx.HTTPTransport()
        self._policy = _Policy(
            methods=methods,
            max_attempts=max_attempts,
            max_elapsed=max_elapsed,
            backoff=backoff,
            max_backoff=max_backoff,
            retry_statuses=retry_statuses,
            key_header=key_header,
            new_key=new_key,
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        policy = self._policy
        if not policy.covers(request):
            return self._transport.handle_request(request)
        policy.keyed(request)
        request.read()  # the body, kept: every attempt sends it again
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._transport.handle_request(request)
                if policy.reads_whole(response):
                    # The body too: an answer cut half-way was lost, as one never begun.
                    response = _read(response)
            except RETRIED_ERRORS:
                delay = policy.wait(attempt, started, None)
                if delay is None:
                    raise
                time.sleep(delay)
                continue
            response.extensions = {**response.extensions, ATTEMPTS: attempt}
            if not policy.retried_status(response):
                return response
            delay = policy.wait(attempt, started, response)
            if delay is None:
                return response
            response.close()
            time.sleep(delay)

    def close(self) -> None:
        self._transport.close()


class AsyncIdempotentTransport(httpx.AsyncBaseTransport):
    """The same for `httpx.AsyncClient(transport=AsyncIdempotentTransport())` (asyncio or
    trio); `transport` defaults to `httpx.AsyncHTTPTransport()`."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        methods: Collection[str] = ("POST", "PATCH"),
        max_attempts: int = 5,
        max_elapsed: float = 30.0,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        retry_statuses: Collection[int] = DEFAULT_RETRY_STATUSES,
        key_header: str = "Idempotency-Key",
        new_key: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self._transport = transport if transport is not None else httpx.AsyncHTTPTransport()
        self._policy = _Policy(
            methods=methods,
            max_attempts=max_attempts,
            max_elapsed=max_elapsed,
            backoff=backoff,
            max_backoff=max_backoff,
            retry_statuses=retry_statuses,
            key_header=key_header,
            new_key=new_key,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        policy = self._policy
        if not policy.covers(request):
            return await self._transport.handle_async_request(request)
        policy.keyed(request)
        await request.aread()  # the body, kept: every attempt sends it again
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._transport.handle_async_request(request)
                if policy.reads_whole(response):
                    # The body too: an answer cut half-way was lost, as one never begun.
                    response = await _aread(response)
            except RETRIED_ERRORS:
                delay = policy.wait(attempt, started, None)
                if delay is None:
                    raise
                await anyio.sleep(delay)
                continue
            response.extensions = {**response.extensions, ATTEMPTS: attempt}
            if not policy.retried_status(response):
                return response
            delay = policy.wait(attempt, started, response)
            if delay is None:
                return response
            await response.aclose()
            await anyio.sleep(delay)

    async def aclose(self) -> None:
        await self._transport.aclose()


__all__ = [
    "ATTEMPTS",
    "DEFAULT_RETRY_STATUSES",
    "RETRIED_ERRORS",
    "AsyncIdempotentTransport",
    "IdempotentTransport",
    "attempts",
    "replayed",
]
