"""A server that offers `http.response.pathsend` or `http.response.zerocopysend` lets an
application send a file without passing its bytes through http.response.body messages, and so
past the middleware, which must record every byte of a keyed response. The middleware hides
those two extensions from the application (and nothing else): a FileResponse then sends its
bytes as body messages, and they are recorded and replayed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from tests.apps import tenant_from_header
from tests.helpers import client, headers, key_row, new_key

HIDDEN = ("http.response.pathsend", "http.response.zerocopysend")
OFFERED = {**{name: {} for name in HIDDEN}, "http.response.trailers": {}}


def _server_with_extensions(app, calls):
    """What a server offering pathsend and zerocopysend does: it says so in the scope, and
    sends the file itself when an application asks it to."""

    async def serve(scope, receive, send):
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        scope = {**scope, "extensions": {**scope.get("extensions", {}), **OFFERED}}

        async def server_send(message):
            calls.append(message["type"])
            if message["type"] == "http.response.pathsend":
                body = await asyncio.to_thread(Path(message["path"]).read_bytes)
                message = {"type": "http.response.body", "body": body}
            await send(message)

        await app(scope, receive, server_send)

    return serve


@pytest.fixture
def receipt(tmp_path):
    path = tmp_path / "receipt.pdf"
    path.write_bytes(b"%PDF-1.7 receipt " + bytes(range(256)) * 40)
    return path


def _app(schema, receipt, **options):
    async def download(request: Request) -> Response:
        await request.body()
        response = FileResponse(receipt, media_type="application/pdf", status_code=201)
        # What the application was offered, for the test to see.
        response.headers["x-extensions"] = ",".join(sorted(request.scope.get("extensions", {})))
        return response

    app = Starlette(routes=[Route("/receipts", download, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=PostgresStore(schema), tenant=tenant_from_header, **options
    )
    return app


async def test_a_file_response_is_recorded_byte_for_byte_when_the_server_offers_pathsend(
    schema, db, tenant, receipt
):
    calls: list[str] = []
    app = _server_with_extensions(_app(schema, receipt), calls)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/receipts", content=b"{}", headers=headers(tenant, key))
        receipt.write_bytes(b"changed since")  # a replay is the record, not the file now
        replay = await http.post("/receipts", content=b"{}", headers=headers(tenant, key))
    assert first.status_code == 201
    assert first.content.startswith(b"%PDF-1.7 receipt")
    # The application was not offered the two extensions, and was offered the others.
    assert first.headers["x-extensions"] == "http.response.trailers"
    assert "http.response.pathsend" not in calls  # every byte went through the middleware
    row = await key_row(db, tenant, key)
    assert row["state"] == "completed" and bytes(row["response_body"]) == first.content
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content


async def test_a_request_without_a_key_keeps_every_extension_the_server_offers(
    schema, tenant, receipt
):
    # Not the middleware's request (the key is optional here): the application may send its
    # file as it likes, and the server sends it.
    calls: list[str] = []
    app = _server_with_extensions(_app(schema, receipt, require_key=False), calls)
    async with client(app) as http:
        response = await http.post("/receipts", content=b"{}", headers=headers(tenant))
    assert response.status_code == 201
    assert response.headers["x-extensions"] == ",".join(sorted(OFFERED))
    assert "http.response.pathsend" in calls
    assert response.content == receipt.read_bytes()
