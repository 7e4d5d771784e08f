"""The payments API. `uvicorn examples.payments.app:app` with DATABASE_URL set."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any

import asyncpg
import orjson
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, Field
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from idempotency_asgi.fastapi import Connection, idempotent_route
from idempotency_asgi.maintenance import BackgroundMaintenance, Reaper, Sweeper

from .schema import bring_up_to_date
from .settings import Settings
from .worker import running

DECLINE_ABOVE = 1_000_000
PROBLEM_BASE = "urn:payments-example:problem:"


def storable(text: str) -> str:
    """Text PostgreSQL can hold: no NUL, no lone surrogate (JSON can carry both)."""
    if "\x00" in text:
        raise ValueError("must not contain NUL")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode") from None
    return text


class PaymentIn(BaseModel):
    # Strict: `true`, `"100"` and `100.0` are not amounts in cents (lax parsing took all three).
    amount: int = Field(gt=0, strict=True, description="amount in minor units (cents)")
    currency: str = Field(pattern=r"^[A-Za-z]{3}$")
    customer_id: Annotated[str, AfterValidator(storable)] = Field(min_length=1, max_length=255)


class PaymentOut(BaseModel):
    id: str
    amount: int
    currency: str
    customer_id: str
    status: str
    created_at: datetime


def bearer_tenant(tokens: dict[str, str]) -> Any:
    def resolve(scope: Scope) -> str | None:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return tokens.get(token.strip())
        return None

    return resolve


def current_tenant(request: Request) -> str:
    found: str | None = request.app.state.resolve_tenant(request.scope)
    if found is None:
        raise HTTPException(
            401, "missing or unknown bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
    return found


Tenant = Annotated[str, Depends(current_tenant)]


def problem(status: int, name: str, title: str, detail: str, **extra: Any) -> Response:
    body = {
        "type": PROBLEM_BASE + name,
        "title": title,
        "status": status,
        "detail": detail,
        **extra,
    }
    # The standard library's encoder: an amount past 64 bits is echoed too (orjson refuses it).
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return Response(text.encode(), status_code=status, media_type="application/problem+json")


def json_safe(value: Any) -> Any:
    """`value` as JSON can carry it: what a validation error echoes of the input may be NaN,
    an infinity or a string with a lone surrogate, which the default 422 could not render."""
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return json_safe(str(value))


async def invalid_request(request: Request, exc: Exception) -> Response:
    """FastAPI's 422, the same shape, for any input at all."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": json_safe(exc.errors())}, status_code=422)


def _row(row: Any) -> dict[str, Any]:
    # Every endpoint renders a payment through here, so created_at has one format everywhere.
    return {
        "id": row["id"],
        "amount": row["amount"],
        "currency": row["currency"],
        "customer_id": row["customer_id"],
        "status": row["status"],
        "created_at": row["created_at"].isoformat(),
    }


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_environment()
    resolve_tenant = bearer_tenant(settings.tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=10)
        async with pool.acquire() as conn:
            await bring_up_to_date(conn, settings.database_url)
        app.state.pool = pool
        try:
            async with contextlib.AsyncExitStack() as stack:
                if settings.outbox_worker:
                    await stack.enter_async_context(running(pool, settings.downstream_url))
                yield
        finally:
            await pool.close()

    app = FastAPI(title="Payments (idempotency-asgi example)", lifespan=lifespan)
    app.state.resolve_tenant = resolve_tenant
    app.add_exception_handler(RequestValidationError, invalid_request)

    @app.post("/payments", response_model=PaymentOut, **idempotent_route(status_code=201))
    async def create_payment(
        payment: PaymentIn, request: Request, tenant: Tenant, conn: Connection
    ) -> Any:
        if payment.amount > DECLINE_ABOVE:
            return problem(
                402,
                "card-declined",
                "Payment declined",
                f"Amounts above {DECLINE_ABOVE} are declined.",
                amount=payment.amount,
            )
        payment_id = "pay_" + secrets.token_hex(12)
        key = request.headers["idempotency-key"]
        row = await conn.fetchrow(
            "INSERT INTO payments (id, tenant_id, amount, currency, customer_id, status,"
            " idempotency_key) VALUES ($1, $2, $3, $4, $5, 'succeeded', $6)"
            " RETURNING id, amount, currency, customer_id, status, created_at",
            payment_id,
            tenant,
            payment.amount,
            payment.currency.upper(),
            payment.customer_id,
            key,
        )
        body = _row(row)
        await conn.execute(
            "INSERT INTO outbox (tenant_id, payment_id, event_type, idempotency_key, payload)"
            " VALUES ($1, $2, 'payment.succeeded', $3, $4)",
            tenant,
            payment_id,
            key,
            orjson.dumps({"type": "payment.succeeded", "tenant_id": tenant, "payment": body}),
        )
        if settings.fault_injection:
            delay = request.headers.get("x-fault-delay-ms")
            if delay and delay.isascii() and delay.isdigit():
                await asyncio.sleep(int(delay) / 1000)
            if request.headers.get("x-fault-status") == "500":
                return problem(
                    500,
                    "injected-fault",
                    "Injected failure",
                    "X-Fault-Status asked for a 500 after the write.",
                )
        return JSONResponse(body, status_code=201)

    @app.get("/payments/{payment_id}", response_model=PaymentOut)
    async def get_payment(payment_id: str, request: Request, tenant: Tenant) -> Any:
        try:
            storable(payment_id)
        except ValueError:
            raise HTTPException(404, "no such payment") from None  # no id holds a NUL
        row = await request.app.state.pool.fetchrow(
            "SELECT * FROM payments WHERE tenant_id = $1 AND id = $2", tenant, payment_id
        )
        if row is None:
            raise HTTPException(404, "no such payment")
        return JSONResponse(_row(row))

    @app.get("/payments")
    async def list_payments(
        request: Request,
        tenant: Tenant,
        customer_id: Annotated[str, AfterValidator(storable)] | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> Any:
        rows = await request.app.state.pool.fetch(
            "SELECT * FROM payments WHERE tenant_id = $1"
            " AND ($2::text IS NULL OR customer_id = $2)"
            " ORDER BY created_at DESC, id DESC LIMIT $3",
            tenant,
            customer_id,
            limit,
        )
        return JSONResponse({"data": [_row(row) for row in rows]})

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        # The address uvicorn prints: a reader who opens it lands on the API's own page.
        return RedirectResponse("/docs")

    @app.get("/healthz")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    store = PostgresStore(settings.database_url)
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        tenant=resolve_tenant,
        www_authenticate="Bearer",
        # Reaper and sweeper in the background, one runner among all workers.
        maintenance=BackgroundMaintenance(Reaper(store), Sweeper(store)),
        required_paths=["/payments"],
        # POST /payments, the one keyed route: the key's claim, the payment, its outbox
        # event and the key's record in one transaction, one COMMIT. Every effect goes
        # through the connection; the provider is called after COMMIT, from the outbox.
        atomic=True,
        lease_seconds=settings.lease_seconds,
        ttl_seconds=settings.ttl_seconds,
    )
    return app


def __getattr__(name: str) -> Any:
    # `uvicorn examples.payments.app:app` builds the app from the environment on first use,
    # so importing this module (in tests, say) needs no DATABASE_URL.
    if name == "app":
        application = create_app()
        globals()["app"] = application
        return application
    raise AttributeError(name)
