"""The tenant resolver: what happens when it fails, and how a real FastAPI app gives it the
caller its authentication found.

A resolver that raises, or returns neither a str nor None, is the application's fault: the
client gets a 500 problem that says so (never a bare text/plain traceback), the request gets
its one log line with the error's traceback, no tenant is guessed and the handler never runs.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.types import Scope

from idempotency_asgi.problems import TYPE_PREFIX
from tests.apps import build_app
from tests.helpers import assert_problem, client, effects, headers, key_row, new_key


def raises(scope: Scope) -> str | None:
    raise RuntimeError("the token service is down")


async def raises_later(scope: Scope) -> str | None:
    raise LookupError("no such API key table")


def returns_an_int(scope: Scope) -> Any:
    return 42


def returns_bytes(scope: Scope) -> Any:
    return b"acme"


@pytest.mark.parametrize(
    ("resolver", "error"),
    [
        (raises, "RuntimeError('the token service is down')"),
        (raises_later, "LookupError('no such API key table')"),
        (returns_an_int, "TypeError('the tenant resolver must return a str or None, not 42')"),
        (
            returns_bytes,
            "TypeError(\"the tenant resolver must return a str or None, not b'acme'\")",
        ),
    ],
    ids=["raises", "async, raises", "an int", "bytes"],
)
async def test_a_failing_resolver_is_a_500_problem_one_line_and_no_run(
    schema, db, caplog, resolver, error
):
    calls: list[str] = []
    key = new_key()
    app = build_app(schema, tenant=resolver, calls=calls)
    with caplog.at_level(logging.INFO, logger="idempotency_asgi"):
        async with client(app) as http:
            answer = await http.post("/tx/charge", json={}, headers=headers("acme", key))
            unkeyed = await http.post("/tx/charge", json={}, headers=headers("acme"))
            read = await http.get("/read")  # not covered: the resolver is not asked
    body = assert_problem(answer, 500, "tenant-resolver-failed")
    assert body["code"] == "tenant-resolver-failed"
    assert "token service" not in answer.text  # the error is the operators', not the caller's
    assert_problem(unkeyed, 500, "tenant-resolver-failed")  # asked first, before the key
    assert read.status_code == 200
    assert calls == []
    assert await effects(db, "acme", key) == 0 and await key_row(db, "acme", key) is None
    lines = [record for record in caplog.records if hasattr(record, "idempotency")]
    assert len(lines) == 2  # one per keyed (or key-requiring) request
    line = lines[0]
    assert line.levelno == logging.ERROR
    assert line.idempotency["case"] == "tenant_failed"
    assert line.idempotency["outcome"] == "tenant_error"
    assert line.idempotency["status"] == 500 and line.idempotency["tenant"] is None
    assert line.idempotency["error"] == error
    assert line.exc_info is not None  # its traceback, for the operator


def test_the_problem_type_is_stable():
    from idempotency_asgi import problems

    problem = problems.tenant_resolver_failed()
    assert problem.type == TYPE_PREFIX + "tenant-resolver-failed"
    assert problem.status == 500
