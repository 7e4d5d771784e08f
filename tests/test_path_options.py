"""`exempt_paths` and `required_paths` written as exact paths and as `/prefix/*`, and the limits
on `lease_seconds` and `ttl_seconds`: which requests the middleware takes, and which settings it
refuses at construction. In process, on real PostgreSQL."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from idempotency_asgi._asgi.config import MAX_SECONDS
from tests.apps import build_app, tenant_from_header
from tests.helpers import assert_problem, client, effects, headers, key_row


async def test_an_exact_exempt_path_is_exempt_and_only_that_path(schema, db, tenant):
    app = build_app(schema, exempt_paths=["/exempt/hook"])
    async with client(app) as http:
        hooks = [
            await http.post("/exempt/hook", json={}, headers=headers(tenant, "hook"))
            for _ in range(2)
        ]
        charged = await http.post("/plain/charge", json={}, headers=headers(tenant, "charge"))
    assert all(hook.status_code == 201 for hook in hooks)
    assert all("idempotent-replayed" not in hook.headers for hook in hooks)
    assert await key_row(db, tenant, "hook") is None  # never the middleware's
    assert charged.status_code == 201 and await key_row(db, tenant, "charge") is not None
    assert await effects(db, tenant) == 3


async def test_a_prefix_requires_keys_under_it_and_not_beside_it(schema, db, tenant):
    # "/plain/c*" is the prefix "/plain/c": "/plain/charge" is under it, "/plain/optional"
    # is not; "/tx/other" is one exact path.
    app = build_app(schema, required_paths=["/plain/c*", "/tx/other"])
    async with client(app) as http:
        prefixed = await http.post("/plain/charge", json={}, headers=headers(tenant))
        exact = await http.post("/tx/other", json={}, headers=headers(tenant))
        optional = await http.post("/plain/optional", json={}, headers=headers(tenant))
    assert_problem(prefixed, 400, "missing-key")
    assert_problem(exact, 400, "missing-key")
    assert optional.status_code == 201
    assert await effects(db, tenant) == 1


@pytest.mark.parametrize(
    "options",
    [
        {"lease_seconds": 0},
        {"ttl_seconds": 0},
        {"lease_seconds": MAX_SECONDS * 2},
        {"ttl_seconds": MAX_SECONDS * 2},
    ],
)
def test_a_lease_or_retention_out_of_range_is_refused(schema, options):
    [name] = options
    with pytest.raises(
        ValueError, match=f"^{name}=.*: must be more than 0 and at most 1e9 seconds"
    ):
        IdempotencyMiddleware(
            Starlette(), store=PostgresStore(schema), tenant=tenant_from_header, **options
        )


@pytest.mark.parametrize(
    "options",
    [
        {"lease_seconds": MAX_SECONDS, "ttl_seconds": MAX_SECONDS},
        {"lease_seconds": 0.5, "ttl_seconds": 0.5},
    ],
)
def test_a_lease_or_retention_at_the_ends_of_the_range_is_accepted(schema, options):
    IdempotencyMiddleware(
        Starlette(), store=PostgresStore(schema), tenant=tenant_from_header, **options
    )
