"""The reconciliation job of docs/reconciling.md (examples/payments/settle_held.py), run as a
command against the fake provider under uvicorn: a charge whose answer timed out is settled
with the answer the handler would have given, a charge that never reached the provider is
released and runs once on its retry. The handler's runs and the provider's books are counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator

import asyncpg
import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, OutcomeUnknown, PostgresStore, migrate
from tests.helpers import assert_problem, client, fresh_database, new_key
from tests.server import ROOT, UvicornProcess

TENANT = "acme"


def charging_app(dsn: str, provider: str, timeout: float, calls: list[str]) -> Starlette:
    """A handler that charges the provider inline: a timeout after the request was sent is
    an unknown outcome."""

    async def charge(request: Request) -> Response:
        calls.append(request.headers["idempotency-key"])
        payment = await request.json()
        key = f"{TENANT}:{request.headers['idempotency-key']}"
        event = {"tenant_id": TENANT, "payment": {**payment, "id": "pay_" + key[-8:]}}
        try:
            async with httpx.AsyncClient(base_url=provider, timeout=timeout) as http:
                answer = await http.post("/charges", json=event, headers={"Idempotency-Key": key})
        except httpx.ReadTimeout as exc:
            raise OutcomeUnknown("the provider did not answer in time") from exc
        if answer.status_code not in (200, 201):
            return Response(b"provider failed", status_code=502)
        body = orjson.dumps({"charge_id": answer.json()["charge_id"], "status": "succeeded"})
        return Response(body, status_code=201, media_type="application/json")

    def tenant(scope: Scope) -> str | None:
        return TENANT

    app = Starlette(routes=[Route("/charges", charge, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=PostgresStore(dsn), tenant=tenant, lease_seconds=30
    )
    return app


@contextlib.asynccontextmanager
async def black_hole() -> AsyncIterator[str]:
    """A provider that takes the request and never answers: nothing is booked."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read(65536)

    hole = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = hole.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for writer in held:
            writer.close()
        hole.close()


async def run_job(dsn: str, provider: str) -> subprocess.CompletedProcess[str]:
    """`python -m examples.payments.settle_held`, as a cron job runs it (off the loop, which
    serves the black hole meanwhile)."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "examples.payments.settle_held", "--older-than", "0"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": dsn, "PROVIDER_URL": provider},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
async def books(schema) -> AsyncIterator[tuple[str, str]]:
    """A database of its own, and the fake provider on it (booking 600 ms after a request)."""
    async with fresh_database(schema) as dsn:
        await migrate(dsn)
        provider = UvicornProcess(
            "examples.payments.provider:app", {"DATABASE_URL": dsn, "PROVIDER_DELAY_MS": "600"}
        ).start(ready_path="/healthz")
        try:
            yield dsn, provider.url
        finally:
            provider.stop()


async def test_the_job_settles_a_booked_charge_and_releases_one_never_made(books):
    dsn, provider = books
    booked_key, lost_key = new_key(), new_key()
    calls: list[str] = []
    payment = {"amount": 1250, "currency": "EUR", "customer_id": "c1"}
    async with black_hole() as hole:
        first = charging_app(dsn, provider, 0.3, calls)
        cut = charging_app(dsn, hole, 0.3, calls)
        later = charging_app(dsn, provider, 5.0, calls)
        async with client(first) as a, client(cut) as b, client(later) as c:
            for http, key in ((a, booked_key), (b, lost_key)):
                unknown = await http.post(
                    "/charges", json=payment, headers={"idempotency-key": key}
                )
                assert_problem(unknown, 504, "outcome-unknown")
            await asyncio.sleep(0.8)  # the provider books the first one meanwhile
            held = await c.post("/charges", json=payment, headers={"idempotency-key": booked_key})
            assert_problem(held, 409, "request-in-progress")

            job = await run_job(dsn, provider)
            assert job.returncode == 0, job.stderr
            assert sorted(job.stdout.splitlines()) == [
                f"released {TENANT}:{lost_key}",
                f"settled {TENANT}:{booked_key}",
            ]

            settled = await c.post(
                "/charges", json=payment, headers={"idempotency-key": booked_key}
            )
            ran = await c.post("/charges", json=payment, headers={"idempotency-key": lost_key})
            again = await c.post("/charges", json=payment, headers={"idempotency-key": lost_key})

    conn = await asyncpg.connect(dsn)
    try:
        charges = {
            row["idempotency_key"]: row["id"]
            for row in await conn.fetch("SELECT idempotency_key, id FROM provider.charges")
        }
        counted = await conn.fetchval("SELECT count(*) FROM provider.charges")
    finally:
        await conn.close()
    # The booked charge: replayed as the handler would have answered it, never run again.
    assert settled.status_code == 201 and settled.headers["idempotent-replayed"] == "true"
    assert settled.json() == {"charge_id": charges[f"{TENANT}:{booked_key}"], "status": "succeeded"}
    assert calls.count(booked_key) == 1
    # The charge that never reached the provider: run once on its retry, then replayed.
    assert ran.status_code == 201 and "idempotent-replayed" not in ran.headers
    assert again.content == ran.content and again.headers["idempotent-replayed"] == "true"
    assert calls.count(lost_key) == 2  # the cut attempt, and the retry after the release
    assert ran.json()["charge_id"] == charges[f"{TENANT}:{lost_key}"]
    assert counted == 2  # one charge each: nobody was charged twice

    # Nothing is held any more: the job has nothing to do.
    rerun = await run_job(dsn, provider)
    assert (rerun.returncode, rerun.stdout) == (0, "")
