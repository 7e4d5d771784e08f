"""Starlette apps behind IdempotencyMiddleware, for the tests.

Every handler leaves an auditable effect: a row in `effects`, written either inside the
request's transaction (/tx/...) or on its own connection (/plain/...), so tests can count how
many times a handler really ran. Request headers steer them:

    x-tenant        the tenant (no header: unauthenticated)
    x-delay-ms      sleep this long after the write
    x-status        answer with this status
    x-raise         raise an exception after the write
    x-unknown-wrapped  raise an error of its own from an OutcomeUnknown, after the write
    x-unknown       raise OutcomeUnknown after the write
    x-unknown-chain  after the write, raise an error of its own with an OutcomeUnknown behind
                    it: `implicit` (raised while handling it), `from-none` (the same, `from
                    None`), `deep` (50 links, `from` and implicit in turn), `group` (a task
                    group's member raised while handling it)
    x-kill-conn     terminate the transaction's own database session after the write
    x-slow-commit   make the transaction's COMMIT take this many seconds
    x-commit-error  make the transaction's COMMIT fail with this SQLSTATE
    x-raise-sqlstate  after the write, run a statement that fails with this SQLSTATE (uncaught)
    x-end-transaction  after the write, send COMMIT or ROLLBACK on the request's connection
                    itself (the misuse the middleware must find)
    x-group         /fan-out: what a child of the handler's task group does: `unknown`
                    (writes on the app's own pool, then raises OutcomeUnknown), `store` (asks
                    for the request's connection first), `error` (raises RuntimeError)
    x-group-lib     /fan-out: `anyio` for an anyio task group (default: asyncio's)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import orjson
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

from idempotency_asgi import IdempotencyMiddleware, OutcomeUnknown, PostgresStore, connection
from tests import batching, modes

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS effects (
    id bigserial PRIMARY KEY,
    tenant text NOT NULL,
    idempotency_key text,
    path text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS names (
    tenant text NOT NULL,
    name text NOT NULL,
    PRIMARY KEY (tenant, name)
);
-- A row here makes its transaction's COMMIT sleep that long (a deferred constraint trigger
-- runs at COMMIT): the stand-in for a COMMIT that waits for a synchronous standby.
CREATE TABLE IF NOT EXISTS slow_commits (seconds float8 NOT NULL);
CREATE OR REPLACE FUNCTION sleep_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(NEW.seconds);
    RETURN NULL;
END $$;
-- A row here makes its transaction's COMMIT fail with that SQLSTATE (40001: a serialization
-- failure, as PostgreSQL reports it for a conflict found at commit).
CREATE TABLE IF NOT EXISTS failing_commits (sqlstate text NOT NULL);
CREATE OR REPLACE FUNCTION fail_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'failing at commit, as asked' USING ERRCODE = NEW.sqlstate;
END $$;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'failing_commits_fail') THEN
        CREATE CONSTRAINT TRIGGER failing_commits_fail AFTER INSERT ON failing_commits
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_at_commit();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'slow_commits_sleep') THEN
        CREATE CONSTRAINT TRIGGER slow_commits_sleep AFTER INSERT ON slow_commits
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION sleep_at_commit();
    END IF;
END $$;
"""


