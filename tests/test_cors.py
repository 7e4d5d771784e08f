"""CORS goes outside the idempotency middleware. Inside, its headers were recorded with the
answer: a replay asked for from one origin carried the `Access-Control-Allow-Origin` of
another (the browser refuses it), and the middleware's own answers (401, 422) had none. A
CORS middleware inside is found when the middleware is made, however it got there, and the
application does not start; outside, every answer speaks to the origin that asked. Real
uvicorn processes and a real PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest

from tests.helpers import assert_problem, effects, headers, new_key
from tests.server import serve

SHOP, ADMIN = "https://shop.example", "https://admin.example"

#: Apps a reader writes, each with CORSMiddleware inside IdempotencyMiddleware: added first,
#: as FastAPI's tutorials have it; listed after it in middleware=[...]; in the app the
#: middleware wraps.
INSIDE = {
    "added-first": """
        app = FastAPI()
        app.add_middleware(CORSMiddleware, allow_origins=["https://shop.example"])
        app.add_middleware(IdempotencyMiddleware, store=STORE, tenant=tenant)
    """,
    "listed-after": """
        app = FastAPI(
            middleware=[
                Middleware(IdempotencyMiddleware, store=STORE, tenant=tenant),
                Middleware(CORSMiddleware, allow_origins=["https://shop.example"]),
            ]
        )
    """,
    "wrapped": """
        inner = FastAPI()
        inner.add_middleware(CORSMiddleware, allow_origins=["https://shop.example"])
        app = IdempotencyMiddleware(inner, store=STORE, tenant=tenant)
    """,
}

PREAMBLE = """
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.middleware import Middleware
from idempotency_asgi import IdempotencyMiddleware, PostgresStore

STORE = PostgresStore("postgresql://unused@127.0.0.1:1/unused")


def tenant(scope):
    return "acme"
"""


def run_uvicorn(tmp_path: Path, body: str) -> tuple[int | None, str]:
    """uvicorn with its defaults (`--lifespan auto`) on an app of `body`, until it exits or
    says it serves: its exit status (None: it served, and was stopped) and what it printed."""
    source = textwrap.dedent(PREAMBLE) + textwrap.dedent(body)
    (tmp_path / "app_under_test.py").write_text(source)
    command = [sys.executable, "-m", "uvicorn", "app_under_test:app", "--port", "0"]
    printed = []
    with subprocess.Popen(command, cwd=tmp_path, stderr=subprocess.PIPE, text=True) as process:
        watchdog = threading.Timer(60, process.kill)  # neither, ever: fail, never hang
        watchdog.start()
        try:
            assert process.stderr is not None
            for line in process.stderr:
                printed.append(line)
                if "Uvicorn running" in line:
                    process.terminate()
                    process.wait()
                    return None, "".join(printed)
            return process.wait(), "".join(printed)
        finally:
            watchdog.cancel()
            if process.poll() is None:
                process.kill()


@pytest.mark.parametrize("placement", INSIDE)
def test_cors_inside_the_middleware_stops_the_application_at_startup(tmp_path, placement):
    status, printed = run_uvicorn(tmp_path, INSIDE[placement])
    assert status is not None, f"it served with CORS inside:\n{printed}"
    assert status != 0
    assert "CORSMiddleware is inside IdempotencyMiddleware" in printed
    assert "Put CORSMiddleware outside" in printed
    assert "Application startup failed. Exiting." in printed
    assert "Uvicorn running" not in printed


def test_cors_outside_the_middleware_starts(tmp_path):
    # The order FastAPI's add_middleware needs: CORS added last, so it runs first.
    status, printed = run_uvicorn(
        tmp_path,
        """
        app = FastAPI()
        app.add_middleware(IdempotencyMiddleware, store=STORE, tenant=tenant)
        app.add_middleware(CORSMiddleware, allow_origins=["https://shop.example"])
        """,
    )
    assert status is None, printed  # still serving: nothing refused it


async def test_without_a_lifespan_a_request_raises_what_is_wrong(schema):
    # A server run without the lifespan (or a test client that skips it) still cannot serve
    # with CORS inside: each request raises the same error.
    from tests.apps import build_app

    app = build_app(schema, cors="inside")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        with pytest.raises(RuntimeError, match="CORSMiddleware is inside"):
            await http.post("/tx/charge", json={}, headers=headers("acme", new_key()))


@pytest.fixture(scope="module")
def outside(schema):
    process = serve(schema, TEST_APP_CORS="outside")
    yield process
    process.stop()


@pytest.mark.parametrize("path", ["/plain/charge", "/tx/charge"])
async def test_with_cors_outside_every_answer_speaks_to_the_origin_that_asked(
    outside, db, tenant, path
):
    key = new_key()
    async with httpx.AsyncClient(base_url=outside.url, timeout=10.0) as http:
        first = await http.post(path, json={}, headers=headers(tenant, key, origin=SHOP))
        replay = await http.post(path, json={}, headers=headers(tenant, key, origin=ADMIN))
        reused = await http.post(
            path, json={"other": 1}, headers=headers(tenant, key, origin=ADMIN)
        )
        anonymous = await http.post(path, json={}, headers=headers(None, key, origin=SHOP))
    assert first.status_code == 201
    assert first.headers["access-control-allow-origin"] == SHOP
    # The replay is the first answer, with the CORS of its own origin, not the first's.
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers.get_list("access-control-allow-origin") == [ADMIN]
    assert "idempotent-replayed" in replay.headers["access-control-expose-headers"].lower()
    # The middleware's own answers pass through CORS too: the page can read them.
    assert_problem(reused, 422, "key-reused")
    assert reused.headers["access-control-allow-origin"] == ADMIN
    assert_problem(anonymous, 401, "unauthenticated")
    assert anonymous.headers["access-control-allow-origin"] == SHOP
    assert await effects(db, tenant, key) == 1
