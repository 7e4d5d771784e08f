"""The HTTP contract (docs/contract.md), row by row, in process (httpx's ASGITransport) on real
PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest

from idempotency_asgi import IdempotencyConfig
from tests.apps import build_app, tenant_from_header
from tests.helpers import (
    assert_problem,
    client,
    effects,
    eventually,
    headers,
    key_row,
    new_key,
    running,
)


@pytest.fixture
def app(schema):
    return build_app(schema)


async def test_other_methods_pass_through_untouched(app, db, tenant):
    async with client(app) as http:
        response = await http.get("/read", headers={"idempotency-key": ""})
    assert response.status_code == 200
    assert response.text == "read"


async def test_new_key_runs_once_and_stores_before_sending(app, db, tenant):
    key = new_key()
    async with client(app) as http:
        response = await http.post("/tx/charge", json={"amount": 5}, headers=headers(tenant, key))
    assert response.status_code == 201
    assert "idempotent-replayed" not in response.headers
    row = await key_row(db, tenant, key)
    assert row["state"] == "completed"
    assert row["response_status"] == 201
    assert bytes(row["response_body"]) == response.content
    assert row["method"] == "POST" and row["path"] == "/tx/charge"
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize("path", ["/tx/charge", "/plain/charge"])
async def test_replay_is_byte_identical_and_marked(app, db, tenant, path):
    key = new_key()
    async with client(app) as http:
        first = await http.post(path, json={"amount": 5}, headers=headers(tenant, key))
        replays = [
            await http.post(path, json={"amount": 5}, headers=headers(tenant, key))
            for _ in range(3)
        ]
    for replay in replays:
        assert replay.status_code == first.status_code == 201
        assert replay.content == first.content
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.headers["x-custom"] == "kept"
        assert replay.headers["content-type"] == first.headers["content-type"]
        # A cookie minted for the first caller is never handed out again.
        assert "set-cookie" in first.headers and "set-cookie" not in replay.headers
    assert await effects(db, tenant, key) == 1


async def test_stored_4xx_is_replayed(app, db, tenant):
    key = new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge", json={}, headers=headers(tenant, key, x_status="402"))
        again = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert first.status_code == again.status_code == 402
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1  # a 4xx commits the handler's writes too


async def test_missing_key_is_400_and_nothing_runs(app, db, tenant):
    async with client(app) as http:
        response = await http.post("/tx/charge", json={}, headers=headers(tenant))
    assert_problem(response, 400, "missing-key")
    assert await effects(db, tenant) == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"k" * 256,
        b"has space",
        "k\u00e9y".encode(),
        b"tab\tkey",
        b'"unterminated',
        b'"bad\\escape"',
        b'""',
    ],
    ids=[
        "empty",
        "256-chars",
        "space",
        "non-ascii",
        "tab",
        "open-quote",
        "bad-escape",
        "empty-quoted",
    ],
)
async def test_invalid_key_is_400_and_nothing_runs(app, db, tenant, raw):
    async with client(app) as http:
        response = await http.post(
            "/tx/charge",
            json={},
            headers=[(b"x-tenant", tenant.encode()), (b"idempotency-key", raw)],
        )
    assert_problem(response, 400, "invalid-key")
    assert await effects(db, tenant) == 0


async def test_key_sent_twice_is_400(app, db, tenant):
    async with client(app) as http:
        response = await http.post(
            "/tx/charge",
            json={},
            headers=[
                (b"x-tenant", tenant.encode()),
                (b"idempotency-key", b"a"),
                (b"idempotency-key", b"a"),
            ],
        )
    assert_problem(response, 400, "invalid-key")
    assert await effects(db, tenant) == 0


async def test_longest_key_and_quoted_form_are_accepted(app, db, tenant):
    longest = "k" * 255
    async with client(app) as http:
        first = await http.post("/tx/charge", json={}, headers=headers(tenant, longest))
        bare = await http.post("/tx/charge", json={}, headers=headers(tenant, "abc"))
        quoted = await http.post("/tx/charge", json={}, headers=headers(tenant, '"abc"'))
    assert first.status_code == 201 and bare.status_code == 201
    # "abc" (RFC 8941 string) and abc are the same key: the second is a replay.
    assert quoted.headers["idempotent-replayed"] == "true"
    assert quoted.content == bare.content
    assert await effects(db, tenant) == 2


async def test_no_tenant_is_401_and_nothing_runs(app, db):
    key = new_key()
    async with client(app) as http:
        response = await http.post("/tx/charge", json={}, headers={"idempotency-key": key})
    assert_problem(response, 401, "unauthenticated")
    assert await db.fetchval("SELECT count(*) FROM effects WHERE idempotency_key = $1", key) == 0
    assert (
        await db.fetchval("SELECT count(*) FROM idempotency_keys WHERE idempotency_key = $1", key)
        == 0
    )


@pytest.mark.parametrize("key", [None, "", "two words"], ids=["no-key", "empty", "invalid"])
async def test_a_caller_without_credentials_hears_that_first(app, db, key):
    # Without a tenant a request is refused as unauthenticated, whatever else is wrong
    # with it: the caller learns first that it must authenticate.
    sent = {} if key is None else {"idempotency-key": key}
    async with client(app) as http:
        response = await http.post("/tx/charge", json={}, headers=sent)
    assert_problem(response, 401, "unauthenticated")
    assert "www-authenticate" not in response.headers  # the app did not name its scheme


async def test_the_401_carries_the_challenge_the_application_names(schema, db):
    app = build_app(schema, www_authenticate='Bearer realm="payments"')
    async with client(app) as http:
        response = await http.post("/tx/charge", json={}, headers={"idempotency-key": new_key()})
    assert_problem(response, 401, "unauthenticated")
    assert response.headers["www-authenticate"] == 'Bearer realm="payments"'


async def test_async_tenant_resolver(schema, db, tenant):
    seen = []

    async def resolve(scope):
        await asyncio.sleep(0)
        seen.append(scope["path"])
        return tenant_from_header(scope)

    app = build_app(schema)
    app.user_middleware[0].kwargs["tenant"] = resolve
    key = new_key()
    async with client(app) as http:
        response = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert response.status_code == 201
    assert seen == ["/tx/charge"]
    assert (await key_row(db, tenant, key))["state"] == "completed"


async def test_body_over_limit_is_413_and_nothing_is_reserved(schema, db, tenant):
    app = build_app(schema, max_body_bytes=1000)
    key = new_key()

    async def chunked():
        for _ in range(11):
            yield b"x" * 100

    async with client(app) as http:
        declared = await http.post("/tx/charge", content=b"x" * 1001, headers=headers(tenant, key))
        streamed = await http.post("/tx/charge", content=chunked(), headers=headers(tenant, key))
        at_limit = await http.post("/tx/charge", content=b"x" * 1000, headers=headers(tenant, key))
    assert_problem(declared, 413, "body-too-large")
    assert_problem(streamed, 413, "body-too-large")
    assert "content-length" not in streamed.request.headers
    # Nothing was lost: the key is still free for the request at the limit.
    assert at_limit.status_code == 201
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b'{"a": 1, "b": [1, 2]}', b'{"b":[1,2],"a":1}'),
        (b'{"a": {"y": 1, "x": 2}}', b'{\n  "a": {"x": 2, "y": 1}\n}'),
    ],
)
async def test_json_key_order_and_spacing_do_not_change_the_fingerprint(
    app, db, tenant, first, second
):
    key = new_key()
    json_headers = headers(tenant, key, content_type="application/json")
    async with client(app) as http:
        one = await http.post("/tx/charge", content=first, headers=json_headers)
        two = await http.post("/tx/charge", content=second, headers=json_headers)
    assert two.headers["idempotent-replayed"] == "true"
    assert two.content == one.content
    assert await effects(db, tenant, key) == 1


async def test_form_pairs_keep_the_order_they_were_sent_in(app, db, tenant):
    key = new_key()
    form = headers(tenant, key, content_type="application/x-www-form-urlencoded")
    async with client(app) as http:
        first = await http.post(
            "/tx/charge", content=b"item=apple&qty=1&item=pear&qty=5", headers=form
        )
        again = await http.post(
            "/tx/charge", content=b"item=apple&qty=1&item=pear&qty=5", headers=form
        )
        # The same pairs in another order: an application pairing items with quantities by
        # position (form.multi_items()) reads 1 pear and 5 apples... or 1 apple and 1 pear.
        regrouped = await http.post(
            "/tx/charge", content=b"item=apple&item=pear&qty=1&qty=5", headers=form
        )
        # Any other order is another request: a client that reorders its retry gets a 422.
        moved = await http.post(
            "/tx/charge", content=b"qty=1&item=apple&qty=5&item=pear", headers=form
        )
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert_problem(regrouped, 422, "key-reused")
    assert_problem(moved, 422, "key-reused")
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # Starlette decodes raw bytes as Latin-1 and escapes as UTF-8: "é" against "Ã©".
        (b"a=%C3%A9", b"a=\xc3\xa9"),
        # Parsers that split pairs on ";" too see b=[2, 3] against b=[3, 2].
        (b"b=2&a=1;b=3", b"a=1;b=3&b=2"),
        # One name for a parser that folds case or decodes escapes: its values keep their order.
        (b"A=1&a=2", b"a=2&A=1"),
        (b"n%C3%A9=1&n\xc3\xa9=2", b"n\xc3\xa9=2&n%C3%A9=1"),
        (b"x%5B%5D=1&x[]=2", b"x[]=2&x%5B%5D=1"),
    ],
)
async def test_form_bodies_that_differ_never_share_a_fingerprint(app, db, tenant, first, second):
    key = new_key()
    form = headers(tenant, key, content_type="application/x-www-form-urlencoded")
    async with client(app) as http:
        original = await http.post("/tx/charge", content=first, headers=form)
        reused = await http.post("/tx/charge", content=second, headers=form)
    assert original.status_code == 201
    assert_problem(reused, 422, "key-reused")
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # Integers beyond 64 bits, which a float would make one number.
        (b'{"n": 18446744073709551616}', b'{"n": 18446744073709551617}'),
        # Two literals of one float: a Decimal field tells them apart.
        (b'{"amount": 0.1}', b'{"amount": 0.10000000000000001}'),
        (b'{"n": 1}', b'{"n": 1.0}'),
        (b'{"n": 1e400}', b'{"n": 2e400}'),
        # Parsers disagree on which duplicate wins: both orders are kept.
        (b'{"a": 1, "a": 2}', b'{"a": 2, "a": 1}'),
        (b'{"a": 1, "a": 2}', b'{"a": 2}'),
        (rb'"\ud800"', rb'"\ud801"'),
    ],
    ids=[
        "beyond-64-bits",
        "float-literals",
        "int-vs-float",
        "huge",
        "duplicates",
        "dup-vs-one",
        "lone-surrogates",
    ],
)
async def test_json_bodies_that_differ_never_share_a_fingerprint(app, db, tenant, first, second):
    key = new_key()
    json_headers = headers(tenant, key, content_type="application/json")
    async with client(app) as http:
        original = await http.post("/tx/charge", content=first, headers=json_headers)
        other = await http.post("/tx/charge", content=second, headers=json_headers)
        retry = await http.post("/tx/charge", content=first, headers=json_headers)
    assert original.status_code == 201
    assert_problem(other, 422, "key-reused")
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == original.content
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 300 + b"]" * 300,
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b"[" * 100_000,
        b"\xef\xbb\xbf{}",  # a byte order mark
        b'{"a": "\xff\xfe"}',  # not UTF-8
        b'{"a": NaN, "b": -Infinity}',
        b"",
    ],
    ids=["300-deep", "5000-deep", "unclosed", "bom", "invalid-utf8", "nan", "empty"],
)
async def test_any_json_body_is_answered_by_the_app_and_replayed(app, db, tenant, body):
    key = new_key()
    json_headers = headers(tenant, key, content_type="application/json")
    async with client(app) as http:
        first = await http.post("/tx/charge", content=body, headers=json_headers)
        again = await http.post("/tx/charge", content=body, headers=json_headers)
        changed = await http.post("/tx/charge", content=body + b" x", headers=json_headers)
    assert first.status_code == 201, first.text  # the app decides, never the middleware
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert_problem(changed, 422, "key-reused")
    assert await effects(db, tenant, key) == 1


def multipart(boundary: str, *parts: tuple[str, str | None, bytes]) -> bytes:
    out = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        if filename is not None:
            out += b"Content-Type: application/octet-stream\r\n"
        out += b"\r\n" + content + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


async def test_multipart_retry_with_a_new_boundary_replays(app, db, tenant):
    key = new_key()
    parts = [("amount", None, b"100"), ("receipt", "r.pdf", b"%PDF-1.7\r\n--x\r\n")]

    def send(http, boundary, *body_parts):
        return http.post(
            "/tx/charge",
            content=multipart(boundary, *body_parts),
            headers=headers(tenant, key, content_type=f"multipart/form-data; boundary={boundary}"),
        )

    async with client(app) as http:
        first = await send(http, "a1b2c3", *parts)
        rebuilt = await send(http, "zz-9f8e7d", *parts)
        renamed = await send(http, "q", ("amount", None, b"100"), ("receipt", "s.pdf", parts[1][2]))
        other = await send(http, "q", ("amount", None, b"101"), parts[1])
        fewer = await send(http, "q", parts[0])
    assert first.status_code == 201
    assert rebuilt.headers["idempotent-replayed"] == "true" and rebuilt.content == first.content
    for changed in (renamed, other, fewer):
        assert_problem(changed, 422, "key-reused")
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize(
    ("first_type", "second_type", "body"),
    [
        # The charset says what the parts' bytes mean: not a parameter to drop with the boundary.
        (
            "multipart/form-data; boundary=q; charset=utf-8",
            "multipart/form-data; boundary=q; charset=latin-1",
            multipart("q", ("name", None, "é".encode())),
        ),
        # Not readable as parts (no close delimiter): its bytes, and the boundary with them.
        (
            "multipart/form-data; boundary=A",
            "multipart/form-data; boundary=Z",
            b'--A\r\nContent-Disposition: form-data; name="x"\r\n\r\n1\r\n--A\r\n',
        ),
    ],
)
async def test_multipart_bodies_read_differently_never_share_a_fingerprint(
    app, db, tenant, first_type, second_type, body
):
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/tx/charge", content=body, headers=headers(tenant, key, content_type=first_type)
        )
        second = await http.post(
            "/tx/charge", content=body, headers=headers(tenant, key, content_type=second_type)
        )
    assert first.status_code == 201
    assert_problem(second, 422, "key-reused")
    assert await effects(db, tenant, key) == 1


_AMOUNT = multipart("real", ("amount", None, b"100"))
_OTHER_AMOUNT = multipart("real", ("amount", None, b"999999"))


@pytest.mark.parametrize(
    ("first_type", "first_body", "second_type", "second_body"),
    [
        # Parsers take the first or the last of a repeated boundary: the app reads the second
        # body's own parts, which sit in what the first boundary would call a preamble.
        (
            "multipart/form-data; boundary=decoy; boundary=real",
            _AMOUNT + b"\r\n--decoy--\r\n",
            "multipart/form-data; boundary=decoy; boundary=real",
            _OTHER_AMOUNT + b"\r\n--decoy--\r\n",
        ),
        # A boundary hidden in another parameter's quoted value.
        (
            'multipart/form-data; note="x; boundary=decoy"; boundary=real',
            _AMOUNT + b'\r\n--decoy"--\r\n',
            'multipart/form-data; note="x; boundary=decoy"; boundary=real',
            _OTHER_AMOUNT + b'\r\n--decoy"--\r\n',
        ),
        # An escaped quote inside the quoted boundary.
        (
            'multipart/form-data; boundary="re\\"al"',
            multipart('re"al', ("amount", None, b"100")),
            'multipart/form-data; boundary="re\\"al"',
            multipart('re"al', ("amount", None, b"999999")),
        ),
        # A preamble, and padding after a delimiter: one parser skips them, another refuses
        # the body, so the two cannot be one request.
        (
            "multipart/form-data; boundary=real",
            _AMOUNT,
            "multipart/form-data; boundary=real",
            b"junk\r\n" + _AMOUNT,
        ),
        (
            "multipart/form-data; boundary=real",
            _AMOUNT,
            "multipart/form-data; boundary=real",
            _AMOUNT.replace(b"--real\r\n", b"--real  \r\n", 1),
        ),
    ],
    ids=[
        "repeated-boundary",
        "boundary-in-a-quoted-value",
        "escaped-boundary",
        "preamble",
        "padding",
    ],
)
async def test_multipart_a_parser_could_read_apart_is_another_request(
    app, db, tenant, first_type, first_body, second_type, second_body
):
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/tx/charge", content=first_body, headers=headers(tenant, key, content_type=first_type)
        )
        second = await http.post(
            "/tx/charge",
            content=second_body,
            headers=headers(tenant, key, content_type=second_type),
        )
    assert first.status_code == 201
    assert_problem(second, 422, "key-reused")
    assert await effects(db, tenant, key) == 1


async def test_a_path_with_nul_is_answered_by_the_app_and_recorded(app, db, tenant):
    # `%00` decodes to a NUL, which a text column cannot hold: the path is stored escaped
    # (it is there for people to read), and the app's own 404 is the answer, then replayed.
    key = new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge%00", content=b"{}", headers=headers(tenant, key))
        again = await http.post("/tx/charge%00", content=b"{}", headers=headers(tenant, key))
    assert first.status_code == 404
    assert again.status_code == 404 and again.headers["idempotent-replayed"] == "true"
    row = await key_row(db, tenant, key)
    assert row["path"] == "/tx/charge\\x00" and row["response_status"] == 404


@pytest.mark.parametrize("tenant_id", ["acme\x00", "acme\udcff"])
async def test_a_tenant_id_postgresql_cannot_store_is_unauthenticated(schema, db, tenant_id):
    app = build_app(schema, tenant=lambda scope: tenant_id)
    key = new_key()
    async with client(app) as http:
        answer = await http.post("/tx/charge", json={}, headers=headers(None, key))
    # Never rewritten into another id (that could be another tenant's), never a 5xx.
    assert_problem(answer, 401, "unauthenticated")
    assert (
        await db.fetchval("SELECT count(*) FROM idempotency_keys WHERE idempotency_key = $1", key)
        == 0
    )


async def test_same_bytes_as_another_media_type_is_another_request(app, db, tenant):
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/tx/charge", content=b"a=1", headers=headers(tenant, key, content_type="text/plain")
        )
        form = await http.post(
            "/tx/charge",
            content=b"a=1",
            headers=headers(tenant, key, content_type="application/x-www-form-urlencoded"),
        )
    assert first.status_code == 201
    assert_problem(form, 422, "key-reused")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/tx/charge", b'{"amount": 6}'),  # other body
        ("POST", "/tx/charge?currency=eur", b'{"amount": 5}'),  # other query
        ("POST", "/tx/other", b'{"amount": 5}'),  # other path
        ("PATCH", "/tx/charge", b'{"amount": 5}'),  # other method
    ],
)
async def test_reuse_for_a_different_request_is_422_and_nothing_runs(
    app, db, tenant, method, path, body
):
    key = new_key()
    json_headers = headers(tenant, key, content_type="application/json")
    async with client(app) as http:
        first = await http.post("/tx/charge", content=b'{"amount": 5}', headers=json_headers)
        reused = await http.request(method, path, content=body, headers=json_headers)
        original = await http.post("/tx/charge", content=b'{"amount": 5}', headers=json_headers)
    assert first.status_code == 201
    assert_problem(reused, 422, "key-reused")
    assert original.content == first.content  # the record is untouched
    assert await effects(db, tenant, key) == 1


async def test_in_flight_duplicate_is_409_with_retry_after(schema, db, tenant):
    app = build_app(schema, lease_seconds=5)
    key = new_key()
    async with client(app) as http:
        slow = asyncio.create_task(
            http.post("/tx/charge", json={"a": 1}, headers=headers(tenant, key, x_delay_ms="800"))
        )
        await running(db, tenant, key)
        duplicate = await http.post("/tx/charge", json={"a": 1}, headers=headers(tenant, key))
        other = await http.post("/tx/charge", json={"a": 2}, headers=headers(tenant, key))
        first = await slow
        after = await http.post("/tx/charge", json={"a": 1}, headers=headers(tenant, key))
    assert_problem(duplicate, 409, "request-in-progress")
    assert 1 <= int(duplicate.headers["retry-after"]) <= 5
    # A different request on an in-flight key is a mismatch, not a conflict.
    assert_problem(other, 422, "key-reused")
    assert first.status_code == 201
    assert after.content == first.content and after.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize("status", ["500", "503", "429"])
async def test_5xx_and_transient_answers_release_the_key_and_roll_back(app, db, tenant, status):
    key = new_key()
    async with client(app) as http:
        failed = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_status=status)
        )
        assert await key_row(db, tenant, key) is None
        assert await effects(db, tenant, key) == 0  # the handler's write rolled back
        retried = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert failed.status_code == int(status)
    assert "idempotent-replayed" not in retried.headers
    assert retried.status_code == 201
    assert await effects(db, tenant, key) == 1


async def test_plain_mode_5xx_releases_the_key(app, db, tenant):
    key = new_key()
    async with client(app) as http:
        failed = await http.post(
            "/plain/charge", json={}, headers=headers(tenant, key, x_status="500")
        )
        retried = await http.post("/plain/charge", json={}, headers=headers(tenant, key))
    assert failed.status_code == 500 and retried.status_code == 201
    assert "idempotent-replayed" not in retried.headers
    # Plain mode has no transaction to roll back: the failed attempt's write stays.
    assert await effects(db, tenant, key) == 2


async def test_exception_releases_the_key_and_rolls_back(schema, db, tenant):
    app = build_app(schema)
    key = new_key()
    async with client(app) as http:
        with pytest.raises(RuntimeError, match="handler failed"):
            await http.post("/tx/charge", json={}, headers=headers(tenant, key, x_raise="1"))
        assert await key_row(db, tenant, key) is None
        assert await effects(db, tenant, key) == 0
        retried = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert retried.status_code == 201
    assert await effects(db, tenant, key) == 1


async def test_cancellation_releases_the_key_and_rolls_back(app, db, tenant):
    key = new_key()
    async with client(app) as http:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="2000")),
                timeout=0.5,
            )
        await eventually(lambda: _released(db, tenant, key))
        assert await effects(db, tenant, key) == 0
        retried = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert retried.status_code == 201
    assert await effects(db, tenant, key) == 1


async def test_same_key_in_another_tenant_is_independent(app, db, tenant):
    key = new_key()
    other = tenant + "-other"
    async with client(app) as http:
        mine = await http.post("/tx/charge", json={"a": 1}, headers=headers(tenant, key))
        # Same key, different body, other tenant: no 422, no replay, no hint.
        theirs = await http.post("/tx/charge", json={"a": 2}, headers=headers(other, key))
    assert mine.status_code == theirs.status_code == 201
    assert "idempotent-replayed" not in theirs.headers
    assert mine.json()["effect_id"] != theirs.json()["effect_id"]
    assert await effects(db, tenant, key) == 1
    assert await effects(db, other, key) == 1


async def test_key_past_retention_is_new(app, db, tenant):
    key = new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge", json={"a": 1}, headers=headers(tenant, key))
        await db.execute(
            "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'"
            " WHERE tenant_id = $1 AND idempotency_key = $2",
            tenant,
            key,
        )
        # Past retention even a different request may use the key.
        second = await http.post("/tx/charge", json={"a": 2}, headers=headers(tenant, key))
    assert second.status_code == 201
    assert "idempotent-replayed" not in second.headers
    assert second.json()["effect_id"] != first.json()["effect_id"]
    assert await effects(db, tenant, key) == 2


async def test_key_optional_where_configured(schema, db, tenant):
    app = build_app(schema, required_paths=["/tx/*"], exempt_paths=["/exempt/*"])
    async with client(app) as http:
        unkeyed = await http.post("/plain/optional", json={}, headers=headers(tenant))
        keyed = await http.post("/plain/optional", json={}, headers=headers(tenant, "opt"))
        replay = await http.post("/plain/optional", json={}, headers=headers(tenant, "opt"))
        required = await http.post("/tx/charge", json={}, headers=headers(tenant))
        # Exempt paths are untouched, even with a key (a webhook receiver has its own dedup).
        hooks = [
            await http.post("/exempt/hook", json={}, headers=headers(tenant, "hook"))
            for _ in range(2)
        ]
    assert unkeyed.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true" and keyed.status_code == 201
    assert_problem(required, 400, "missing-key")
    assert all("idempotent-replayed" not in hook.headers for hook in hooks)
    assert await effects(db, tenant) == 1 + 1 + 2
    assert await key_row(db, tenant, "hook") is None


async def test_response_too_large_to_store_is_sent_once_and_never_rerun(schema, db, tenant):
    calls: list[str] = []
    app = build_app(schema, calls=calls, max_stored_response_bytes=1000)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/big?size=5000", headers=headers(tenant, key))
        retry = await http.post("/big?size=5000", headers=headers(tenant, key))
        small = await http.post("/big?size=1000", headers=headers(tenant, key + "-small"))
        small_replay = await http.post("/big?size=1000", headers=headers(tenant, key + "-small"))
    assert first.status_code == 201 and first.content == b"x" * 5000
    body = assert_problem(retry, 409, "response-not-replayable")
    assert body["original_status"] == 201
    assert small_replay.content == small.content == b"x" * 1000
    assert calls == ["/big", "/big"]  # the large one ran once; so did the small one
    row = await key_row(db, tenant, key)
    assert row["state"] == "completed" and row["response_body"] is None


async def test_streaming_response_is_stored_and_replayed(schema, db, tenant):
    calls: list[str] = []
    app = build_app(schema, calls=calls)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/stream?parts=4&size=100", headers=headers(tenant, key))
        again = await http.post("/stream?parts=4&size=100", headers=headers(tenant, key))
    assert first.content == b"a" * 100 + b"b" * 100 + b"c" * 100 + b"d" * 100
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert calls == ["/stream"]


async def test_overflowing_stream_is_streamed_through_and_not_rerun(schema, db, tenant):
    calls: list[str] = []
    app = build_app(schema, calls=calls, max_stored_response_bytes=250)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/stream?parts=5&size=100", headers=headers(tenant, key))
        again = await http.post("/stream?parts=5&size=100", headers=headers(tenant, key))
    assert first.status_code == 200 and len(first.content) == 500
    assert_problem(again, 409, "response-not-replayable")
    assert calls == ["/stream"]


async def _released(db, tenant, key):
    return await key_row(db, tenant, key) is None


async def test_recorded_responses_advertise_when_the_key_expires(schema, db, tenant):
    from email.utils import parsedate_to_datetime

    app = build_app(schema, ttl_seconds=3600)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        replay = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        failed = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, new_key(), x_status="500")
        )
    advertised = first.headers["idempotency-key-expires"]
    assert replay.headers["idempotency-key-expires"] == advertised
    row = await key_row(db, tenant, key)
    assert parsedate_to_datetime(advertised) == row["expires_at"].replace(microsecond=0)
    lifetime = row["expires_at"] - row["completed_at"]
    assert lifetime.total_seconds() == pytest.approx(3600, abs=1)
    assert "idempotency-key-expires" not in failed.headers  # nothing was kept


async def test_outcome_unknown_keeps_the_key_reserved_until_its_lease_lapses(schema, db, tenant):
    app = build_app(schema, lease_seconds=1.0)
    key = new_key()
    async with client(app) as http:
        first = await http.post(
            "/plain/charge", json={}, headers=headers(tenant, key, x_unknown="1")
        )
        meanwhile = await http.post("/plain/charge", json={}, headers=headers(tenant, key))
        assert (await key_row(db, tenant, key))["state"] == "in_flight"
        await asyncio.sleep(1.3)  # nothing renews the lease any more: it lapses
        later = await http.post("/plain/charge", json={}, headers=headers(tenant, key))
    assert_problem(first, 504, "outcome-unknown")
    assert int(first.headers["retry-after"]) >= 1
    assert_problem(meanwhile, 409, "request-in-progress")  # no second run while unknown
    assert later.status_code == 201 and "idempotent-replayed" not in later.headers
    # Plain mode: the first attempt's write stays; that is the window the app declared.
    assert await effects(db, tenant, key) == 2


@pytest.mark.parametrize(
    "names",
    [("Idempotency-Replayed",), ("Idempotent-Replayed", "Idempotency-Replayed")],
    ids=["the draft's name", "both"],
)
async def test_replay_headers_names_the_headers_a_replay_carries(schema, tenant, names):
    app = build_app(schema, replay_headers=names)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        replay = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert first.status_code == 201
    wanted = {name.lower() for name in names}
    for name in ("idempotent-replayed", "idempotency-replayed"):
        assert replay.headers.get(name) == ("true" if name in wanted else None), name
        assert name not in first.headers
    assert replay.content == first.content


@pytest.mark.parametrize(
    "names",
    [
        (),
        "Idempotent-Replayed",
        ("bad name",),
        # Names that frame the message or mean something else: the gateway drops the replay
        # headers from every upstream answer, and would drop these.
        ("Content-Length",),
        ("Idempotent-Replayed", "Transfer-Encoding"),
        ("connection",),
        ("Content-Type",),
    ],
)
def test_replay_headers_must_name_headers(names):
    with pytest.raises(ValueError, match="replay_headers"):
        IdempotencyConfig(replay_headers=names)
