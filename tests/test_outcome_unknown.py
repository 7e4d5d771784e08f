"""A transactional handler that wrote and then cannot tell whether its outcome happened
(OutcomeUnknown): its writes roll back, its connection goes back to the pool, and its key stays
in flight until the lease lapses, so no retry runs while the first attempt might still take
effect. Audited in PostgreSQL: the effects table, the key row, and the sessions still open."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from idempotency_asgi import PostgresStore
from tests.apps import build_app
from tests.helpers import (
    assert_problem,
    client,
    effects,
    eventually,
    headers,
    key_row,
    new_key,
)
from tests.server import UvicornProcess, serve, wire

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

#: Sessions of one application still inside a transaction.
OPEN_TRANSACTIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE application_name = $1 AND state LIKE 'idle in transaction%'
"""


async def test_a_transactional_write_before_an_unknown_outcome_rolls_back_and_holds_the_key(
    schema, db, tenant
):
    application = f"outcome-unknown-{tenant}"
    store = PostgresStore(
        schema, pool_options={"server_settings": {"application_name": application}}
    )
    app = build_app(schema, store=store, lease_seconds=1.0)
    key = new_key()

    async def scenario():
        async with client(app) as http:
            unknown = await http.post(
                "/tx/charge", json={}, headers=headers(tenant, key, x_unknown="1")
            )
            left_open = await db.fetchval(OPEN_TRANSACTIONS, application)
            row = await key_row(db, tenant, key)
            written = await effects(db, tenant, key)
            meanwhile = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            await asyncio.sleep(1.3)  # nothing renews the lease any more: it lapses
            later = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        return unknown, left_open, row, written, meanwhile, later

    try:
        unknown, left_open, row, written, meanwhile, later = await asyncio.wait_for(scenario(), 20)
    except asyncio.TimeoutError:
        pytest.fail(
            "the application did not shut down: a connection was never given back to the pool "
            "(the request's transaction was left open)"
        )
    assert_problem(unknown, 504, "outcome-unknown")
    assert int(unknown.headers["retry-after"]) >= 1
    assert left_open == 0  # rolled back, not left holding its locks
    assert written == 0  # the write was never committed
    assert row["state"] == "in_flight"  # neither recorded nor released
    assert_problem(meanwhile, 409, "request-in-progress")
    # Once the lease lapsed, the retry ran, and its write is the only one.
    assert later.status_code == 201 and "idempotent-replayed" not in later.headers
    assert await effects(db, tenant, key) == 1
    assert (await key_row(db, tenant, key))["state"] == "completed"


# -- an OutcomeUnknown anywhere behind what the application raised -----------------------------

#: Each mode a keyed route runs in: its path, and the middleware's `atomic` option. The plain
#: route writes on the application's own pool (its effect commits whatever happens); the
#: transactional ones write in the request's transaction (rolled back).
MODES = {
    "plain": ("/plain/charge", False),
    "two-phase": ("/tx/charge", False),
    "atomic": ("/tx/charge", True),
}


@pytest.fixture(scope="module")
def servers(schema):
    """The test app under uvicorn, one process per (atomic, wrapped), started when first
    asked for: `wrapped` wraps the Starlette app in the middleware (its own error middleware
    then inside) instead of adding the middleware to it."""
    started: dict[tuple[bool, bool], UvicornProcess] = {}

    def server(atomic: bool, wrapped: bool = False) -> UvicornProcess:
        if (atomic, wrapped) not in started:
            environment = {"TEST_APP_WRAPPED": "1"} if wrapped else {}
            started[atomic, wrapped] = serve(schema, options={"atomic": atomic}, **environment)
        return started[atomic, wrapped]

    yield server
    for process in started.values():
        process.stop()


async def assert_held(
    process: UvicornProcess, db, tenant: str, mode: str, **sent: str
) -> httpx.Response:
    """Send a keyed request that raises with an OutcomeUnknown behind it, then its retry:
    the first is answered 504 and its key held, so the retry runs nothing (409)."""
    path, _ = MODES[mode]
    key = new_key()
    async with wire(process.url) as http:
        first = await http.post(path, json={}, headers=headers(tenant, key, **sent))
        retry = await http.post(path, json={}, headers=headers(tenant, key))
    assert_problem(first, 504, "outcome-unknown")
    assert int(first.headers["retry-after"]) >= 1
    assert_problem(retry, 409, "request-in-progress")
    # The plain route's write committed on its own (once: the retry did not run); the
    # transactional ones rolled back.
    assert await effects(db, tenant, key) == (1 if mode == "plain" else 0)
    return first


@pytest.mark.parametrize("chain", ["implicit", "from-none", "deep", "group"])
@pytest.mark.parametrize("mode", MODES)
async def test_an_outcome_unknown_anywhere_behind_the_error_holds_the_key(
    servers, db, tenant, mode, chain
):
    # `except OutcomeUnknown: raise ChargeFailed()` (the OutcomeUnknown its __context__ only),
    # the same `from None`, 50 links of both kinds, and inside a task group's exception group:
    # each was a 500 that freed the key, and every retry charged again.
    await assert_held(servers(MODES[mode][1]), db, tenant, mode, x_unknown_chain=chain)


