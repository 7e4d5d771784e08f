"""The request session's `after_commit` listeners are held until the request's transaction
really commits (idempotency_asgi/_sqlalchemy/events.py), in process, with a real listener;
and where a SQLAlchemy version keeps its events where they cannot be held, a session with
such a listener is refused with a message that says what to do, and one without works."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from sqlalchemy import event, text
from sqlalchemy.orm import Session as SyncSession

import idempotency_asgi.sqlalchemy
from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from idempotency_asgi._sqlalchemy import events
from idempotency_asgi.fastapi import Session
from tests.helpers import client, new_key
from tests.sqlalchemy_apps import tenant_from_header


def build(dsn: str, sent: list[str], **options: object) -> FastAPI:
    app = FastAPI()

    @app.post("/orders", status_code=201)
    async def create(session: Session, x_status: int = 201) -> JSONResponse:
        session.info.setdefault("sent", []).append("confirmation")
        await session.execute(text("SELECT 1"))
        await session.commit()
        await session.commit()  # twice: the listener is held twice, and called twice
        return JSONResponse({"ok": True}, status_code=x_status)

    app.add_middleware(
        IdempotencyMiddleware, store=PostgresStore(dsn), tenant=tenant_from_header, **options
    )
    return app


@pytest.fixture
def listener():
    sent: list[str] = []

    def after_commit(session: SyncSession) -> None:
        sent.extend(session.info.get("sent", []))
        sent.append("commit")

    event.listen(SyncSession, "after_commit", after_commit)
    yield sent
    event.remove(SyncSession, "after_commit", after_commit)


@pytest.mark.parametrize("atomic", [False, True], ids=["two-phase", "atomic"])
async def test_the_listener_runs_after_the_real_commit_only(schema, tenant, listener, atomic):
    idempotency_asgi.sqlalchemy.configure()
    app = build(schema, listener, atomic=atomic)
    key, failed = new_key(), new_key()
    headers = {"x-tenant": tenant}
    async with client(app) as http:
        bad = await http.post(
            "/orders?x_status=503", json={}, headers={**headers, "idempotency-key": failed}
        )
        assert bad.status_code == 503 and listener == []  # rolled back: never called
        good = await http.post("/orders", json={}, headers={**headers, "idempotency-key": key})
        assert good.status_code == 201
        once = list(listener)
        replay = await http.post("/orders", json={}, headers={**headers, "idempotency-key": key})
        assert replay.headers["idempotent-replayed"] == "true"
    # Called after the request's COMMIT, once per commit of the session's, and never again.
    assert once == ["confirmation", "commit", "confirmation", "commit"]
    assert listener == once


async def test_where_events_cannot_be_held_a_listened_session_is_refused(
    schema, tenant, listener, monkeypatch
):
    monkeypatch.setattr(events, "hold", lambda session, calls: False)
    idempotency_asgi.sqlalchemy.configure()
    app = build(schema, listener)
    async with client(app) as http:
        with pytest.raises(RuntimeError, match="after_commit"):
            await http.post(
                "/orders", json={}, headers={"x-tenant": tenant, "idempotency-key": new_key()}
            )
    assert listener == []


async def test_where_events_cannot_be_held_a_session_without_listeners_works(
    schema, tenant, monkeypatch
):
    monkeypatch.setattr(events, "hold", lambda session, calls: False)
    idempotency_asgi.sqlalchemy.configure()
    app = build(schema, [])
    async with client(app) as http:
        answer = await http.post(
            "/orders", json={}, headers={"x-tenant": tenant, "idempotency-key": new_key()}
        )
    assert answer.status_code == 201
