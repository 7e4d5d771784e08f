"""How a request's transaction ends when the application's own statements broke it, or when
its answer gives the key up: what the client hears, what is recorded, and that nothing after
the answer can use the transaction again. Real PostgreSQL, audited afterwards."""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idempotency_asgi import IdempotencyMiddleware, PostgresStore, connection
from tests.apps import tenant_from_header
from tests.helpers import assert_problem, client, effects, eventually, headers, key_row, new_key


def _app(schema: str, notes: list[str]) -> Starlette:
    async def broken(request: Request) -> Response:
        # Writes, then a statement of its own fails and it answers x-status: its
        # transaction is aborted and can no longer commit.
        conn = await connection(request)
        await conn.execute(
            "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, 'broken')",
            request.headers["x-tenant"],
            request.headers["idempotency-key"],
        )
        with contextlib.suppress(asyncpg.DivisionByZeroError):
            await conn.execute("SELECT 1 / 0")
        return Response(b"refused", status_code=int(request.headers["x-status"]))

    async def failing_with_later_work(request: Request) -> Response:
        await connection(request)  # transactional, then it fails: the key is given up

        async def later() -> None:
            try:
                await connection(request)
            except RuntimeError as exc:
                notes.append(type(exc).__name__)
            else:
                notes.append("opened a transaction after the answer")

        return Response(b"down", status_code=503, background=BackgroundTask(later))

    app = Starlette(
        routes=[
            Route("/broken", broken, methods=["POST"]),
            Route("/later", failing_with_later_work, methods=["POST"]),
        ]
    )
    app.add_middleware(
        IdempotencyMiddleware, store=PostgresStore(schema), tenant=tenant_from_header
    )
    return app


@pytest.mark.parametrize("status", [400, 404, 499])
async def test_a_4xx_from_a_broken_transaction_is_recorded_without_its_writes(
    schema, db, tenant, status
):
    key = new_key()
    async with client(_app(schema, [])) as http:
        first = await http.post(
            "/broken", content=b"{}", headers=headers(tenant, key, x_status=str(status))
        )
        retry = await http.post(
            "/broken", content=b"{}", headers=headers(tenant, key, x_status=str(status))
        )
    assert first.status_code == status and first.content == b"refused"
    assert "idempotency-key-expires" in first.headers
    assert retry.status_code == status and retry.headers["idempotent-replayed"] == "true"
    row = await key_row(db, tenant, key)
    assert row["state"] == "completed" and row["response_status"] == status
    assert await effects(db, tenant, key) == 0  # its write rolled back


@pytest.mark.parametrize("status", [201, 303, 399])
async def test_a_success_from_a_broken_transaction_is_a_500_and_frees_the_key(
    schema, db, tenant, status
):
    key = new_key()
    async with client(_app(schema, [])) as http:
        lie = await http.post(
            "/broken", content=b"{}", headers=headers(tenant, key, x_status=str(status))
        )
        assert await key_row(db, tenant, key) is None  # released: a retry runs afresh
    assert_problem(lie, 500, "transaction-failed")
    assert await effects(db, tenant, key) == 0


async def test_work_after_an_answer_that_gave_the_key_up_cannot_use_the_transaction(
    schema, db, tenant
):
    notes: list[str] = []
    key = new_key()

    async def scenario():
        async with client(_app(schema, notes)) as http:
            answer = await http.post("/later", content=b"{}", headers=headers(tenant, key))
            await eventually(lambda: asyncio.sleep(0, notes))
        return answer

    # Bounded: a transaction opened after the answer would never be given back, and would
    # keep the pool from closing at shutdown.
    try:
        answer = await asyncio.wait_for(scenario(), 20)
    except asyncio.TimeoutError:
        pytest.fail(f"the application did not shut down; the later work saw: {notes}")
    assert answer.status_code == 503
    assert await key_row(db, tenant, key) is None
    assert notes == ["TransactionEnded"]


