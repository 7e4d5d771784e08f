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
