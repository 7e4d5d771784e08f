"""The application under the fuzz (tests/test_fuzz.py): it echoes what it received.

It never answers 5xx on its own, so any 5xx a client sees is the middleware's. Each run gets a
fresh run id, returned in the body and kept in memory per tenant (one uvicorn worker), so the
tests can tell a replay (the stored run id) from a second run, and count runs with
`GET /_runs/{tenant}` (a GET: the middleware lets it through).

    x-tenant    the tenant (fresh per example, so no example sees another's keys)
    x-status    the status to answer with (default 201)
"""

from __future__ import annotations

import hashlib
import os
import uuid

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore, connection

ECHO_PATHS = ("/echo", "/echo/other", "/tx/echo")
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def tenant_from_header(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-tenant":
            return value.decode("latin-1")
    return None


def build_app(dsn: str) -> Starlette:
    runs: dict[str, list[str]] = {}

    async def echo(request: Request) -> Response:
        body = await request.body()
        if request.url.path.startswith("/tx/"):
            # The transactional mode: the handler's statement shares the key's transaction.
            try:
                conn = await connection(request)
            except RuntimeError:
                conn = None  # not a keyed request (a method the middleware does not cover)
            if conn is not None:
                await conn.fetchval("SELECT 1")
        run = uuid.uuid4().hex
        runs.setdefault(request.headers.get("x-tenant", ""), []).append(run)
        payload = {
            "run": run,
            "method": request.method,
            "path": request.url.path,
            "query": request.scope["query_string"].decode("latin-1"),
            "content_type": request.headers.get("content-type"),
            "sha256": hashlib.sha256(body).hexdigest(),
            "length": len(body),
        }
        status = int(request.headers.get("x-status", "201"))
        response = Response(
            orjson.dumps(payload), status_code=status, media_type="application/json"
        )
        response.headers["x-run"] = run
        response.set_cookie("session", run)  # never replayed: a session is for one caller
        return response

    async def run_ids(request: Request) -> Response:
        return Response(orjson.dumps(runs.get(request.path_params["tenant"], [])))

    routes = [Route(path, echo, methods=METHODS) for path in ECHO_PATHS]
    app = Starlette(routes=[*routes, Route("/_runs/{tenant}", run_ids, methods=["GET"])])
    app.add_middleware(IdempotencyMiddleware, store=PostgresStore(dsn), tenant=tenant_from_header)
    return app


# For `uvicorn tests.fuzz_app:app`, started by the fuzz suite with DATABASE_URL set.
if os.environ.get("FUZZ_APP_SERVE"):
    from tests import batching

    batching.install()
    app = build_app(os.environ["DATABASE_URL"])
else:
    app = None
