import pytest

import idempotency_asgi


def test_public_names_are_pinned():
    assert idempotency_asgi.__all__ == [
        "Claim",
        "IdempotencyMiddleware",
        "IdempotentConsumer",
        "Lease",
        "Outcome",
        "OutcomeUnknown",
        "PostgresStore",
        "Processed",
        "StoreError",
        "StoreUnavailable",
        "StoredResponse",
        "connection",
        "migrate",
    ]
    for name in idempotency_asgi.__all__:
        assert getattr(idempotency_asgi, name) is not None


def test_fastapi_dependency_is_the_same_connection_helper():
    from idempotency_asgi.fastapi import Connection, connection

    assert connection is idempotency_asgi.connection
    assert Connection.__metadata__[0].dependency is connection


@pytest.mark.parametrize(
    "options",
    [
        {"lease_seconds": 0},
        {"ttl_seconds": -1},
        {"lease_seconds": float("inf")},
        {"ttl_seconds": float("nan")},
        {"ttl_seconds": 1e12},  # past what PostgreSQL's timestamps reach
    ],
)
def test_leases_and_retention_must_be_positive_finite_and_storable(options):
    from starlette.applications import Starlette

    store = idempotency_asgi.PostgresStore("postgresql://unused")
    with pytest.raises(ValueError, match="lease_seconds and ttl_seconds"):
        idempotency_asgi.IdempotencyMiddleware(
            Starlette(), store=store, tenant=lambda scope: "t", **options
        )
