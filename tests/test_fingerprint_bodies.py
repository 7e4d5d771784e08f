"""Bodies in the fingerprint: JSON documents that differ in any value are different requests,
however they are written; JSON nested deeper than MAX_JSON_DEPTH is compared as its bytes; a
multipart body counts with every Content-Type parameter but its boundary. A key reused across
two different bodies is 422 and nothing runs again; the same body written anew replays."""

from __future__ import annotations

import pytest

from idempotency_asgi._asgi.canonical import MAX_JSON_DEPTH
from tests.apps import build_app
from tests.helpers import assert_problem, client, effects, headers, new_key

JSON = "application/json"


@pytest.fixture
def app(schema):
    return build_app(schema)


async def _twice(http, tenant, first: bytes, second: bytes, first_type: str, second_type: str):
    key = new_key()
    one = await http.post(
        "/plain/charge", content=first, headers=headers(tenant, key, content_type=first_type)
    )
    two = await http.post(
        "/plain/charge", content=second, headers=headers(tenant, key, content_type=second_type)
    )
    assert one.status_code == 201
    return two


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b'{"capture": true}', b'{"capture": false}'),
        (b'{"capture": null}', b'{"capture": false}'),
        (b'{"capture": null}', b'{"capture": true}'),
        (b"[1, 2]", b"[1, 3]"),
        (b'[{"a": 1}]', b'[{"a": 2}]'),
        (b'{"items": [true]}', b'{"items": [false]}'),
    ],
)
async def test_json_documents_with_another_value_are_another_request(
    app, db, tenant, first, second
):
    async with client(app) as http:
        again = await _twice(http, tenant, first, second, JSON, JSON)
    assert_problem(again, 422, "key-reused")
    assert await effects(db, tenant) == 1


async def test_json_as_deep_as_the_limit_is_compared_as_json(app, db, tenant):
    # Two arrays side by side, each as deep as the limit allows: more brackets than the limit,
    # no deeper than it.
    inner = MAX_JSON_DEPTH - 1
    tight = b"[" + b"[" * inner + b"]" * inner + b"," + b"[" * inner + b"]" * inner + b"]"
    spaced = tight.replace(b",", b" , ").replace(b"[[", b"[ [")
    async with client(app) as http:
        again = await _twice(http, tenant, tight, spaced, JSON, JSON)
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"


async def test_json_deeper_than_the_limit_is_compared_as_its_bytes(app, db, tenant):
    depth = MAX_JSON_DEPTH + 1
    tight = b"[" * depth + b"]" * depth
    spaced = b"[ " * depth + b" ]" * depth
    async with client(app) as http:
        again = await _twice(http, tenant, tight, spaced, JSON, JSON)
    assert_problem(again, 422, "key-reused")


def _multipart(boundary: bytes) -> bytes:
    return (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="note"\r\n\r\n'
        b"caf\xe9\r\n--" + boundary + b"--\r\n"
    )


@pytest.mark.parametrize(
    ("first_type", "second_type"),
    [
        (
            "multipart/form-data; charset=utf-8; boundary=AAA",
            "multipart/form-data; charset=latin-1; boundary=BBB",
        ),
        (
            "multipart/form-data; boundary=AAA; charset=utf-8",
            "multipart/form-data; boundary=BBB; charset=latin-1",
        ),
        ("multipart/form-data; boundary=AAA", "multipart/mixed; boundary=BBB"),
        ("multipart/form-data; boundary=AAA; x=1", "multipart/mixed; boundary=BBB; x=1"),
    ],
    ids=["parameter-before", "parameter-after", "subtype", "subtype-then-parameter"],
)
async def test_multipart_with_another_parameter_is_another_request(
    app, db, tenant, first_type, second_type
):
    async with client(app) as http:
        again = await _twice(
            http, tenant, _multipart(b"AAA"), _multipart(b"BBB"), first_type, second_type
        )
    assert_problem(again, 422, "key-reused")
    assert await effects(db, tenant) == 1


async def test_multipart_with_only_a_new_boundary_replays(app, db, tenant):
    content_type = "multipart/form-data; charset=utf-8; boundary={}; x=y"
    async with client(app) as http:
        again = await _twice(
            http,
            tenant,
            _multipart(b"AAA"),
            _multipart(b"BBB"),
            content_type.format("AAA"),
            content_type.format('"BBB"'),
        )
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
