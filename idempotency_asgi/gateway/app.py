"""The gateway: IdempotencyMiddleware in front of a proxy to one upstream.

    request ── a header section too large, framed twice, a repeated tenant header, a
            │  control character in a field, or Connection naming what the request is
            │  keyed by? ── its own 400 / 431
            ├─ a dot segment in any reading of the path, a target that is not a path, a
            │  fragment, an encoded separator on an exempt path? ── its own 400
            ├─ health path ── its own 200 (GET, HEAD) or 405
            ├─ covered method with a key ── ClientDeadline ── IdempotencyMiddleware ── Proxy
            ├─ covered method, no key ───────────────────── IdempotencyMiddleware ── Proxy
            └─ anything else (GET, DELETE...) ───────────────────────────────────── Proxy

Every refusal comes before the middleware: a request refused after its key was claimed had
its refusal recorded and replayed to the corrected retry.

Keyed requests run in the middleware's plain mode: the gateway cannot share the upstream's
transaction, so the key is completed by one statement once the upstream's answer is whole.

Every request's body and response are bounded in time (`bounds.py`): a body that stalls gets
408, a client that does not read its response is let go, and neither holds an upstream
connection for longer than that.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from .._asgi.config import IdempotencyConfig
from .._asgi.middleware import IdempotencyMiddleware, _PathSet, route_path
from .._errors import StoreError
from .._postgres.connections import DATABASE_ERRORS
from .._postgres.migrate import migrate_connection
from .._postgres.store import PostgresStore
from ..maintenance import BackgroundMaintenance
from ..problems import Problem, missing_key, outcome_unknown
from . import problems
from .bounds import BODY_KEY, BodyLimits, BodyStalled, Bounded, ClientTooSlow, WholeLimits
from .deadline import ClientDeadline
from .headers import gateways_own
from .health import answer_health
from .options import DEFAULT_HEALTH_PATH, GATEWAY_CONFIG
from .paths import LoosePaths
from .pool import UpstreamPool
from .proxy import Proxy, UpstreamOutcomeUnknown
from .screening import Screen
from .spool import DiskBudget
from .strangers import Strangers
from .target import TARGET_KEY, has_dot_segment, has_encoded_separator, raw_path
from .tenants import HeaderTenant, TenantResolver
from .upstream import HttpxUpstream, Upstream

logger = logging.getLogger("idempotency_asgi.gateway")

_KEY_HEADER = b"idempotency-key"
_MISSING_KEY = missing_key()
_DOT_SEGMENT = problems.dot_segment()
_AMBIGUOUS_EXEMPT = problems.dot_segment(encoded_separator=True)

#: Headers that change which method a request runs as (Google's APIs, Rails, Laravel,
#: Symfony read them): always part of the fingerprint, or a DELETE's answer would be
#: replayed for a PUT sent with the same key.
METHOD_OVERRIDES = ("x-http-method-override", "x-http-method", "x-method-override")


def build_gateway(
    upstream: str,
    *,
    store: PostgresStore | str,
    tenant: TenantResolver,
    config: IdempotencyConfig = GATEWAY_CONFIG,
    maintenance: BackgroundMaintenance | None = None,
    client_timeout: float = 30.0,
    upstream_timeout: float = 120.0,
    exchange_timeout: float = 300.0,
    connect_timeout: float = 5.0,
    body_timeout: float = 30.0,
    body_deadline: float = 60.0,
    send_timeout: float = 30.0,
    request_buffer_bytes: int = 64 * 1024,
    request_spool_bytes: int = 64 * 1024 * 1024,
    response_buffer_bytes: int = 256 * 1024,
    response_spool_bytes: int = 1024 * 1024 * 1024,
    spool_disk_bytes: int = 2 * 1024 * 1024 * 1024,
    unverified_statuses: Collection[int] = (),
    max_header_bytes: int = 32 * 1024,
    max_header_count: int = 100,
    keepalive_expiry: float = 4.0,
    max_connections: int = 100,
    preserve_host: bool = False,
    trust_forwarded: bool = False,
    health_path: str = DEFAULT_HEALTH_PATH,
    apply_schema: bool = True,
    transport: httpx.AsyncBaseTransport | None = None,
    **options: Any,
) -> Gateway:
    """An ASGI app that makes retried requests to `upstream` safe (the documentation's "Gateway"
    page has every option, bound and refusal). `store` is a PostgresStore or a PostgreSQL URL;
    the gateway opens and closes it, and the upstream connections, with the ASGI lifespan. The
    middleware's options are `config`, by default the gateway's own: keys optional, an
    upstream's 401 and 403 released too, and at most 100,000 keys stored per tenant. Any of them
    may also be passed by name and wins over `config`'s. `tenant` is a resolver such as
    `tenant_from_header` or `tenant_from_credential`. Out-of-range bounds raise ValueError."""
    if options:
        config = replace(config, **options)
    listed = {name.lower() for name in config.fingerprint_headers}
    overrides = tuple(name for name in METHOD_OVERRIDES if name not in listed)
    if overrides:
        config = replace(config, fingerprint_headers=(*config.fingerprint_headers, *overrides))
    if not 0 < client_timeout <= upstream_timeout:
        raise ValueError("need 0 < client_timeout <= upstream_timeout")
    if exchange_timeout < client_timeout:
        raise ValueError("exchange_timeout must not be shorter than client_timeout")
    if connect_timeout <= 0 or keepalive_expiry < 0 or max_connections < 1:
        raise ValueError("connect_timeout, keepalive_expiry and max_connections out of range")
    if body_timeout <= 0 or body_deadline <= 0 or send_timeout <= 0:
        raise ValueError("body_timeout, body_deadline and send_timeout must be positive")
    if min(request_buffer_bytes, request_spool_bytes, response_spool_bytes, spool_disk_bytes) < 0:
        raise ValueError(
            "request_buffer_bytes, request_spool_bytes, response_spool_bytes or "
            "spool_disk_bytes < 0"
        )
    if response_buffer_bytes < 1 or max_header_bytes < 1 or max_header_count < 1:
        raise ValueError("response_buffer_bytes, max_header_bytes or max_header_count out of range")
    if not health_path.startswith("/"):
        raise ValueError("health_path must start with /")
    if isinstance(store, str):
        store = PostgresStore(store)
    connections: Upstream
    if transport is None:
        # keepalive_expiry stays below the upstream's own idle timeout (Node's is 5 s): a
        # connection the upstream closes just as a request goes out on it would fail that
        # request after it was (maybe) sent, an outcome the gateway cannot know.
        connections = UpstreamPool(
            max_connections=max_connections,
            keepalive_expiry=keepalive_expiry,
            ssl_context=httpx.create_ssl_context() if upstream.startswith("https:") else None,
        )
    elif isinstance(transport, UpstreamPool):
        connections = transport
    else:
        connections = HttpxUpstream(transport)
    # One per process (each worker builds its own gateway): all its temporary files together.
    budget = DiskBudget(spool_disk_bytes)
    proxy = Proxy(
        upstream,
        transport=connections,
        client_timeout=client_timeout,
        upstream_timeout=upstream_timeout,
        connect_timeout=connect_timeout,
        preserve_host=preserve_host,
        trust_forwarded=trust_forwarded,
        exchange_timeout=exchange_timeout,
        stream_requests=request_spool_bytes == 0,
        response_buffer_bytes=response_buffer_bytes,
        response_spool_bytes=response_spool_bytes,
        disk_budget=budget,
        # A keyed answer the disk cannot hold waits in memory up to what may be stored: the
        # middleware holds that much in memory anyway, until it is recorded.
        stored_bytes=config.max_stored_response_bytes,
        # A tenant that is only a digest of whatever credential came (any string is one):
        # what it stores before the upstream ever accepted it is bounded (strangers.py).
        strangers=Strangers(unverified_statuses),
        tenant=tenant if isinstance(tenant, HeaderTenant) and not tenant.vouched else None,
        own_headers=gateways_own(config.replay_headers, config.omitted_replay_header),
    )
    middleware = IdempotencyMiddleware(
        Backend(proxy, store=store, apply_schema=apply_schema),
        store=store,
        tenant=tenant,
        config=config,
        maintenance=maintenance,
    )
    # Past the client's deadline the upstream may take until upstream_timeout; retry then.
    retry_after = max(1.0, min(config.lease_seconds, upstream_timeout - client_timeout))
    deadline = ClientDeadline(
        middleware,
        seconds=client_timeout,
        answer=problems.still_running(client_timeout, math.ceil(retry_after)),
    )
    screen = Screen(
        tenant_header=tenant.header if isinstance(tenant, HeaderTenant) else None,
        relied_on=[name.lower().encode("latin-1") for name in config.fingerprint_headers],
        max_header_bytes=max_header_bytes,
        max_header_count=max_header_count,
    )
    return Gateway(
        proxy,
        middleware=middleware,
        deadline=deadline,
        screen=screen,
        methods=config.methods,
        health_path=health_path,
        body=BodyLimits(
            pause=body_timeout, deadline=body_deadline, memory=request_buffer_bytes, budget=budget
        ),
        # Streaming past the memory buffer (request_spool_bytes 0): read ahead that much only.
        read_ahead=request_spool_bytes or request_buffer_bytes,
        keyed_read_ahead=config.max_body_bytes,
        send_timeout=send_timeout,
        whole_answers=WholeLimits(
            memory=response_buffer_bytes, disk=response_spool_bytes, budget=budget
        ),
    )


class Gateway:
    """Built by `build_gateway`; wrap it in your own middleware (auth) like any ASGI app."""

    def __init__(
        self,
        proxy: Proxy,
        *,
        middleware: IdempotencyMiddleware,
        deadline: ClientDeadline,
        screen: Screen,
        methods: Collection[str],
        health_path: str,
        body: BodyLimits,
        read_ahead: int,
        keyed_read_ahead: int,
        send_timeout: float,
        whole_answers: WholeLimits,
    ) -> None:
        self.proxy = proxy
        self.middleware = middleware
        self._deadline = deadline
        self._screen = screen
        self._methods = frozenset(method.upper() for method in methods)
        self._health_path = health_path
        self._body = body
        self._read_ahead = read_ahead
        self._keyed_read_ahead = keyed_read_ahead
        self._exempt = _PathSet(middleware.config.exempt_paths)
        required = middleware.config.required_paths
        self._required = None if required is None else LoosePaths(required)
        self._send_timeout = send_timeout
        self._whole_answers = whole_answers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            refusal = self._screen(scope)
            if refusal is not None:
                # Before anything else: a request the gateway cannot read one way only.
                await refusal.send(send)
                return
            bounded = Bounded(
                scope,
                receive,
                send,
                body=self._body,
                response=self._send_timeout,
                whole_answers=(
                    self._whole_answers
                    if scope.get("http_version") == "1.0" and scope["method"] != "HEAD"
                    else None
                ),
            )
            try:
                await self._route({**scope, BODY_KEY: bounded}, bounded)
            except BodyStalled as exc:
                if bounded.started:
                    raise
                problem = problems.body_timeout(
                    exc.seconds, whole=exc.whole, forwarded=exc.forwarded
                )
                await problem.send(bounded.send)
            except ClientTooSlow as exc:
                # The server closes the connection: the response was not completed.
                logger.warning("client let go: %s", exc)
            except UpstreamOutcomeUnknown as exc:
                # Past the answer's settling (a response too large to store, streaming on):
                # the record stands, and the response ends short.
                logger.warning("upstream exchange abandoned after the answer began: %s", exc)
                if not bounded.started:
                    await outcome_unknown(1).send(bounded.send)
            except OSError as exc:
                # The gateway's own temporary files (a request body read ahead, an answer held
                # whole for an HTTP/1.0 client): the key, if any, was settled by the
                # middleware on the way out; the client gets a problem, not a bare 500.
                logger.error("the gateway could not hold a request or an answer: %r", exc)
                if not bounded.started:
                    await problems.storage_failed().send(bounded.send)
            finally:
                bounded.close()
        elif kind == "lifespan":
            # The middleware opens the store when startup begins and closes it after
            # shutdown; the Backend behind it does the gateway's own steps.
            await self.middleware(scope, receive, send)
        else:
            # WebSockets are not proxied: refuse the handshake (the client sees a 403).
            await receive()
            await send({"type": "websocket.close", "code": 1008})

    async def _route(self, scope: Scope, bounded: Bounded) -> None:
        receive, send = bounded.receive, bounded.send
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal.send(send)
        elif scope["path"] == self._health_path:
            await answer_health(scope["method"], self._health_path, send)
        elif scope["method"] not in self._methods:
            # Methods are case-sensitive (RFC 9110): a "post" is not a covered POST, and
            # the proxy forwards it as "post".
            bounded.limit = self._read_ahead
            await self.proxy(scope, receive, send)
        elif any(name == _KEY_HEADER for name, _ in scope["headers"]):
            # Read whole before the key is claimed, but no further than the middleware
            # takes: past it, the middleware answers 413. (It passes an exempt path on.)
            exempt = self._exempt.matches(route_path(scope))
            bounded.limit = self._read_ahead if exempt else self._keyed_read_ahead
            await self._deadline(scope, receive, send)
        elif self._required is not None and self._required_here(route_path(scope)):
            # A path the upstream may read as a required one, spelled otherwise (paths.py).
            await _MISSING_KEY.send(send)
        else:
            bounded.limit = self._read_ahead
            await self.middleware(scope, receive, send)

    def _refusal(self, scope: Scope) -> Problem | None:
        """What the gateway answers instead of forwarding, decided on the raw target before
        any key is claimed (the target to send is kept in the scope for the proxy)."""
        try:
            scope[TARGET_KEY] = self.proxy.target(scope)
        except ValueError as exc:
            return problems.cannot_forward(str(exc))  # not a path, or a fragment
        path = raw_path(scope)
        if has_dot_segment(path):
            # The middleware matches its paths as sent, and the upstream (or nginx before
            # it) would resolve the dot segments: each would see another path.
            return _DOT_SEGMENT
        if has_encoded_separator(path) and self._exempt.matches(route_path(scope)):
            # Exempt with its %2F read as a separator (as the checks read it), another path
            # to an upstream that reads it as part of a segment: neither reading is assumed.
            return _AMBIGUOUS_EXEMPT
        return None

    def _required_here(self, route: str) -> bool:
        assert self._required is not None
        return self._required.matches(route) and not self._exempt.matches(route)


class Backend:
    """What the middleware runs: the proxy, and the gateway's own lifespan steps (apply the
    schema at startup; close the upstream connections at shutdown)."""

    def __init__(self, proxy: Proxy, *, store: PostgresStore, apply_schema: bool) -> None:
        self._proxy = proxy
        self._store = store
        self._apply_schema = apply_schema

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self._proxy(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._proxy.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _startup(self) -> None:
        if not self._apply_schema:
            return
        # Under the migration's advisory lock, so several workers may start at once.
        try:
            conn = await self._store.lend()
            try:
                applied = await migrate_connection(conn)
            finally:
                await self._store.give_back(conn)
        except (StoreError, *DATABASE_ERRORS) as exc:
            # As the middleware does: serve anyway. Keyed requests answer 503 until the
            # store is back (and the schema with it); everything else passes through.
            logger.error("could not apply the schema, the key store is unavailable: %s", exc)
            return
        if applied:
            logger.info("applied schema revisions %s", ", ".join(applied))
