"""A FastAPI app whose handlers write through SQLAlchemy sessions, for the tests.

Every write is a row of `sa_orders` (an ORM model) or `sa_heroes` (a SQLModel table), tagged
with the tenant and the key, so tests count how many times a handler really wrote. Request
headers steer the handlers:

    x-tenant          the tenant (no header: unauthenticated)
    x-then            what the handler does after adding its row: `flush-raise` (flush, then
                      raise), `commit-raise` (commit, then raise), `commit` (commit), `flush`
                      (flush only), `nothing` (neither: the row is never sent)
    x-delay-ms        sleep this long after the write (flushed), before answering
    x-status          answer with this status
    x-sqlstate        (`/orders/sqlstate`) the SQLSTATE the database raises after the commit
    x-option          (`/orders/option`) an execution option the session asks for, `name=value`

`uvicorn tests.sqlalchemy_apps:app` serves it with DATABASE_URL, TEST_SA_ATOMIC=1 for the
atomic mode, and IDEMPOTENCY_LEASE_SECONDS.
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from sqlalchemy import String, func, select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlmodel import Field, SQLModel
from starlette.background import BackgroundTask
from starlette.types import Scope

import idempotency_asgi.sqlalchemy
from idempotency_asgi import IdempotencyMiddleware, PostgresStore, TransactionEnded, connection
from idempotency_asgi.fastapi import Connection, Session
from idempotency_asgi.sqlalchemy import request_session

TABLES = """
CREATE TABLE IF NOT EXISTS sa_orders (
    id bigserial PRIMARY KEY,
    tenant text NOT NULL,
    idempotency_key text,
    note text NOT NULL,
    details jsonb NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS sa_heroes (
    id bigserial PRIMARY KEY,
    tenant text NOT NULL,
    name text NOT NULL
);
"""


#: The same session, its dependency cleaned up before the response is sent (FastAPI 0.121+).
FunctionScoped = Annotated[AsyncSession, Depends(request_session, scope="function")]


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sa_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant: Mapped[str] = mapped_column(String)
    idempotency_key: Mapped[str | None] = mapped_column(String)
    note: Mapped[str] = mapped_column(String)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, default=dict)


class Hero(SQLModel, table=True):
    __tablename__ = "sa_heroes"

    id: int | None = Field(default=None, primary_key=True)
    tenant: str
    name: str


def tenant_from_header(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-tenant":
            return value.decode()
    return None


def build_app(dsn: str, *, store: PostgresStore | None = None, **options: Any) -> FastAPI:
    app = FastAPI()
    #: Sessions the handlers kept (`/keep`), for tests of what they may do afterwards.
    app.state.kept = []

    def order(request: Request, note: str) -> Order:
        return Order(
            tenant=request.headers.get("x-tenant", ""),
            idempotency_key=request.headers.get("idempotency-key"),
            note=note,
            details={"note": note, "nested": {"n": 1}},
        )

    @app.post("/orders", status_code=201)
    async def create_order(request: Request, session: Session) -> Any:
        made = order(request, "order")
        session.add(made)
        then = request.headers.get("x-then", "commit")
        if then in ("flush", "flush-raise"):
            await session.flush()
        elif then in ("commit", "commit-raise"):
            await session.commit()
        delay = request.headers.get("x-delay-ms")
        if delay:
            await asyncio.sleep(int(delay) / 1000)
        if then.endswith("-raise"):
            raise RuntimeError(f"the handler failed after its {then.split('-')[0]}")
        status = int(request.headers.get("x-status", "201"))
        return JSONResponse({"id": made.id, "details": made.details}, status_code=status)

    @app.post("/orders/sqlstate", status_code=201)
    async def sqlstate(request: Request, session: Session) -> Any:
        # The database fails a statement of the session's after its commit; the error reaches
        # the middleware as SQLAlchemy wraps it (DBAPIError, its cause the driver's error).
        session.add(order(request, "order"))
        await session.commit()
        code = request.headers.get("x-sqlstate")
        if code:
            await session.execute(
                text(f"DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '{code}'; END $$")
            )
        return {"committed": True}

    @app.post("/orders/option", status_code=201)
    async def option(request: Request, session: Session) -> Any:
        # Asks for a connection with an execution option, then writes its row either way.
        name, _, value = request.headers["x-option"].partition("=")
        options = {name: {"true": True, "false": False}.get(value, value)}
        try:
            await session.connection(execution_options=options)
        except TransactionEnded as exc:
            refused: str | None = str(exc)
        else:
            refused = None
        session.add(order(request, "order"))
        await session.commit()
        return {"refused": refused}

    @app.post("/orders/refused", status_code=201)
    async def refused(request: Request, session: Session) -> Any:
        # A 4xx raised after a commit and a flush: the dependency rolls the session back to
        # its commit before the 409 is made; the 409 is recorded with what was committed.
        session.add(order(request, "committed"))
        await session.commit()
        session.add(order(request, "flushed"))
        await session.flush()
        raise HTTPException(409, "refused after a commit and a flush")

    @app.post("/orders/function-scope", status_code=201)
    async def function_scope(request: Request, session: FunctionScoped) -> Any:
        # The dependency's cleanup runs before the response is sent, not after.
        session.add(order(request, "function-scope"))
        await session.flush()
        if request.headers.get("x-then") == "refuse":
            raise HTTPException(409, "refused after a flush")
        return {"flushed": True}

    @app.post("/orders/savepoints", status_code=201)
    async def savepoints(request: Request, session: Session) -> Any:
        # Kept: committed. Undone: flushed, then rolled back. Kept too: written after.
        session.add(order(request, "kept"))
        await session.commit()
        session.add(order(request, "undone"))
        await session.flush()
        await session.rollback()
        session.add(order(request, "after"))
        await session.commit()
        notes = await session.scalars(
            select(Order.note)
            .where(Order.idempotency_key == request.headers.get("idempotency-key"))
            .order_by(Order.id)
        )
        return {"notes": list(notes)}

    @app.post("/orders/mixed", status_code=201)
    async def mixed(request: Request, session: Session, conn: Connection) -> Any:
        # One transaction: each sees what the other wrote, before anything commits.
        key = request.headers.get("idempotency-key")
        tenant = request.headers.get("x-tenant", "")
        await conn.execute(
            "INSERT INTO sa_orders (tenant, idempotency_key, note) VALUES ($1, $2, 'raw')",
            tenant,
            key,
        )
        seen_by_session = await session.scalar(
            select(func.count()).select_from(Order).where(Order.idempotency_key == key)
        )
        session.add(order(request, "orm"))
        await session.commit()
        seen_by_conn = await conn.fetchval(
            "SELECT count(*) FROM sa_orders WHERE idempotency_key = $1", key
        )
        return {"session_saw": seen_by_session, "connection_saw": seen_by_conn}

    @app.post("/orders/gathered", status_code=201)
    async def gathered(request: Request) -> Any:
        # Two first calls at once (a task group's children, say): one session for both.
        first, second = await asyncio.gather(
            idempotency_asgi.sqlalchemy.session(request),
            idempotency_asgi.sqlalchemy.session(request),
        )
        first.add(order(request, "gathered"))
        await first.commit()
        return {"same": first is second}

    @app.post("/heroes", status_code=201)
    async def create_hero(request: Request, session: Session) -> Hero:
        hero = Hero(tenant=request.headers.get("x-tenant", ""), name="Deadpond")
        session.add(hero)
        await session.commit()
        await session.refresh(hero)
        return hero

    @app.post("/json", status_code=201)
    async def jsonb(request: Request, conn: Connection) -> Any:
        # What the request's connection decodes jsonb to, and which server session it is.
        value = await conn.fetchval("""SELECT '{"a": 1}'::jsonb""")
        plain = await conn.fetchval("""SELECT '{"a": 1}'::json""")
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        return {"jsonb": type(value).__name__, "json": type(plain).__name__, "pid": pid}

    @app.post("/orders/json", status_code=201)
    async def order_json(request: Request, session: Session) -> Any:
        made = order(request, "json")
        session.add(made)
        await session.commit()
        details = await session.scalar(select(Order.details).where(Order.id == made.id))
        # A textual query is typed by its columns: untyped, jsonb comes back as text, as from
        # the raw connection (the dialect sets no codec).
        read = await session.scalar(text("""SELECT '{"b": 2}'::jsonb AS v""").columns(v=JSONB))
        untyped = await session.scalar(text("""SELECT '{"b": 2}'::jsonb"""))
        pid = await session.scalar(text("SELECT pg_backend_pid()"))
        return {"details": details, "read": read, "untyped": untyped, "pid": pid}

    @app.post("/keep", status_code=201)
    async def keep(request: Request, session: Session) -> Any:
        # Hands its session to a test, with a savepoint still open.
        session.add(order(request, "kept-session"))
        await session.flush()
        app.state.kept.append(session)
        return {"kept": True}

    @app.post("/keep-unclosed", status_code=201)
    async def keep_unclosed(request: Request) -> Any:
        # The same through idempotency_asgi.sqlalchemy.session(request), which nothing closes.
        session = await idempotency_asgi.sqlalchemy.session(request)
        session.add(order(request, "kept-session"))
        await session.flush()
        app.state.kept.append(session)
        return {"kept": True}

    @app.post("/background", status_code=202)
    async def background(request: Request, session: Session) -> Any:
        session.add(order(request, "handler"))
        await session.commit()
        notes: list[str] = []

        async def later() -> None:
            try:
                await connection(request)
            except TransactionEnded:
                notes.append("connection: ended")
            try:
                session.add(order(request, "background"))
                await session.commit()
            except TransactionEnded:
                notes.append("session: ended")
            app.state.kept.append(notes)

        return JSONResponse({"accepted": True}, status_code=202, background=BackgroundTask(later))

    @app.get("/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    app.add_middleware(
        IdempotencyMiddleware,
        store=store if store is not None else PostgresStore(dsn),
        tenant=tenant_from_header,
        **options,
    )
    return app


def _from_environment() -> FastAPI:
    return build_app(
        os.environ["DATABASE_URL"],
        atomic=os.environ.get("TEST_SA_ATOMIC") == "1",
        lease_seconds=float(os.environ.get("IDEMPOTENCY_LEASE_SECONDS", "10")),
    )


app = _from_environment() if os.environ.get("TEST_SA_SERVE") else None
