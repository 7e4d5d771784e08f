"""IdempotencyMiddleware: makes retried state-changing requests safe."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import replace
from functools import partial
from typing import Any, cast

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import problems
from .._errors import SCHEMA_MISSING, StoreRefused, StoreUnavailable
from .._keystore import Claim, KeyHold, KeyStore, ShortHold
from .._records import Outcome, expiry_header
from ..maintenance import BackgroundMaintenance
from .body import BodyTooLarge, declared_length, read_body
from .config import IdempotencyConfig
from .durations import Durations
from .execution import STORE_RETRY_AFTER, STORE_UNAVAILABLE, Execution
from .fingerprint import fingerprint_of
from .keys import InvalidKey, read_key, unstorable_tenant
from .lease import LeaseHold
from .onecommit import AtomicRequest, Rules
from .placement import cors_inside
from .settlement import Settlement
from .telemetry import RequestTelemetry

logger = logging.getLogger("idempotency_asgi")

TenantResolver = Callable[[Scope], "str | Awaitable[str | None] | None"]
"""`tenant(scope)`, sync or async: the caller's tenant id (keys are scoped to it), or None when
the request is not authenticated (a keyed request then gets 401). An id PostgreSQL cannot store
(a NUL, a lone surrogate, more than 1,024 bytes) is refused as unauthenticated. A resolver
that raises, or returns anything else, is a fault of the service: a 500
`tenant-resolver-failed`, and the application does not run."""

_MISSING_KEY = problems.missing_key()

#: The longest a waiting duplicate goes without claiming again (see `_wait`).
WAIT_POLL_SECONDS = 1.0

#: Server-side extensions that would let a response bypass http.response.body messages; the
#: middleware must see (and store) every byte, so it hides them from the application.
_HIDDEN_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend")


class IdempotencyMiddleware:
    """Makes retried state-changing requests safe: a keyed request runs once, its retries get
    the stored answer, a duplicate in flight gets 409 and a reused key 422 (the documentation's
    "HTTP contract" page has every case).

    `store` keeps the keys (a PostgresStore); `tenant(scope)` names the caller (a str), or
    None when it is not authenticated. The options are an `IdempotencyConfig`; any of them
    may also be passed by name, as `app.add_middleware(IdempotencyMiddleware, store=...,
    tenant=..., lease_seconds=5)` does, and then wins over `config`'s. `maintenance` (a
    `BackgroundMaintenance`) is started and stopped with the application's lifespan, as the
    store is opened and closed.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: KeyStore,
        tenant: TenantResolver,
        config: IdempotencyConfig | None = None,
        maintenance: BackgroundMaintenance | None = None,
        **options: Any,
    ) -> None:
        config = config or IdempotencyConfig()
        if options:
            config = replace(config, **options)
        self.app = app
        self.store = store
        self.config = config
        self._tenant = tenant
        self._methods = frozenset(method.upper() for method in config.methods)
        self._require_key = config.require_key
        self._required = None if config.required_paths is None else _PathSet(config.required_paths)
        self._exempt = _PathSet(config.exempt_paths)
        self._lease_seconds = config.lease_seconds
        self._ttl_seconds = config.ttl_seconds
        self._max_body = config.max_body_bytes
        self._too_large = problems.body_too_large(config.max_body_bytes)
        self._max_stored = config.max_stored_response_bytes
        self._excluded = frozenset(
            name.lower().encode("latin-1") for name in config.excluded_headers
        )
        self._fingerprint_headers = tuple(
            sorted(name.lower().encode("latin-1") for name in config.fingerprint_headers)
        )
        self._release_statuses = frozenset(config.release_statuses)
        self._maintenance = maintenance
        self._wait_seconds = config.wait_seconds
        self._max_in_flight = config.max_in_flight_per_tenant
        self._max_keys = config.max_keys_per_tenant
        self._atomic = config.atomic
        self._isolation = config.isolation_level
        self._durations = Durations()
        self._idle_seconds = config.transaction_idle_seconds
        self._rules = Rules(
            ttl_seconds=config.ttl_seconds,
            max_stored_bytes=config.max_stored_response_bytes,
            excluded_headers=self._excluded,
            release_statuses=self._release_statuses,
            on_recorded=self._durations.observe,
        )
        # RFC 9110 wants a challenge on every 401; only the application knows its scheme.
        self._unauthenticated = problems.unauthenticated(config.www_authenticate)
        # An error, said at startup (the lifespan fails with it) rather than raised here:
        # Starlette makes its middleware at the first call, the lifespan's startup, and an
        # exception there is taken by uvicorn's default `--lifespan auto` to mean "no
        # lifespan": it would log that at INFO and serve a 500 to every request.
        self._misplaced = cors_inside(app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._misplaced is not None:
            await _refuse(scope, receive, send, self._misplaced)
            return
        if scope["type"] == "lifespan":
            await self.app(scope, self._lifespan_receive(receive), self._lifespan_send(send))
            return
        if scope["type"] != "http" or scope["method"] not in self._methods:
            await self.app(scope, receive, send)
            return
        route = route_path(scope)
        if self._exempt.matches(route):
            await self.app(scope, receive, send)
            return
        refusal: tuple[Settlement, problems.Problem] | None = None
        try:
            key = read_key(scope["headers"])
            if key is None and self._key_required(route):
                refusal = Settlement.MISSING_KEY, _MISSING_KEY
        except InvalidKey as exc:
            key, refusal = None, (Settlement.INVALID_KEY, problems.invalid_key(str(exc)))
        if key is None and refusal is None:
            await self.app(scope, receive, send)  # an optional key, not sent: not ours
            return
        # Who is asking comes first: a caller without credentials is told that (401), not
        # what else is wrong with its request.
        failure: Exception | None = None
        try:
            tenant = await self._resolve_tenant(scope)
        except Exception as exc:
            # The application's resolver failed: no tenant is guessed and nothing runs; the
            # client gets a problem that says so, and the log line the error's traceback.
            tenant, failure = None, exc
        report = RequestTelemetry(
            tenant=tenant, key=key, method=scope["method"], path=scope["path"]
        )
        if failure is not None:
            problem = problems.tenant_resolver_failed()
            await report.answer(send, Settlement.TENANT_FAILED, problem, failure)
        elif tenant is None:
            await report.answer(send, Settlement.UNAUTHENTICATED, self._unauthenticated)
        elif key is None:
            assert refusal is not None
            await report.answer(send, *refusal)
        else:
            await self._keyed(scope, receive, send, report, tenant=tenant, key=key, route=route)

    async def _keyed(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        report: RequestTelemetry,
        *,
        tenant: str,
        key: str,
        route: str,
    ) -> None:
        if declared_length(scope) > self._max_body:
            await report.answer(send, Settlement.BODY_TOO_LARGE, self._too_large)
            return
        try:
            body = await read_body(receive, self._max_body)
        except BodyTooLarge:
            await report.answer(send, Settlement.BODY_TOO_LARGE, self._too_large)
            return
        if body is None:
            return  # the client left before sending its body: nothing to do, nothing reserved
        method = scope["method"]
        path = scope["path"]
        # A large body is fingerprinted in a thread: canonicalising a megabyte of JSON on the
        # event loop held every other request up for a quarter of a second.
        digest = await fingerprint_of(
            method=method,
            raw_path=scope.get("raw_path") or path.encode("utf-8", "surrogateescape"),
            query_string=scope.get("query_string", b""),
            headers=scope["headers"],
            fingerprint_headers=self._fingerprint_headers,
            body=body,
        )
        claim_key = partial(
            self.store.claim,
            tenant=tenant,
            key=key,
            method=method,
            path=path,
            fingerprint=digest,
            lease_seconds=self._lease_seconds,
            ttl_seconds=self._ttl_seconds,
            max_in_flight=self._max_in_flight,
            max_keys=self._max_keys,
            atomic=self._in_atomic_mode(scope),
            isolation=self._isolation,
            idle_seconds=self._idle_seconds,
        )
        try:
            claim = await claim_key()
            if claim.outcome is Outcome.IN_FLIGHT and self._wait_seconds > 0:
                claim = await self._wait(claim, claim_key, tenant=tenant, key=key, digest=digest)
        except StoreUnavailable as exc:
            await report.answer(send, Settlement.STORE_UNAVAILABLE, STORE_UNAVAILABLE, exc)
            return
        except StoreRefused as exc:
            # Not an outage: the same request would fail the same way. Loud, once, and a 500
            # that names it, rather than a 503 the client would retry forever.
            problem = problems.store_refused(exc.error)
            await report.answer(send, Settlement.STORE_REFUSED, problem, exc)
            return

        timed_route = f"{method} {route}"
        outcome = claim.outcome
        if outcome is Outcome.COMPLETED:
            await _replay(send, claim, report, self.config)
        elif outcome is Outcome.IN_FLIGHT:
            retry_after = self._durations.retry_after(
                timed_route,
                running_for=claim.running_for,
                # Capped: the statement's now() may precede a renewal its snapshot sees.
                lease_remaining=min(claim.lease_remaining, self._lease_seconds),
            )
            await report.answer(send, Settlement.IN_FLIGHT, problems.in_flight(retry_after))
        elif outcome is Outcome.MISMATCH:
            await report.answer(send, Settlement.MISMATCH, problems.key_mismatch())
        elif outcome is Outcome.OVER_LIMIT:
            await report.answer(
                send, Settlement.OVER_LIMIT, problems.too_many_in_flight(self._max_in_flight)
            )
        elif outcome is Outcome.UNREADABLE:
            await report.answer(
                send, Settlement.UNREADABLE, problems.unreadable_record(STORE_RETRY_AFTER)
            )
        elif outcome is Outcome.OVER_QUOTA:
            await report.answer(send, Settlement.OVER_QUOTA, problems.too_many_keys(self._max_keys))
        elif claim.hold is not None and claim.hold.short:
            run = AtomicRequest(
                cast(ShortHold, claim.hold),
                send,
                receive,
                report,
                self._rules,
                body=body,
                route=timed_route,
                recorded_as=_RECORDED_AS[outcome],
            )
            await run(self.app, _app_scope(scope))
        else:
            hold: KeyHold
            if claim.hold is not None:
                hold = cast(KeyHold, claim.hold)
            else:
                assert claim.lease is not None
                hold = LeaseHold(
                    self.store,
                    claim.lease,
                    isolation=self._isolation,
                    idle_seconds=self._idle_seconds,
                )
            execution = Execution(
                hold=hold,
                send=send,
                report=report,
                ttl_seconds=self._ttl_seconds,
                max_stored_bytes=self._max_stored,
                excluded_headers=self._excluded,
                release_statuses=self._release_statuses,
                recorded_as=_RECORDED_AS[outcome],
                on_recorded=partial(self._durations.observe, timed_route),
            )
            await execution.run(self.app, _app_scope(scope), body, receive)

    async def _wait(
        self,
        claim: Claim,
        claim_key: Callable[[], Awaitable[Claim]],
        *,
        tenant: str,
        key: str,
        digest: bytes,
    ) -> Claim:
        """Hold a duplicate while the first request runs, up to `wait_seconds`, then claim
        again: a replay when it finished, a run of our own when it was released, and still
        IN_FLIGHT (a 409) when the wait ran out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_seconds
        while claim.outcome is Outcome.IN_FLIGHT:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            # Woken by NOTIFY as a rule; looking again every WAIT_POLL_SECONDS bounds what a
            # wake-up lost in a race costs (a mark that lands just as the first request's
            # completion reads the marks).
            await self.store.wait(
                tenant=tenant,
                key=key,
                timeout=min(remaining, WAIT_POLL_SECONDS),
                locked=claim.locked,
                fingerprint=digest,
            )
            claim = await claim_key()
        return claim

    def _in_atomic_mode(self, scope: Scope) -> bool:
        atomic = self._atomic
        return atomic if isinstance(atomic, bool) else bool(atomic(scope))

    def _key_required(self, path: str) -> bool:
        if self._required is not None:
            return self._required.matches(path)
        return self._require_key

    async def _resolve_tenant(self, scope: Scope) -> str | None:
        result = self._tenant(scope)
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            return None
        if not isinstance(result, str):
            raise TypeError(f"the tenant resolver must return a str or None, not {result!r}")
        reason = unstorable_tenant(result)
        if reason is not None:
            # Derived from the request (a token's claim, say): its caller gets a 401, and the
            # id is never rewritten into one that could be another tenant's.
            logger.warning("tenant resolver returned an id the store cannot keep: %s", reason)
            return None
        return result

    # -- lifespan: the store opens once the application has started, and closes before it
    # stops ---------------------------------------------------------------------------------

    def _lifespan_send(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            kind = message["type"]
            if kind == "lifespan.startup.complete":
                # After the application's own startup, which may be what migrates the schema,
                # or what makes the pool the store is made from.
                await self._start()
            elif kind == "lifespan.shutdown.complete":
                await self._stop()  # an application that never asked for its shutdown
            await send(message)

        return wrapped

    def _lifespan_receive(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                # Before the application's own shutdown, which may close the pool the store
                # is made from: asyncpg's close waits for every connection to come back, and
                # the maintenance runner's would not until the store stopped.
                await self._stop()
            return message

        return wrapped

    async def _stop(self) -> None:
        if self._maintenance is not None:
            await self._maintenance.stop()
        await self.store.close()

    async def _start(self) -> None:
        try:
            await self.store.open()
            revision = await self.store.schema_revision()
        except StoreUnavailable as exc:
            # Start anyway: keyed requests fail closed (503) until the store answers, and the
            # rest of the application keeps serving.
            logger.error("key store not reachable at startup: %s", exc)
        except StoreRefused as exc:
            logger.error("key store refused at startup, keyed requests will fail: %s", exc)
        else:
            if revision is None:
                logger.error("%s; until then every keyed request answers 503", SCHEMA_MISSING)
            elif revision != self.store.schema_head:
                logger.warning(
                    "the idempotency schema is at revision %r, this version expects %r: "
                    "run `idempotency-asgi migrate`",
                    revision,
                    self.store.schema_head,
                )
        if self._maintenance is not None:
            self._maintenance.start()


async def _refuse(scope: Scope, receive: Receive, send: Send, misplaced: str) -> None:
    """A middleware that is set up wrong serves nothing: its lifespan's startup fails with
    what is wrong (the server prints it and stops), and a request that reaches it anyway (a
    server run without the lifespan) raises it."""
    if scope["type"] != "lifespan":
        raise RuntimeError(misplaced)
    message = await receive()
    if message["type"] == "lifespan.startup":
        await send({"type": "lifespan.startup.failed", "message": misplaced})


#: How the key came to a run: said when its answer is recorded.
_RECORDED_AS = {
    Outcome.CLAIMED: Settlement.NEW,
    Outcome.EXPIRED: Settlement.EXPIRED,
    Outcome.TAKEN_OVER: Settlement.TAKEN_OVER,
}


async def _replay(
    send: Send,
    claim: Claim,
    report: RequestTelemetry,
    config: IdempotencyConfig,
) -> None:
    """The stored response, as it was, marked as a replay (`replay_headers`, each set to
    `replay_value`). One recorded without its body (too large to store) is answered 409
    `response-not-replayable`, or, with `omitted_replay_header`, replayed as its status and
    headers with an empty body and that header: `omitted`."""
    response = claim.response
    assert response is not None
    body = response.body
    headers = [*response.headers, *config.replay_marks]
    settlement = Settlement.REPLAYED
    if body is None:
        omitted = config.omitted_mark
        if omitted is None:
            problem = problems.not_replayable(response.status)
            await report.answer(send, Settlement.NOT_REPLAYABLE, problem)
            return
        # The framing of the body that is not there goes with it: the replay says it is empty
        # (a Content-Encoding would promise compressed bytes that an empty body is not).
        framing = (b"content-length", b"content-encoding", b"transfer-encoding")
        headers = [(name, value) for name, value in headers if name.lower() not in framing]
        headers += [(b"content-length", b"0"), omitted]
        body, settlement = b"", Settlement.OMITTED_REPLAY
    report(settlement, response.status)
    if claim.expires_at is not None:
        headers.append(expiry_header(claim.expires_at))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def route_path(scope: Scope) -> str:
    """The path as the application routes it: without the root path it is served under
    (`uvicorn --root-path /api`, a Starlette `Mount`). Servers put the root path into `path`
    too (ASGI since 2023); older ones did not, and then `path` is already the route's."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


class _PathSet:
    """Exact paths, and prefixes written with a trailing `*` (`/webhooks/*`), as the
    application routes them (see `route_path`)."""

    def __init__(self, patterns: Collection[str]) -> None:
        self._exact = frozenset(p for p in patterns if not p.endswith("*"))
        self._prefixes = tuple(p[:-1] for p in patterns if p.endswith("*"))

    def matches(self, path: str) -> bool:
        return path in self._exact or path.startswith(self._prefixes)


def _app_scope(scope: Scope) -> Scope:
    extensions = scope.get("extensions")
    if not extensions or not any(name in extensions for name in _HIDDEN_EXTENSIONS):
        return scope
    visible = {k: v for k, v in extensions.items() if k not in _HIDDEN_EXTENSIONS}
    return {**scope, "extensions": visible}
