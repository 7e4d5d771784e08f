"""A FastAPI application as teams write them, behind IdempotencyMiddleware: SQLAlchemy models
and an `after_commit` listener that sends the e-mails, raw asyncpg beside it, an event
stream, a slow route, and a handler that kept its own session beside the library's.

Every business write is a row of `real_orders`; every e-mail "sent" (by the session's
`after_commit` listener, or by `idempotency_asgi.after_commit`) a row of `real_emails`,
written on the application's own pool, outside any request's transaction: tests count both.

    x-tenant     the tenant (no header: unauthenticated)
    x-then       what a handler does after its write: `commit` (the session's, the default),
                 `commit-503` (commit, then answer 503), `commit-begin-raise` and
                 `commit-begin-502` (send COMMIT, then BEGIN, then raise or answer 502)
    x-delay-ms   sleep this long after the write, before answering
    x-ticks      /stream: how many events (default: until the client leaves)

`uvicorn tests.real_app:app` serves it with DATABASE_URL; REAL_ATOMIC=1 for the atomic mode,
REAL_POOL=N for a store made from the application's pool of N connections (else a DSN),
REAL_IDLE_SECONDS for `transaction_idle_seconds`, REAL_TIMEOUT for the store's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import anyio
import asyncpg
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy import String, event, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore, after_commit
from idempotency_asgi.fastapi import Connection
from idempotency_asgi.fastapi import Session as RequestSession

TABLES = """
CREATE TABLE IF NOT EXISTS real_orders (
    id bigserial PRIMARY KEY,
    tenant text NOT NULL,
    idempotency_key text,
    note text NOT NULL
);
CREATE TABLE IF NOT EXISTS real_emails (
    id bigserial PRIMARY KEY,
    tenant text NOT NULL,
    idempotency_key text,
    what text NOT NULL
);
CREATE TABLE IF NOT EXISTS real_accounts (
    tenant text PRIMARY KEY,
    balance bigint NOT NULL DEFAULT 0
);
"""


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "real_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant: Mapped[str] = mapped_column(String)
    idempotency_key: Mapped[str | None] = mapped_column(String)
    note: Mapped[str] = mapped_column(String)


def tenant_from_header(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-tenant":
            return value.decode()
    return None


def build_app(dsn: str) -> FastAPI:
    pool_size = int(os.environ.get("REAL_POOL", "0"))
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The application's own pool: its e-mails, and (REAL_POOL) the store's.
        state["pool"] = await asyncpg.create_pool(dsn, min_size=1, max_size=pool_size or 2)
        state["mail"] = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
        url = "postgresql+asyncpg://" + dsn.split("://", 1)[1]
        state["engine"] = create_async_engine(url, pool_size=2)
        try:
            yield
        finally:
            await state["engine"].dispose()
            await state["mail"].close()
            await state["pool"].close()

    app = FastAPI(lifespan=lifespan)

    async def send(tenant: str, key: str | None, what: str) -> None:
        await state["mail"].execute(
            "INSERT INTO real_emails (tenant, idempotency_key, what) VALUES ($1, $2, $3)",
            tenant,
            key,
            what,
        )

    # The usual place an application sends its e-mails: once its session's transaction has
    # committed, whatever session that is.
    @event.listens_for(Session, "after_commit")
    def send_emails(session: Session) -> None:
        for tenant, key, what in session.info.pop("emails", []):
            asyncio.get_running_loop().create_task(send(tenant, key, what))

    def order(request: Request, note: str) -> Order:
        return Order(
            tenant=request.headers.get("x-tenant", ""),
            idempotency_key=request.headers.get("idempotency-key"),
            note=note,
        )

    def then(request: Request) -> str:
        return request.headers.get("x-then", "commit")

    async def delay(request: Request) -> None:
        pause = request.headers.get("x-delay-ms")
        if pause:
            await asyncio.sleep(int(pause) / 1000)

    @app.post("/orders", status_code=201)
    async def create_order(request: Request, session: RequestSession) -> Any:
        made = order(request, "order")
        session.add(made)
        session.info.setdefault("emails", []).append(
            (made.tenant, made.idempotency_key, "confirmation")
        )
        step = then(request)
        await session.commit()
        if step.startswith("commit-begin"):
            await session.execute(text("COMMIT"))
            await session.execute(text("BEGIN"))
        await delay(request)
        if step.endswith("-raise"):
            raise RuntimeError("the handler failed after its commit")
        if step == "commit-503":
            return JSONResponse({"error": "provider down"}, status_code=503)
        if step.endswith("-502"):
            return JSONResponse({"error": "bad gateway"}, status_code=502)
        return {"id": made.id}

    @app.post("/raw", status_code=201)
    async def raw(request: Request, conn: Connection) -> Any:
        tenant = request.headers.get("x-tenant", "")
        key = request.headers.get("idempotency-key")
        order_id = await conn.fetchval(
            "INSERT INTO real_orders (tenant, idempotency_key, note) VALUES ($1, $2, 'raw')"
            " RETURNING id",
            tenant,
            key,
        )
        after_commit(request, partial(send, tenant, key, "receipt"))
        step = then(request)
        if step.startswith("commit-begin"):
            await conn.execute("COMMIT; BEGIN")
        await delay(request)
        if step.endswith("-raise"):
            raise RuntimeError("the handler failed after its commit")
        if step.endswith("-502"):
            return JSONResponse({"error": "bad gateway"}, status_code=502)
        return {"id": order_id}

    @app.post("/stream")
    async def stream(request: Request, conn: Connection) -> StreamingResponse:
        tenant = request.headers.get("x-tenant", "")
        key = request.headers.get("idempotency-key")
        await conn.execute(
            "INSERT INTO real_orders (tenant, idempotency_key, note) VALUES ($1, $2, 'stream')",
            tenant,
            key,
        )
        ticks = int(request.headers.get("x-ticks", "0"))

        async def events() -> AsyncIterator[bytes]:
            sent = 0
            try:
                while not ticks or sent < ticks:
                    yield f"data: token {sent}\n\n".encode()
                    sent += 1
                    await asyncio.sleep(0.05)
            finally:
                # Whether it ran out or its client left: the application knows it stopped.
                # Starlette stops a stream whose client left by cancelling it, and an await
                # here would be cancelled too: shielded, as an application has to.
                with anyio.CancelScope(shield=True):
                    await send(tenant, key, f"stream stopped after {sent}")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def own_session() -> AsyncIterator[AsyncSession]:
        # The application's own session, as it was before the library: its own engine.
        async with async_sessionmaker(state["engine"], expire_on_commit=False)() as session:
            yield session

    @app.post("/accounts/credit", status_code=201)
    async def credit(
        request: Request,
        session: RequestSession,
        own: AsyncSession = Depends(own_session),  # noqa: B008 (FastAPI's way)
    ) -> Any:
        # The most likely mistake when migrating: the library's session and the old one,
        # both writing the same row. The old one waits for the request's transaction.
        tenant = request.headers.get("x-tenant", "")
        await session.execute(
            text("UPDATE real_accounts SET balance = balance + 1 WHERE tenant = :t"),
            {"t": tenant},
        )
        await session.commit()
        await own.execute(
            text("UPDATE real_accounts SET balance = balance + 100 WHERE tenant = :t"),
            {"t": tenant},
        )
        await own.commit()
        return {"credited": True}

    @app.post("/slow", status_code=201)
    async def slow(request: Request, conn: Connection) -> Any:
        await conn.execute(
            "INSERT INTO real_orders (tenant, idempotency_key, note) VALUES ($1, $2, 'slow')",
            request.headers.get("x-tenant", ""),
            request.headers.get("idempotency-key"),
        )
        await delay(request)
        return {"done": True}

    @app.get("/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    atomic = os.environ.get("REAL_ATOMIC") == "1"
    timeout = float(os.environ.get("REAL_TIMEOUT", "2"))
    store = (
        PostgresStore(lambda: state["pool"], timeout=timeout)
        if pool_size
        else PostgresStore(dsn, timeout=timeout)
    )
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        tenant=tenant_from_header,
        atomic=atomic,
        transaction_idle_seconds=float(os.environ.get("REAL_IDLE_SECONDS", "20")),
        lease_seconds=float(os.environ.get("IDEMPOTENCY_LEASE_SECONDS", "10")),
    )
    return app


app = build_app(os.environ["DATABASE_URL"]) if os.environ.get("REAL_APP_SERVE") else None
