"""What in a request's headers is part of its fingerprint: the headers named in
`fingerprint_headers`, Content-Encoding, and Content-Type read as a media type with its
parameters. Two requests that differ there are different requests (422, nothing runs again);
headers nobody named are not, and a retry that differs only in them is replayed."""

from __future__ import annotations

import gzip

import orjson
import pytest

from tests.apps import build_app
from tests.helpers import assert_problem, client, effects, headers, key_row, new_key


@pytest.fixture
def app(schema):
    # Named as an application would write it: the match is on the lower-cased name.
    return build_app(schema, fingerprint_headers=["X-Account", "X-Region"])


async def test_a_configured_header_that_differs_makes_another_request(app, db, tenant):
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/tx/charge", json={"amount": 5}, headers=headers(tenant, key, x_account="acct-1")
        )
        other = await http.post(
            "/tx/charge", json={"amount": 5}, headers=headers(tenant, key, x_account="acct-2")
        )
        missing = await http.post("/tx/charge", json={"amount": 5}, headers=headers(tenant, key))
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")
    assert_problem(missing, 422, "key-reused")  # absent is not any value
    assert (await key_row(db, tenant, key))["response_status"] == 201
    assert await effects(db, tenant, key) == 1


async def test_a_configured_header_that_is_the_same_replays(app, db, tenant):
    key = new_key()
    sent = headers(tenant, key, x_account="acct-1", x_region="eu")
    async with client(app) as http:
        first = await http.post("/tx/charge", json={"amount": 5}, headers=sent)
        # The same values, and a header nobody named that differs.
        again = await http.post(
            "/tx/charge",
            json={"amount": 5},
            headers={**sent, "x-request-id": "another-attempt"},
        )
    assert first.status_code == 201
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert await effects(db, tenant, key) == 1


async def test_each_configured_header_counts_on_its_own(app, db, tenant):
    # The values of two named headers swapped: not the same request.
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_account="a", x_region="b")
        )
        swapped = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_account="b", x_region="a")
        )
    assert first.status_code == 201
    assert_problem(swapped, 422, "key-reused")
    assert await effects(db, tenant, key) == 1


async def test_a_header_that_is_not_configured_is_not_part_of_the_request(schema, db, tenant):
    app = build_app(schema)  # no fingerprint_headers
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/tx/charge", json={"amount": 5}, headers=headers(tenant, key, x_account="acct-1")
        )
        again = await http.post(
            "/tx/charge", json={"amount": 5}, headers=headers(tenant, key, x_account="acct-2")
        )
    assert first.status_code == 201
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert await effects(db, tenant, key) == 1


async def test_the_same_bytes_with_another_content_encoding_are_another_request(app, db, tenant):
    body = gzip.compress(b'{"amount": 5}', mtime=0)
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/plain/charge",
            content=body,
            headers=headers(tenant, key, content_type="application/json", content_encoding="gzip"),
        )
        plain = await http.post(
            "/plain/charge",
            content=body,
            headers=headers(tenant, key, content_type="application/json"),
        )
        retry = await http.post(
            "/plain/charge",
            content=body,
            headers=headers(tenant, key, content_type="application/json", content_encoding="gzip"),
        )
    assert first.status_code == 201
    assert_problem(plain, 422, "key-reused")
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1


async def test_json_is_read_as_json_whatever_parameters_its_content_type_has(app, db, tenant):
    # Its members in another order: the same JSON document, so a replay, however many
    # parameters follow the media type.
    content_type = "application/json; charset=utf-8; profile=payments"
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/tx/charge",
            content=orjson.dumps({"amount": 5, "currency": "EUR"}),
            headers=headers(tenant, key, content_type=content_type),
        )
        reordered = await http.post(
            "/tx/charge",
            content=b'{"currency": "EUR", "amount": 5}',
            headers=headers(tenant, key, content_type=content_type),
        )
    assert first.status_code == 201
    assert reordered.status_code == 201 and reordered.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1
