"""The example payments API (docs/example.md) and the contract it keeps (docs/contract.md), on a
real PostgreSQL."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from examples.payments.app import create_app
from examples.payments.settings import Settings, parse_tokens
from tests.helpers import client, new_key
from tests.server import UvicornProcess

ACME = {"authorization": "Bearer sk_test_acme"}
GLOBEX = {"authorization": "Bearer sk_test_globex"}
PAYMENT = {"amount": 1250, "currency": "eur", "customer_id": "cus_42"}


def settings(dsn: str, **overrides) -> Settings:
    values = dict(
        database_url=dsn,
        tokens=parse_tokens("sk_test_acme=acme,sk_test_globex=globex"),
        fault_injection=False,
        lease_seconds=10.0,
        ttl_seconds=86400.0,
    )
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="module")
def server(schema):
    env = {"DATABASE_URL": schema, "PAYMENTS_FAULT_INJECTION": "1"}
    process = UvicornProcess("examples.payments.app:app", env).start(ready_path="/healthz")
    yield process
    process.stop()


@pytest.fixture(params=["in-process", "uvicorn"])
async def http(request, schema):
    """Each contract test runs twice: in process, and over real HTTP against uvicorn."""
    if request.param == "in-process":
        async with client(create_app(settings(schema, fault_injection=True))) as http:
            yield http
    else:
        server = request.getfixturevalue("server")
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            yield http


async def count_payments(db, key: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM payments WHERE idempotency_key = $1", key))


async def test_create_then_replay(http, db):
    key = new_key()
    first = await http.post("/payments", json=PAYMENT, headers={**ACME, "idempotency-key": key})
    again = await http.post("/payments", json=PAYMENT, headers={**ACME, "idempotency-key": key})
    assert first.status_code == 201
    body = first.json()
    assert set(body) == {"id", "amount", "currency", "customer_id", "status", "created_at"}
    assert body["currency"] == "EUR" and body["amount"] == 1250
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert await count_payments(db, key) == 1
    events = await db.fetch("SELECT * FROM outbox WHERE payment_id = $1", body["id"])
    assert len(events) == 1 and events[0]["idempotency_key"] == key


async def test_key_required_and_auth_required(http, db):
    missing = await http.post("/payments", json=PAYMENT, headers=ACME)
    assert missing.status_code == 400
    assert missing.headers["content-type"] == "application/problem+json"
    for bad in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic sk_test_acme"}):
        for key in ({"idempotency-key": new_key()}, {}):  # with a key or without: 401 first
            response = await http.post("/payments", json=PAYMENT, headers={**bad, **key})
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
        assert (await http.get("/payments", headers=bad)).status_code == 401


async def test_decline_is_a_stored_402(http, db):
    key = new_key()
    big = {**PAYMENT, "amount": 1_000_001}
    first = await http.post("/payments", json=big, headers={**ACME, "idempotency-key": key})
    again = await http.post("/payments", json=big, headers={**ACME, "idempotency-key": key})
    assert first.status_code == 402
    assert first.headers["content-type"] == "application/problem+json"
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert await count_payments(db, key) == 0
    at_limit = await http.post(
        "/payments",
        json={**PAYMENT, "amount": 1_000_000},
        headers={**ACME, "idempotency-key": new_key()},
    )
    assert at_limit.status_code == 201


@pytest.mark.parametrize(
    "payload",
    [
        {**PAYMENT, "amount": 0},
        {**PAYMENT, "amount": -5},
        {**PAYMENT, "currency": "EURO"},
        {**PAYMENT, "customer_id": ""},
        {"amount": 5},
        {**PAYMENT, "amount": "ten"},
        # Not amounts in cents, though a lax parser would take them.
        {**PAYMENT, "amount": True},
        {**PAYMENT, "amount": "100"},
        {**PAYMENT, "amount": 100.0},
        # Text PostgreSQL cannot hold.
        {**PAYMENT, "customer_id": "cus\x00"},
        {**PAYMENT, "customer_id": "cus\udcff"},
    ],
)
async def test_invalid_input_is_422_and_writes_nothing(http, db, payload):
    key = new_key()
    body = json.dumps(payload).encode()  # ASCII escapes: a lone surrogate goes as \udcff
    response = await http.post(
        "/payments",
        content=body,
        headers={**ACME, "idempotency-key": key, "content-type": "application/json"},
    )
    assert response.status_code == 422, response.text
    assert response.json()["detail"]  # FastAPI's shape: a list of what was wrong
    assert await count_payments(db, key) == 0


@pytest.mark.parametrize("amount", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
async def test_numbers_json_cannot_echo_back_are_still_a_422(http, db, amount):
    key = new_key()
    body = b'{"amount": ' + amount + b', "currency": "EUR", "customer_id": "c1"}'
    response = await http.post(
        "/payments",
        content=body,
        headers={**ACME, "idempotency-key": key, "content-type": "application/json"},
    )
    assert response.status_code == 422, response.text
    assert await count_payments(db, key) == 0


async def test_an_amount_past_64_bits_is_declined_and_echoed(http, db):
    key = new_key()
    huge = {**PAYMENT, "amount": 18446744073709551616}
    first = await http.post("/payments", json=huge, headers={**ACME, "idempotency-key": key})
    again = await http.post("/payments", json=huge, headers={**ACME, "idempotency-key": key})
    assert first.status_code == 402 and first.json()["amount"] == 18446744073709551616
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"


async def test_lookups_with_text_no_payment_can_hold_are_not_errors(http, db):
    assert (await http.get("/payments/pay%00x", headers=ACME)).status_code == 404
    listed = await http.get("/payments", params={"customer_id": "c\x00"}, headers=ACME)
    assert listed.status_code == 422


async def test_tenants_see_only_their_own_payments(http, db):
    customer = "cus_" + new_key()[:8]
    created = await http.post(
        "/payments",
        json={**PAYMENT, "customer_id": customer},
        headers={**ACME, "idempotency-key": new_key()},
    )
    payment_id = created.json()["id"]
    assert (await http.get(f"/payments/{payment_id}", headers=ACME)).json() == created.json()
    assert (await http.get(f"/payments/{payment_id}", headers=GLOBEX)).status_code == 404
    theirs = (await http.get(f"/payments?customer_id={customer}", headers=GLOBEX)).json()
    assert theirs == {"data": []}
    mine = (await http.get(f"/payments?customer_id={customer}", headers=ACME)).json()["data"]
    assert [p["id"] for p in mine] == [payment_id]


async def test_listing_is_newest_first_with_a_bounded_limit(http, db):
    customer = "cus_" + new_key()[:8]
    ids = []
    for amount in (1, 2, 3):
        response = await http.post(
            "/payments",
            json={**PAYMENT, "amount": amount, "customer_id": customer},
            headers={**ACME, "idempotency-key": new_key()},
        )
        ids.append(response.json()["id"])
    listed = (await http.get(f"/payments?customer_id={customer}", headers=ACME)).json()["data"]
    assert [p["id"] for p in listed] == ids[::-1]
    two = (await http.get(f"/payments?customer_id={customer}&limit=2", headers=ACME)).json()
    assert len(two["data"]) == 2
    assert (await http.get("/payments?limit=1001", headers=ACME)).status_code == 422
    assert (await http.get("/payments?limit=0", headers=ACME)).status_code == 422


async def test_injected_500_rolls_back_the_payment(http, db):
    key = new_key()
    failed = await http.post(
        "/payments", json=PAYMENT, headers={**ACME, "idempotency-key": key, "x-fault-status": "500"}
    )
    assert failed.status_code == 500
    assert await count_payments(db, key) == 0
    retried = await http.post("/payments", json=PAYMENT, headers={**ACME, "idempotency-key": key})
    assert retried.status_code == 201 and "idempotent-replayed" not in retried.headers
    assert await count_payments(db, key) == 1


async def test_a_fault_delay_that_is_not_ascii_digits_is_ignored(http, db):
    # "²" is a digit to str.isdigit() and not to int(): it was a 500.
    key = new_key()
    odd = {**ACME, "idempotency-key": key, "x-fault-delay-ms": "\xb2".encode("latin-1")}
    response = await http.post("/payments", json=PAYMENT, headers=odd)
    assert response.status_code == 201
    assert await count_payments(db, key) == 1


async def test_concurrent_duplicates_make_one_payment(http, db):
    key = new_key()
    slow = {**ACME, "idempotency-key": key, "x-fault-delay-ms": "300"}
    responses = await asyncio.gather(
        *(http.post("/payments", json=PAYMENT, headers=slow) for _ in range(20))
    )
    originals = [r for r in responses if "idempotent-replayed" not in r.headers]
    originals = [r for r in originals if r.status_code == 201]
    others = [r for r in responses if r not in originals]
    # One ran; every other one got a 409 or, once it was done, its replay.
    assert len(originals) == 1
    assert all(r.status_code == 409 or r.content == originals[0].content for r in others)
    assert any(r.status_code == 409 for r in others)  # they really overlapped
    assert await count_payments(db, key) == 1


async def test_fault_injection_is_off_by_default(schema, db):
    async with client(create_app(settings(schema))) as http:
        key = new_key()
        response = await http.post(
            "/payments",
            json=PAYMENT,
            headers={**ACME, "idempotency-key": key, "x-fault-status": "500"},
        )
    assert response.status_code == 201
    assert await count_payments(db, key) == 1


def test_token_spec_is_validated():
    assert parse_tokens(" a=x , b=y ,") == {"a": "x", "b": "y"}
    with pytest.raises(ValueError, match="token=tenant"):
        parse_tokens("a=x,broken")


async def test_openapi_documents_the_key_header_and_problem_answers(http):
    spec = (await http.get("/openapi.json")).json()
    operation = spec["paths"]["/payments"]["post"]
    [header] = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
    assert header["in"] == "header" and header["required"] is True
    responses = operation["responses"]
    assert set(responses) >= {"201", "400", "409", "422", "503"}
    assert "Idempotent-Replayed" in responses["201"]["headers"]
    assert "PaymentOut" in str(responses["201"]["content"])  # the model is still there
    for status in ("400", "409", "422", "503"):
        assert "application/problem+json" in responses[status]["content"]
    assert "Retry-After" in responses["409"]["headers"]
    assert "Idempotency-Key" not in str(spec["paths"]["/payments"]["get"])


async def test_metrics_show_idempotency_series_after_a_few_requests(http):
    key = new_key()
    for _ in range(2):
        await http.post("/payments", json=PAYMENT, headers={**ACME, "idempotency-key": key})
    text = (await http.get("/metrics")).text
    assert 'idempotency_requests_total{outcome="new"}' in text
    assert 'idempotency_requests_total{outcome="replay"}' in text
    assert "idempotency_request_duration_seconds_bucket" in text
