"""Path options (`required_paths`, `exempt_paths`) name the application's own routes, and match
the same way whether it is served at the root, under `--root-path`, or inside a `Mount`."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from tests.apps import build_app
from tests.helpers import assert_problem, client, effects, headers, key_row, lifespan, new_key
from tests.server import UvicornProcess

OPTIONS = {"required_paths": ["/tx/*"], "exempt_paths": ["/exempt/*"]}


async def check_paths(http: httpx.AsyncClient, prefix: str, db, tenant: str) -> None:
    hook_key, key = new_key(), new_key()
    hooks = [
        await http.post(f"{prefix}/exempt/hook", json={}, headers=headers(tenant, hook_key))
        for _ in range(2)
    ]
    required = await http.post(f"{prefix}/tx/charge", json={}, headers=headers(tenant))
    optional = await http.post(f"{prefix}/plain/optional", json={}, headers=headers(tenant))
    first = await http.post(f"{prefix}/tx/charge", json={}, headers=headers(tenant, key))
    replay = await http.post(f"{prefix}/tx/charge", json={}, headers=headers(tenant, key))
    # Exempt: untouched even with a key, so the webhook ran twice and nothing was reserved.
    assert [hook.status_code for hook in hooks] == [201, 201]
    assert all("idempotent-replayed" not in hook.headers for hook in hooks)
    assert await key_row(db, tenant, hook_key) is None
    assert await effects(db, tenant, hook_key) == 2
    # Required where listed, optional elsewhere.
    assert_problem(required, 400, "missing-key")
    assert optional.status_code == 201
    assert first.status_code == 201 and replay.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize("root_path", ["", "/api"])
async def test_path_options_match_with_or_without_a_root_path(schema, db, tenant, root_path):
    app = build_app(schema, **OPTIONS)
    async with client(app, root_path=root_path) as http:
        await check_paths(http, root_path, db, tenant)


async def test_path_options_match_inside_a_mount(schema, db, tenant):
    inner = build_app(schema, **OPTIONS)
    # Starlette does not pass the lifespan on to mounted apps: the outer app runs the inner's,
    # so that the middleware opens and closes its store.
    outer = Starlette(routes=[Mount("/v1", app=inner)], lifespan=lambda _: lifespan(inner))
    async with client(outer) as http:
        await check_paths(http, "/v1", db, tenant)


async def test_path_options_match_under_uvicorn_root_path(schema, db, tenant):
    env = {
        "DATABASE_URL": schema,
        "TEST_APP_SERVE": "1",
        "TEST_APP_OPTIONS": json.dumps(OPTIONS),
    }
    # uvicorn serves /x as /api/x: a proxy in front stripped the prefix.
    server = UvicornProcess("tests.apps:app", env, extra_args=("--root-path", "/api")).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            await check_paths(http, "", db, tenant)
            key = new_key()
            await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        # The record keeps the path the application saw.
        assert (await key_row(db, tenant, key))["path"] == "/api/tx/charge"
    finally:
        server.stop()