async def test_a_serialization_failure_at_commit_is_a_503_to_retry_and_frees_the_key(
    schema, db, tenant
):
    # Two SERIALIZABLE requests each count the tenant's effects and add one (write skew):
    # both answer 201, and PostgreSQL lets only one of them commit.
    both_wrote = asyncio.Event()
    wrote: list[str] = []

    async def count_then_add(request: Request) -> Response:
        conn = await connection(request)
        await conn.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        await conn.fetchval("SELECT count(*) FROM effects WHERE tenant = $1", tenant)
        await conn.execute(
            "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, 'skew')",
            tenant,
            request.headers["idempotency-key"],
        )
        wrote.append(request.headers["idempotency-key"])
        if len(wrote) == 2:
            both_wrote.set()
        await asyncio.wait_for(both_wrote.wait(), 10)
        return Response(b"added", status_code=201)

    app = Starlette(routes=[Route("/skew", count_then_add, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=PostgresStore(schema), tenant=tenant_from_header
    )
    keys = [new_key(), new_key()]
    async with client(app) as http:
        answers = await asyncio.gather(
            *(http.post("/skew", content=b"{}", headers=headers(tenant, key)) for key in keys)
        )
        statuses = sorted(answer.status_code for answer in answers)
        loser = keys[[answer.status_code for answer in answers].index(503)]
        freed = await key_row(db, tenant, loser)
        both_wrote.set()  # the retry runs alone
        retry = await http.post("/skew", content=b"{}", headers=headers(tenant, loser))
    assert statuses == [201, 503]
    conflict = next(answer for answer in answers if answer.status_code == 503)
    assert_problem(conflict, 503, "transaction-conflict")
    assert conflict.headers["retry-after"] == "1"
    assert freed is None  # released: the retry may run at once
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert await effects(db, tenant) == 2  # the winner's and the retry's


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "two-phase"])
async def test_what_the_connection_made_cannot_run_after_the_transaction_ends(
    schema, db, tenant, atomic
):
    # A prepared statement, a cursor or a transaction object made from the request's
    # connection, kept for work after the answer: the connection has gone back (a pool of one
    # hands it to the next request at once), so each must refuse, never run in another
    # request's transaction.
    notes: list[str] = []
    done = asyncio.Event()
    insert = "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, $3)"

    async def keeps(request: Request) -> Response:
        conn = await connection(request)
        tenant, key = request.headers["x-tenant"], request.headers["idempotency-key"]
        statement = await conn.prepare(insert)
        await statement.fetchval(tenant, key, "in-the-request")
        cursor = conn.cursor("SELECT 1")
        savepoint = conn.transaction()

        async def later() -> None:
            await asyncio.sleep(0.3)  # the next request has the connection now
            attempts = {
                "statement": lambda: statement.fetchval(tenant, key, "after-the-answer"),
                "cursor": lambda: _first(cursor),
                "transaction": lambda: _inside(savepoint),
            }
            for name, attempt in attempts.items():
                try:
                    await attempt()
                except RuntimeError as exc:
                    notes.append(f"{name}:{type(exc).__name__}")
                else:
                    notes.append(f"{name}:ran")
            done.set()

        return Response(b"kept", status_code=201, background=BackgroundTask(later))

    async def other(request: Request) -> Response:
        await connection(request)
        await asyncio.sleep(0.6)
        return Response(b"other", status_code=201)

    app = Starlette(
        routes=[Route("/keeps", keeps, methods=["POST"]), Route("/other", other, methods=["POST"])]
    )
    store = PostgresStore(schema, min_size=1, max_size=1)
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant_from_header, atomic=atomic)
    key = new_key()
    async with client(app) as http:
        first = asyncio.create_task(
            http.post("/keeps", content=b"{}", headers=headers(tenant, key))
        )
        await asyncio.sleep(0.1)
        second = await http.post("/other", content=b"{}", headers=headers(tenant, new_key()))
        await first
        await asyncio.wait_for(done.wait(), 10)
    assert second.status_code == 201
    assert notes == [
        "statement:TransactionEnded",
        "cursor:TransactionEnded",
        "transaction:TransactionEnded",
    ]
    paths = await db.fetch(
        "SELECT path FROM effects WHERE tenant = $1 AND idempotency_key = $2", tenant, key
    )
    assert [row["path"] for row in paths] == ["in-the-request"]


async def _first(cursor) -> None:
    async for _ in cursor:
        return


async def _inside(transaction) -> None:
    async with transaction:
        pass