@pytest.mark.parametrize("how", ["direct", "implicit"])
@pytest.mark.parametrize("mode", MODES)
async def test_an_outcome_unknown_holds_the_key_when_the_middleware_wraps_the_app(
    servers, db, tenant, mode, how
):
    # IdempotencyMiddleware(Starlette(...)): Starlette's error middleware, inside, sends a
    # whole 500 before it raises the OutcomeUnknown again. That 500 was settled as any 5xx
    # (the key freed) before the exception arrived.
    sent = {"x_unknown": "1"} if how == "direct" else {"x_unknown_chain": "implicit"}
    await assert_held(servers(MODES[mode][1], wrapped=True), db, tenant, mode, **sent)


@pytest.mark.parametrize("mode", MODES)
async def test_a_wrapped_apps_own_5xx_and_errors_still_free_the_key(servers, db, tenant, mode):
    # Held back until the application returned or raised, then settled as before: the key
    # freed, the application's own answer sent (Starlette's 500 for an error).
    path, atomic = MODES[mode]
    process = servers(atomic, wrapped=True)
    committed = mode == "plain"
    for sent in ({"x_status": "503"}, {"x_raise": "1"}):
        key = new_key()
        # A connection each: uvicorn closes one whose application raised.
        async with wire(process.url) as http:
            first = await http.post(path, json={}, headers=headers(tenant, key, **sent))
        async with wire(process.url) as http:
            retry = await http.post(path, json={}, headers=headers(tenant, key))
        if "x_raise" in sent:
            assert first.status_code == 500 and first.text == "Internal Server Error"
        else:
            assert first.status_code == 503 and first.json()["effect_id"]
        assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
        # The first's write (committed in plain mode only), and the retry's.
        assert await effects(db, tenant, key) == (2 if committed else 1)


def test_an_outcome_unknown_is_found_behind_any_chain():
    from idempotency_asgi import OutcomeUnknown
    from idempotency_asgi._asgi.outcomes import outcome_unknown_in

    unknown = OutcomeUnknown("the provider did not answer in time")
    # Deeper than Python's recursion limit, each link of either kind.
    error: BaseException = unknown
    for link in range(5000):
        outer = RuntimeError(f"link {link}")
        if link % 2:
            outer.__cause__ = error
        else:
            outer.__context__ = error
        error = outer
    assert outcome_unknown_in(error) is unknown
    # Hidden by `from None`: still there.
    hidden = RuntimeError("the charge failed")
    hidden.__context__, hidden.__suppress_context__ = unknown, True
    assert outcome_unknown_in(hidden) is unknown
    # Inside groups inside groups, behind a member's context.
    member = ValueError("a child failed")
    member.__context__ = unknown
    group = BaseExceptionGroup("outer", [KeyError("x"), BaseExceptionGroup("inner", [member])])
    assert outcome_unknown_in(group) is unknown
    # A loop (each the other's context; a member raised from its own group) ends.
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__context__, second.__context__ = second, first
    assert outcome_unknown_in(first) is None
    looped = ValueError("raised from its own group")
    looped.__cause__ = BaseExceptionGroup("fan-out", [looped])
    assert outcome_unknown_in(looped) is None
    assert outcome_unknown_in(RuntimeError("nothing behind it")) is None


async def test_a_5xx_past_the_stored_response_cap_is_not_held_back(schema, db, tenant):
    # What is held back until the application ends is bounded by the cap on stored answers:
    # past it, a 5xx is settled (its key freed) and streamed as it comes, as before.
    from idempotency_asgi import IdempotencyMiddleware, OutcomeUnknown
    from tests.apps import tenant_from_header
    from tests.helpers import lifespan

    ends = asyncio.Event()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"x" * 2048, "more_body": True})
        await ends.wait()
        raise OutcomeUnknown("too late to hold the key: the answer is on its way")

    middleware = IdempotencyMiddleware(
        app, store=PostgresStore(schema), tenant=tenant_from_header, max_stored_response_bytes=1024
    )
    key = new_key()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/big-failure",
        "raw_path": b"/big-failure",
        "query_string": b"",
        "headers": [(b"x-tenant", tenant.encode()), (b"idempotency-key", key.encode())],
    }
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    async with lifespan(middleware):
        running = asyncio.create_task(middleware(scope, receive, send))
        await eventually(lambda: asyncio.sleep(0, len(sent) >= 2))
        assert sent[0]["status"] == 500 and not running.done()
        assert await key_row(db, tenant, key) is None  # freed as it overflowed
        ends.set()
        with pytest.raises(OutcomeUnknown):
            await running
