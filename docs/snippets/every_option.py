import os

from fastapi import FastAPI
from starlette.types import Scope

from idempotency_asgi import (
    DEFAULT_EXCLUDED_HEADERS,
    IdempotencyMiddleware,
    PostgresStore,
)

API_KEYS = {"sk_test_acme": "acme"}  # your authentication: who holds which key


def tenant(scope: Scope) -> str | None:  # sync or async; None: not authenticated
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


app = FastAPI()
# start: options
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore(os.environ["DATABASE_URL"]),  # or PostgresStore(a_pool)
    tenant=tenant,
    methods=("POST", "PATCH"),  # covered methods; others pass through untouched
    require_key=True,  # covered requests without a key get 400
    required_paths=None,  # e.g. ["/payments", "/transfers/*"]: only these need a key
    exempt_paths=(),  # e.g. ["/webhooks/*"]: never touched, even with a key
    lease_seconds=10.0,  # in-flight lease, renewed while the handler runs
    ttl_seconds=86400.0,  # retention of a finished key
    max_body_bytes=1024 * 1024,  # larger requests get 413 (nothing is reserved)
    max_stored_response_bytes=1024 * 1024,  # larger answers are sent, not stored
    excluded_headers=DEFAULT_EXCLUDED_HEADERS,  # not replayed: date, set-cookie, ...
    fingerprint_headers=(),  # headers that are part of "the same request"
    release_statuses={408, 425, 429},  # 4xx that free the key, as a 5xx does
    wait_seconds=0.0,  # > 0: a duplicate waits this long for the answer, not a 409
    max_in_flight_per_tenant=None,  # e.g. 100: beyond it new keys get 429
    max_keys_per_tenant=None,  # e.g. 100_000: keys stored beyond it get 429
    www_authenticate=None,  # e.g. "Bearer": the challenge a 401 carries
    replay_headers=("Idempotent-Replayed",),  # the header that marks a replay
    replay_value="true",  # its value; "?1" for clients that read a structured boolean
    omitted_replay_header=None,  # e.g. "Idempotency-Replay": too large, replayed empty
    isolation_level=None,  # e.g. "serializable": the request transaction's level
    transaction_idle_seconds=20.0,  # a wait on it while idle, cancelled (0: never)
    atomic=False,  # True, or a callable of the scope: one transaction for it all
    maintenance=None,  # BackgroundMaintenance(Reaper(store), Sweeper(store))
)
# end: options


@app.post("/payments", status_code=201)
async def create_payment(payment: dict[str, int]):
    return {"received": payment}