def tenant_from_header(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-tenant":
            return value.decode()
    return None


class EffectsPool:
    """The application's own pool for plain-mode writes, opened on first use."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._pool: asyncpg.Pool | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> asyncpg.Pool:
        async with self._lock:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(self._dsn, min_size=1, max_size=10)
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


def _header(request: Request, name: str) -> str | None:
    return request.headers.get(name)


async def _after_write(request: Request, conn: Any = None) -> Response | None:
    if conn is not None and _header(request, "x-slow-commit"):
        seconds = float(_header(request, "x-slow-commit") or 0)
        await conn.execute("INSERT INTO slow_commits (seconds) VALUES ($1)", seconds)
    if conn is not None and _header(request, "x-commit-error"):
        sqlstate = _header(request, "x-commit-error")
        await conn.execute("INSERT INTO failing_commits (sqlstate) VALUES ($1)", sqlstate)
    if conn is not None and _header(request, "x-raise-sqlstate"):
        sqlstate = _header(request, "x-raise-sqlstate")
        await conn.execute(
            f"DO $$ BEGIN RAISE EXCEPTION 'as asked' USING ERRCODE = '{sqlstate}'; END $$"
        )
    if conn is not None and _header(request, "x-lock"):
        # A lock of the transaction's, named by the test (another session may wait on it).
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", _header(request, "x-lock"))
    if conn is not None and _header(request, "x-savepoint"):
        # asyncpg's own idiom inside the request's transaction: a savepoint that keeps its
        # write, and one whose write is rolled back while the transaction goes on.
        async with conn.transaction():
            await _write_effect(conn, request, "savepoint")
        with contextlib.suppress(LookupError):
            async with conn.transaction():
                await _write_effect(conn, request, "savepoint-undone")
                raise LookupError("undone")
    ending = _header(request, "x-end-transaction")
    if conn is not None and ending in ("COMMIT", "ROLLBACK"):
        await conn.execute(ending)
    if conn is not None and _header(request, "x-kill-conn"):
        await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    delay = _header(request, "x-delay-ms")
    if delay:
        await asyncio.sleep(int(delay) / 1000)
    if _header(request, "x-raise"):
        raise RuntimeError("handler failed after its write")
    if _header(request, "x-unknown"):
        raise OutcomeUnknown("the provider did not answer in time")
    chain = _header(request, "x-unknown-chain")
    if chain:
        await _raise_behind_an_unknown_outcome(chain)
    if _header(request, "x-unknown-wrapped"):
        # An application's own error raised from the OutcomeUnknown it was given, itself
        # raised from the driver's statement timeout.
        try:
            try:
                raise asyncpg.exceptions.QueryCanceledError("canceling statement: timeout")
            except asyncpg.PostgresError as exc:
                raise OutcomeUnknown("the ledger did not answer in time") from exc
        except OutcomeUnknown as unknown:
            raise RuntimeError("the charge failed") from unknown
    return None


class ChargeFailed(Exception):
    """An application's own error, raised with an OutcomeUnknown behind it."""


async def _raise_behind_an_unknown_outcome(how: str) -> None:
    """Raise the application's own error with an OutcomeUnknown behind it, as `how` says
    (see x-unknown-chain in the module's docstring), written as applications write it."""
    if how == "group":

        async def child() -> None:
            await _raise_behind_an_unknown_outcome("implicit")

        async with anyio.create_task_group() as group:
            group.start_soon(child)
        return
    if how == "deep":
        error: BaseException = OutcomeUnknown("the provider did not answer in time")
        for link in range(50):
            try:
                try:
                    raise error
                except BaseException as caught:
                    if link % 2:
                        raise ChargeFailed(f"link {link}")  # noqa: B904 (its __context__)
                    raise ChargeFailed(f"link {link}") from caught
            except ChargeFailed as wrapped:
                error = wrapped
        raise error
    try:
        raise OutcomeUnknown("the provider did not answer in time")
    except OutcomeUnknown:
        if how == "from-none":
            raise ChargeFailed("the charge failed") from None
        raise ChargeFailed("the charge failed")  # noqa: B904 (implicit chaining is the case)


async def _write_effect(db: Any, request: Request, path: str | None = None) -> int:
    """The handler's auditable effect, through `db` (the request's connection or a pool)."""
    effect_id: int = await db.fetchval(
        "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, $3) RETURNING id",
        request.headers.get("x-tenant"),
        request.headers.get("idempotency-key"),
        path or request.url.path,
    )
    return effect_id


def _answer(request: Request, effect_id: int, body: bytes) -> Response:
    status = int(_header(request, "x-status") or 201)
    payload = orjson.dumps({"effect_id": effect_id, "echo": body.decode("utf-8", "replace")})
    response = Response(payload, status_code=status, media_type="application/json")
    response.headers["x-custom"] = "kept"
    response.set_cookie("session", "first-caller-only")
    return response


class AppPool:
    """The application's own asyncpg pool, made by its startup (in the running event loop)
    and closed by its shutdown; a store made from it reads it when it opens."""

    def __init__(self, dsn: str, size: int, options: dict[str, Any] | None = None) -> None:
        self._dsn = dsn
        self._size = size
        self._options = options or {}
        self.pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        self.pool = await asyncpg.create_pool(
            self._dsn, min_size=1, max_size=self._size, **self._options
        )

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    def __call__(self) -> asyncpg.Pool:
        assert self.pool is not None, "the application's pool is made at startup"
        return self.pool


@contextlib.asynccontextmanager
async def _closing(effects: EffectsPool, pool: AppPool | None) -> AsyncIterator[None]:
    if pool is not None:
        await pool.open()  # by the application's own startup, before the store opens
    try:
        yield
    finally:
        await effects.close()
        if pool is not None:
            await pool.close()


def default_store(
    dsn: str, pool_size: int | None = None, **store_options: Any
) -> tuple[PostgresStore, AppPool | None]:
    """The store the test apps get unless a test gives one: on `dsn`, or on an application's
    pool of `pool_size` connections (with IDEMPOTENCY_TEST_STORE=pool, the store options'
    `max_size` or modes.POOL_SIZE: see tests/modes.py), made with the store options'
    `pool_options`, which the app makes at startup and closes at shutdown."""
    if pool_size is None and modes.app_pool():
        pool_size = store_options.get("max_size", modes.POOL_SIZE)
    if pool_size is None:
        return PostgresStore(dsn, **store_options), None
    pool = AppPool(dsn, pool_size, store_options.get("pool_options"))
    dsn_only = ("statement_connections", "min_size", "max_size", "pool_options")
    options = {k: v for k, v in store_options.items() if k not in dsn_only}
    return PostgresStore(pool, **options), pool


def build_app(
    dsn: str,
    *,
    store: PostgresStore | None = None,
    calls: list[str] | None = None,
    tenant: Any = tenant_from_header,
    app_pool: AppPool | None = None,
    wrapped: bool = False,
    cors: str | None = None,
    **options: Any,
) -> Any:
    """The test app. `calls` collects one entry per handler run, for checks that must hold
    even when the database is down. `wrapped`: the middleware wraps the Starlette app
    (`IdempotencyMiddleware(Starlette(...), ...)`) instead of being added to it, so that
    Starlette's own error middleware is inside it. `cors`: a CORSMiddleware (CORS_OPTIONS)
    added `outside` the middleware (after it), or `inside` (before it, as FastAPI's tutorials
    have it)."""
    effects = EffectsPool(dsn)
    calls = calls if calls is not None else []
    pool = app_pool  # the application's pool its store was made from, if it was
    if store is None:
        store, pool = default_store(dsn)

    async def tx_charge(request: Request) -> Response:
        calls.append(request.url.path)
        body = await request.body()
        conn = await connection(request)
        effect_id = await _write_effect(conn, request)
        if request.headers.get("x-wait-on-itself"):
            # A lock the request's transaction takes, then waited for on another session (a
            # pool of the application's own): it waits on its own request.
            lock = "SELECT pg_advisory_xact_lock(hashtext($1))"
            await conn.execute(lock, request.headers.get("idempotency-key"))
            other = await effects.get()
            await other.execute(lock, request.headers.get("idempotency-key"))
        await _after_write(request, conn)
        return _answer(request, effect_id, body)

    async def plain_charge(request: Request) -> Response:
        calls.append(request.url.path)
        body = await request.body()
        effect_id = await _write_effect(await effects.get(), request)
        await _after_write(request)
        return _answer(request, effect_id, body)

    async def big(request: Request) -> Response:
        calls.append(request.url.path)
        size = int(request.query_params.get("size", "0"))
        return Response(b"x" * size, status_code=201, media_type="application/octet-stream")

    async def stream(request: Request) -> Response:
        calls.append(request.url.path)
        parts = int(request.query_params.get("parts", "3"))
        size = int(request.query_params.get("size", "10"))

        async def chunks() -> Any:
            for index in range(parts):
                yield bytes([0x61 + index % 26]) * size
                await asyncio.sleep(0)

        return StreamingResponse(chunks(), status_code=200, media_type="text/plain")

    async def with_background(request: Request) -> Response:
        # The response must reach the client before this task ends, already recorded.
        calls.append(request.url.path)
        tenant = request.headers.get("x-tenant")
        key = request.headers.get("idempotency-key")
        conn = await connection(request)
        await conn.execute(
            "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, 'handler')",
            tenant,
            key,
        )

        async def later() -> None:
            await asyncio.sleep(1.5)
            try:
                await connection(request)
                note = "background-had-transaction"
            except RuntimeError:
                note = "background"
            pool = await effects.get()
            await pool.execute(
                "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, $3)",
                tenant,
                key,
                note,
            )

        return Response(b"done", status_code=201, background=BackgroundTask(later))

    async def tx_name(request: Request) -> Response:
        # The common pattern: insert, and answer 409 when the row already exists. The failed
        # INSERT leaves the request's transaction aborted.
        calls.append(request.url.path)
        tenant = request.headers.get("x-tenant")
        name = (await request.body()).decode()
        conn = await connection(request)
        await conn.execute(
            "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, $3)",
            tenant,
            request.headers.get("idempotency-key"),
            request.url.path,
        )
        try:
            await conn.execute("INSERT INTO names (tenant, name) VALUES ($1, $2)", tenant, name)
        except asyncpg.UniqueViolationError:
            if request.url.path == "/tx/name-swallowed":
                # Carries on as if nothing happened: a success about writes that are gone.
                return Response(b'{"created": true}', status_code=201)
            return Response(b'{"error": "exists"}', status_code=409)
        return Response(orjson.dumps({"created": name}), status_code=201)

    async def tx_settings(request: Request) -> Response:
        # A handler that sets up its own transaction first, as real ones do: an isolation
        # level (x-isolation), READ ONLY (x-read-only: it writes nothing then), or a schema of
        # the tenant's (x-search-path). The values come from the tests only.
        calls.append(request.url.path)
        body = await request.body()
        conn = await connection(request)
        if request.headers.get("x-isolation"):
            await conn.execute(f"SET TRANSACTION ISOLATION LEVEL {request.headers['x-isolation']}")
        if request.headers.get("x-read-only"):
            await conn.execute("SET TRANSACTION READ ONLY")
            effect_id = await conn.fetchval("SELECT count(*) FROM effects")
        else:
            if request.headers.get("x-search-path"):
                await conn.execute(f"SET LOCAL search_path = {request.headers['x-search-path']}")
            effect_id = await _write_effect(conn, request)
        await _after_write(request, conn)
        return _answer(request, effect_id, body)

    async def tx_isolation(request: Request) -> Response:
        # Writes, and answers with the isolation level its transaction runs at.
        calls.append(request.url.path)
        conn = await connection(request)
        effect_id = await _write_effect(conn, request)
        level = await conn.fetchval("SHOW transaction_isolation")
        name = await conn.fetchval("SHOW application_name")
        answer = {"effect_id": effect_id, "isolation": level, "application_name": name}
        return Response(orjson.dumps(answer), 201)

    async def tx_third_party(request: Request) -> Response:
        # Writes, then its own call to another service fails: not the database's failure.
        calls.append(request.url.path)
        conn = await connection(request)
        await conn.execute(
            "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, $3)",
            request.headers.get("x-tenant"),
            request.headers.get("idempotency-key"),
            request.url.path,
        )
        raise ConnectionRefusedError(111, "the card network refused the connection")

    async def plain_background(request: Request) -> Response:
        # Plain mode: the handler never asks for the connection, its background task does.
        tenant = request.headers.get("x-tenant")
        key = request.headers.get("idempotency-key")

        async def later() -> None:
            try:
                conn = await connection(request)
                await conn.execute(
                    "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, $3)",
                    tenant,
                    key,
                    "background-wrote-through-the-transaction",
                )
                note = "background-had-transaction"
            except Exception as exc:
                note = f"background-refused:{type(exc).__name__}"
            pool = await effects.get()
            await pool.execute(
                "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, $3)",
                tenant,
                key,
                note,
            )

        return Response(b"accepted", status_code=202, background=BackgroundTask(later))

    async def fan_out(request: Request) -> Response:
        # A handler that calls out through a task group, as handlers that fan out do: what a
        # child raises reaches the middleware inside an exception group.
        calls.append(request.url.path)
        kind = request.headers.get("x-group", "")

        async def child() -> None:
            if kind == "store":
                await _write_effect(await connection(request), request)
            else:
                await _write_effect(await effects.get(), request)
            await asyncio.sleep(0.05)
            if kind == "unknown":
                raise OutcomeUnknown("the provider did not answer in time")
            if kind == "error":
                raise RuntimeError("the provider refused")

        async def sibling() -> None:
            await asyncio.sleep(0.2)

        if kind == "unknown-and-cancelled":
            # As a group that also carries a child's cancellation does (trio-style): the
            # request itself is not being cancelled, so it is answered.
            await child()
            error = OutcomeUnknown("the provider did not answer in time")
            raise BaseExceptionGroup("fan-out", [asyncio.CancelledError(), error])
        if request.headers.get("x-group-lib") == "anyio" or not hasattr(asyncio, "TaskGroup"):
            async with anyio.create_task_group() as group:
                group.start_soon(child)
                group.start_soon(sibling)
        else:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(child())
                tasks.create_task(sibling())
        return Response(b"fanned out", status_code=201)

    async def moved(request: Request) -> Response:
        # A route that moved: a 308 (or ?status=) to where it is now, the path without -old.
        calls.append(request.url.path)
        status = int(request.query_params.get("status", "308"))
        return RedirectResponse(request.url.path.removesuffix("-old"), status_code=status)

    async def read(request: Request) -> Response:
        return Response(b"read", media_type="text/plain")

    async def tx_touch(request: Request) -> Response:
        # In the request's transaction, and runs no statement of its own: whatever conflicts
        # its transaction meets are the store's own statements'.
        calls.append(request.url.path)
        await connection(request)
        return Response(b'{"touched": true}', status_code=201)

    app = Starlette(
        routes=[
            Route("/tx/charge", tx_charge, methods=["POST", "PATCH"]),
            Route("/tx/other", tx_charge, methods=["POST"]),
            Route("/plain/charge", plain_charge, methods=["POST", "PATCH"]),
            Route("/tx/orders", tx_charge, methods=["POST"]),
            Route("/plain/orders", plain_charge, methods=["POST"]),
            Route("/tx/orders-old", moved, methods=["POST"]),
            Route("/plain/orders-old", moved, methods=["POST"]),
            Route("/plain/optional", plain_charge, methods=["POST"]),
            Route("/exempt/hook", plain_charge, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/background", with_background, methods=["POST"]),
            Route("/plain/background", plain_background, methods=["POST"]),
            Route("/tx/name", tx_name, methods=["POST"]),
            Route("/tx/name-swallowed", tx_name, methods=["POST"]),
            Route("/tx/third-party", tx_third_party, methods=["POST"]),
            Route("/tx/settings", tx_settings, methods=["POST"]),
            Route("/tx/isolation", tx_isolation, methods=["POST"]),
            Route("/tx/touch", tx_touch, methods=["POST"]),
            Route("/fan-out", fan_out, methods=["POST"]),
            Route("/read", read, methods=["GET"]),
        ],
        lifespan=lambda app: _closing(effects, pool),
    )
    if modes.atomic() and "atomic" not in options:
        options["atomic"] = modes.transactional_routes
    if cors == "inside":
        app.add_middleware(CORSMiddleware, **CORS_OPTIONS)
    if wrapped:
        return IdempotencyMiddleware(app, store=store, tenant=tenant, **options)
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        tenant=tenant,
        **options,
    )
    if cors == "outside":
        app.add_middleware(CORSMiddleware, **CORS_OPTIONS)
    return app


#: The CORS the test apps get when asked: two origins a browser front end may call from.
CORS_OPTIONS: dict[str, Any] = {
    "allow_origins": ["https://shop.example", "https://admin.example"],
    "allow_methods": ["POST"],
    "allow_headers": ["Idempotency-Key", "Content-Type", "X-Tenant"],
    "expose_headers": ["Idempotent-Replayed", "Retry-After"],
}


#: The transactional modes a test may run a handler in: the store on its own connections
#: (atomic or two-phase), or made from the application's pool of 4 (atomic).
MODES = ("atomic", "atomic-app-pool", "transactional")


def app_in_mode(dsn: str, mode: str, **options: Any) -> Any:
    """`build_app` in one of `MODES`."""
    pool = AppPool(dsn, 4) if mode == "atomic-app-pool" else None
    store = PostgresStore(pool, timeout=2.0) if pool else None
    return build_app(dsn, store=store, app_pool=pool, atomic=mode != "transactional", **options)


def _from_environment() -> Any:
    # For `uvicorn tests.apps:app` in the wire-level tests: TEST_APP_OPTIONS holds more
    # middleware options as JSON, TEST_STORE_OPTIONS the store's (DATABASE_URL is the
    # store's; STORE_DATABASE_URL, when set, is the store's instead); TEST_APP_WRAPPED=1 wraps
    # the app in the middleware rather than adding it.
    dsn = os.environ.get("DATABASE_URL", "")
    lease = float(os.environ.get("IDEMPOTENCY_LEASE_SECONDS", "10"))
    options = orjson.loads(os.environ.get("TEST_APP_OPTIONS", "{}"))
    store_options = orjson.loads(os.environ.get("TEST_STORE_OPTIONS", "{}"))
    # TEST_APP_POOL_SIZE: the store is made from an application's pool of that many.
    size = os.environ.get("TEST_APP_POOL_SIZE")
    store, pool = default_store(
        os.environ.get("STORE_DATABASE_URL", dsn),
        None if size is None else int(size),
        **store_options,
    )
    wrapped = os.environ.get("TEST_APP_WRAPPED") == "1"
    cors = os.environ.get("TEST_APP_CORS")  # outside or inside (see build_app)
    return build_app(
        dsn,
        store=store,
        app_pool=pool,
        lease_seconds=lease,
        wrapped=wrapped,
        cors=cors,
        **options,
    )


if os.environ.get("TEST_APP_SERVE"):
    batching.install()
    app = _from_environment()
else:
    app = None
