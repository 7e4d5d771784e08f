"""The request line in the fingerprint: the path as sent (its raw bytes: `/a%2Fb` is not `/a/b`,
though both decode alike), and the query string as sent. A key reused across them is 422."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from tests.apps import tenant_from_header
from tests.helpers import assert_problem, client, headers, key_row, new_key


def _app(schema: str, runs: list[str]) -> Starlette:
    async def upload(request: Request) -> Response:
        runs.append(request.scope.get("raw_path", b"").decode())
        return Response(request.path_params["name"].encode(), status_code=201)

    app = Starlette(routes=[Route("/files/{name:path}", upload, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=PostgresStore(schema), tenant=tenant_from_header
    )
    return app


async def test_an_escaped_slash_is_not_a_slash(schema, db, tenant):
    runs: list[str] = []
    key = new_key()
    async with client(_app(schema, runs)) as http:
        escaped = await http.post("/files/a%2Fb", content=b"x", headers=headers(tenant, key))
        plain = await http.post("/files/a/b", content=b"x", headers=headers(tenant, key))
        again = await http.post("/files/a%2Fb", content=b"x", headers=headers(tenant, key))
    assert escaped.status_code == 201
    assert_problem(plain, 422, "key-reused")
    assert again.headers["idempotent-replayed"] == "true"
    assert runs == ["/files/a%2Fb"]
    assert (await key_row(db, tenant, key))["path"] == "/files/a/b"  # read by a person


async def test_another_query_string_is_another_request(schema, db, tenant):
    runs: list[str] = []
    key = new_key()
    async with client(_app(schema, runs)) as http:
        first = await http.post("/files/r?v=1", content=b"x", headers=headers(tenant, key))
        other = await http.post("/files/r?v=2", content=b"x", headers=headers(tenant, key))
        same = await http.post("/files/r?v=1", content=b"x", headers=headers(tenant, key))
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")
    assert same.headers["idempotent-replayed"] == "true"
    assert len(runs) == 1
