"""Property-based fuzz over real HTTP: a real uvicorn process serving an echo app
(tests/fuzz_app.py) behind IdempotencyMiddleware, on the real PostgreSQL.

Properties, each judged from the wire and from the application's own record of its runs:
  1. no 5xx, ever: the application never answers one, so any 5xx is the middleware's;
  2. an identical retry of a recorded answer replays it byte for byte and does not run;
  3. two requests that differ never replay each other (the second gets 422 key-reused and
     does not run), while two that the fingerprint rule of docs/contract.md calls the same do
     replay;
and the key header is read as docs/contract.md says: invalid keys get 400 and nothing runs,
methods the middleware does not cover pass through untouched, whatever their key.

Profiles: `fuzz-ci` (the default: derandomized, 150 examples per test, about 20 s) and
`fuzz-long` (scripts/fuzz: 1,500 per test, 12,000 in all). FUZZ_PROFILE picks one,
FUZZ_EXAMPLES overrides its count, FUZZ_SUMMARY names a file for the JSON summary.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz_keys import (
    INVALID,
    MISSING,
    KeyHeader,
    designed_key,
    forbidden_by_http,
    key_headers,
    spellings,
)
from tests.fuzz_requests import COVERED, PASSED, Raw, Request, requests
from tests.fuzz_variants import FAMILIES, Pair, pairs
from tests.fuzz_wire import Tally, Wire, evidence, ran, refused, replayed
from tests.server import UvicornProcess

# Examples are HTTP round trips: slow by Hypothesis's measure, and deep JSON is large.
_EXPECTED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile(
    "fuzz-ci",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")),
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no explain phase: it is slow
    deadline=None,
    suppress_health_check=_EXPECTED,
)
settings.register_profile(
    "fuzz-long",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "1500")),
    deadline=None,
    suppress_health_check=_EXPECTED,
    print_blob=True,
)
fuzz = settings.get_profile(os.environ.get("FUZZ_PROFILE", "fuzz-ci"))

TALLY = Tally()


@pytest.fixture(scope="module")
def wire(schema: str) -> Iterator[Wire]:
    started = time.monotonic()
    server = UvicornProcess("tests.fuzz_app:app", {"DATABASE_URL": schema, "FUZZ_APP_SERVE": "1"})
    server.start(ready_path="/_runs/ready")
    wire = Wire(server.url, TALLY)
    try:
        yield wire
    finally:
        wire.close()
        server.stop()
        target = os.environ.get("FUZZ_SUMMARY")
        if target:
            summary = {**TALLY.summary(), "seconds": round(time.monotonic() - started, 1)}
            Path(target).write_text(json.dumps(summary, indent=2) + "\n")


def fresh_tenant() -> str:
    # A tenant per example: no example can meet another's key, shrinking included.
    return f"fuzz-{uuid.uuid4().hex}"


def passes_through(wire: Wire, request: Request, keys: tuple[bytes, ...]) -> None:
    """A method the middleware does not cover: it runs every time, never replayed."""
    tenant = fresh_tenant()
    first = ran(TALLY, wire.send(request, tenant, keys), request, wire.runs(tenant))
    second = wire.send(request, tenant, keys)
    runs = wire.runs(tenant)
    assert runs == [first, ran(TALLY, second, request, runs)], f"not two runs: {runs}"


def refused_by_the_server(wire: Wire, request: Request, keys: tuple[bytes, ...]) -> bool:
    """HTTP forbids control characters in a field value, and a server's parser may refuse
    the request before any application sees it (httptools does; h11 lets some through).
    When it did, nothing may have run and the answer is a 400."""
    tenant = fresh_tenant()
    answer = wire.send(request, tenant, keys)
    if answer.headers.get("content-type") == "application/problem+json" or answer.status_code < 400:
        return False  # it reached the application: judged as usual, under a fresh tenant
    runs = wire.runs(tenant)
    assert answer.status_code == 400 and runs == [], evidence("not refused", request, answer, runs)
    return True


@fuzz
@given(method=st.sampled_from(COVERED + PASSED), header=key_headers, data=st.data())
def test_a_key_is_read_as_the_contract_says(
    wire: Wire, method: str, header: KeyHeader, data: st.DataObject
) -> None:
    TALLY.cases["keys"] += 1
    request = Request(method, "/echo", "", b"application/json", Raw(b'{"amount": 1}'))
    if forbidden_by_http(header.values) and refused_by_the_server(wire, request, header.values):
        return
    if method in PASSED:
        passes_through(wire, request, header.values)
        return
    tenant = fresh_tenant()
    key = designed_key(header.values)
    first = wire.send(request, tenant, header.values)
    if key is MISSING or key is INVALID:
        problem = "missing-key" if key is MISSING else "invalid-key"
        refused(
            TALLY, first, request, wire.runs(tenant), status=400, problem=problem, expected_runs=0
        )
        return
    assert isinstance(key, str)
    ran(TALLY, first, request, wire.runs(tenant))
    # The same key, perhaps spelled the other way (bare or quoted): the same key.
    spelling = data.draw(st.sampled_from(spellings(key)), label="retry spelling")
    retry = wire.send(request, tenant, (spelling,))
    replayed(TALLY, retry, first, request, wire.runs(tenant))


@fuzz
@given(request=requests())
def test_any_request_gets_no_5xx_and_its_identical_retry_replays(
    wire: Wire, request: Request
) -> None:
    TALLY.cases["retries"] += 1
    keys = (uuid.uuid4().hex.encode(),)
    if request.method in PASSED:
        passes_through(wire, request, keys)
        return
    tenant = fresh_tenant()
    first = wire.send(request, tenant, keys)
    ran(TALLY, first, request, wire.runs(tenant))
    retry = wire.send(request, tenant, keys)
    replayed(TALLY, retry, first, request, wire.runs(tenant))


@pytest.mark.parametrize("family", FAMILIES)
@fuzz
@given(data=st.data())
def test_a_key_replays_only_the_same_request(wire: Wire, family: str, data: st.DataObject) -> None:
    pair: Pair = data.draw(pairs(family), label="pair")
    TALLY.cases[f"variants-{family}"] += 1
    tenant, keys = fresh_tenant(), (uuid.uuid4().hex.encode(),)
    first = wire.send(pair.base, tenant, keys)
    ran(TALLY, first, pair.base, wire.runs(tenant))
    second = wire.send(pair.variant, tenant, keys)
    runs = wire.runs(tenant)
    if pair.same:
        replayed(TALLY, second, first, pair.variant, runs)
    else:
        refused(
            TALLY, second, pair.variant, runs, status=422, problem="key-reused", expected_runs=1
        )
