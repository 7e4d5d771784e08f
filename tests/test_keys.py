"""The Idempotency-Key header: a bare token or an RFC 8941 string ("abc", with \\" and \\\\
escapes), the same key either way; anything else is refused with a 400 that says exactly why,
before anything runs. Over HTTP, in process, on real PostgreSQL."""

from __future__ import annotations

import pytest

from tests.apps import build_app
from tests.helpers import assert_problem, client, effects, key_row

SEND_ONE = " Send one key of 1 to 255 visible ASCII characters."


@pytest.fixture
def app(schema):
    return build_app(schema)


def _with_key(tenant: str, *values: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"x-tenant", tenant.encode()), *((b"idempotency-key", v) for v in values)]


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ((b"a", b"b"), "The Idempotency-Key header was sent more than once; send it once."),
        ((b" \t",), "The Idempotency-Key header is empty."),
        ((b'""',), "The Idempotency-Key header is empty."),
        ((b"k" * 256,), "The Idempotency-Key is longer than 255 characters."),
        ((b'"' + b"k" * 256 + b'"',), "The Idempotency-Key is longer than 255 characters."),
        (
            (b"two words",),
            "The Idempotency-Key may contain only visible ASCII characters (no spaces).",
        ),
        (
            (b"del\x7f",),
            "The Idempotency-Key may contain only visible ASCII characters (no spaces).",
        ),
        ((b'"',), "The quoted Idempotency-Key has no closing quote."),
        ((b'"abc',), "The quoted Idempotency-Key has no closing quote."),
        ((b'"a\\bc"',), "The quoted Idempotency-Key has an invalid escape."),
        ((b'"a"bc"',), "The quoted Idempotency-Key has an unescaped quote."),
        ((b'"abc\\"',), "The quoted Idempotency-Key ends in a lone backslash."),
    ],
    ids=[
        "twice",
        "blank",
        "empty-string",
        "256",
        "256-quoted",
        "space",
        "del",
        "lone-quote",
        "unclosed",
        "bad-escape",
        "inner-quote",
        "lone-backslash",
    ],
)
async def test_a_refused_key_is_told_why_and_nothing_runs(app, db, tenant, values, reason):
    async with client(app) as http:
        response = await http.post("/tx/charge", json={}, headers=_with_key(tenant, *values))
    body = assert_problem(response, 400, "invalid-key")
    assert body["detail"] == reason + SEND_ONE
    assert await effects(db, tenant) == 0


@pytest.mark.parametrize(
    ("sent", "key"),
    [
        (b"abc", "abc"),
        (b' \t"abc" ', "abc"),  # surrounding blanks are not part of the value
        (b'"a\\"b"', 'a"b'),
        (b'"a\\\\b"', "a\\b"),
        (b'"\\"\\\\x"', '"\\x'),  # one escape right after another, then a plain character
        (b'"#a#"', "#a#"),
        (b"!~", "!~"),  # the first and last visible characters
        (b'"' + b"k" * 255 + b'"', "k" * 255),
    ],
    ids=["bare", "blanks", "escaped-quote", "escaped-backslash", "escapes", "hash", "edges", "255"],
)
async def test_an_accepted_key_is_stored_as_its_value(app, db, tenant, sent, key):
    async with client(app) as http:
        first = await http.post("/tx/charge", json={}, headers=_with_key(tenant, sent))
        # The same key written as the other form (bare where it can be, else quoted).
        other = key.encode() if b'"' in sent and '"' not in key and "\\" not in key else sent
        again = await http.post("/tx/charge", json={}, headers=_with_key(tenant, other))
    assert first.status_code == 201
    assert (await key_row(db, tenant, key))["state"] == "completed"
    assert again.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant) == 1
