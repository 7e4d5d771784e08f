"""The IETF Idempotency-Key draft's cases, as anyonce's conformance suite states them: its `core`
tier (what the draft says) passes with the defaults, and its `profile` tier (choices where the
draft is silent: the replay header's name, the problem's `code`, an answer too large to store
replayed empty) passes with the options set that its documentation names.

The suite's vectors (github.com/sns45/anyonce, conformance/vectors, Apache-2.0) run on Bun; the
same cases are written here as data of this suite's own, one per vector, named by the vector's
id, against the fixture app its README describes (echo, status, slow, large, counter). With the
defaults, the profile cases that differ are exactly the documented differences: the replay is
marked `Idempotent-Replayed`, and an answer too large to store is a 409.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from tests.helpers import client

#: The options that make the answers anyonce's profile (docs/contract.md, "Interoperability").
PROFILE = {
    "replay_headers": ("Idempotency-Replayed",),
    "omitted_replay_header": "Idempotency-Replay",
}

ABSENT = object()


@dataclass
class Step:
    name: str
    method: str
    path: str
    key: str | None = None
    body: str = ""
    status: int = 200
    headers: dict[str, Any] = field(default_factory=dict)  # a value, ABSENT or re.Pattern
    body_is: str | None = None  # the body's text, or "=<step>": the same bytes as that step's
    json: dict[str, Any] = field(default_factory=dict)  # top-level members of a JSON body
    size: int | None = None  # the body's length in bytes
    runs: int | None = None  # the handler's runs so far, after this step (and its group)
    alongside: str | None = None  # sent while that earlier step is still in flight...
    delay: float = 0.0  # ...this long after it was sent; or, alone, after the step before


def post(name: str, path: str, key: str | None, body: str, **expect: Any) -> Step:
    return Step(name, "POST", path, key, body, **expect)


PROBLEM = re.compile(r"^application/problem\+json")
SECONDS = re.compile(r"^[1-9][0-9]*$")

CORE = {
    "core/post-executes-once": [
        post("first", "/echo", "k-post-once-1", "hello", status=201, body_is="hello", runs=1),
    ],
    "core/key-missing-required": [
        post("missing", "/echo", None, "no key", status=400, runs=0),
    ],
    "core/retry-replays": [
        post("first", "/echo", "k-retry-1", "payload-a", status=201, body_is="payload-a", runs=1),
        post("retry", "/echo", "k-retry-1", "payload-a", status=201, body_is="=first", runs=1),
    ],
    "core/mismatch-422": [
        post("first", "/echo", "k-mismatch-1", "payload-a", status=201, runs=1),
        post("changed", "/echo", "k-mismatch-1", "payload-b", status=422, runs=1),
    ],
    "core/mismatch-does-not-poison": [
        post("first", "/echo", "k-poison-1", "payload-a", status=201, runs=1),
        post("changed", "/echo", "k-poison-1", "payload-b", status=422, runs=1),
        post("corrected", "/echo", "k-poison-1", "payload-a", status=201, body_is="=first", runs=1),
    ],
    "core/concurrent-409": [
        post("original", "/slow?ms=1500", "k-concurrent-1", "slow", body_is="slept:1500"),
        post(
            "duplicate",
            "/slow?ms=1500",
            "k-concurrent-1",
            "slow",
            status=409,
            alongside="original",
            delay=0.3,
            runs=1,
        ),
    ],
    "core/sf-string-quoted-key": [
        post("first", "/echo", '"quoted-key-1"', "quoted", status=201, body_is="quoted", runs=1),
        post("retry", "/echo", '"quoted-key-1"', "quoted", status=201, body_is="=first", runs=1),
    ],
    "core/header-name-case-insensitive": [
        post("first", "/echo", "k-case-1", "case", status=201, runs=1),
        post("retry-lowercase", "/echo", "k-case-1", "case", status=201, body_is="=first", runs=1),
    ],
    "core/get-ignored": [
        Step("get-before", "GET", "/counter", "k-get-1", json={"count": 0}),
        post("post", "/echo", "k-get-2", "x", status=201, runs=1),
        Step("get-after", "GET", "/counter", "k-get-1", json={"count": 1}),
    ],
    "core/two-keys-execute-twice": [
        post("first", "/echo", "k-two-1", "same", status=201, runs=1),
        post("second", "/echo", "k-two-2", "same", status=201, runs=2),
    ],
    # Needs a retention of 2 s at most (the suite's "short-ttl" capability): the app has it.
    "core/expiry-executes-again": [
        post("first", "/echo", "k-expiry-1", "expire", status=201, runs=1),
        post("after-expiry", "/echo", "k-expiry-1", "expire", status=201, delay=2.5, runs=2),
    ],
}

REPLAYED = "Idempotency-Replayed"

PROFILE_CASES = {
    "profile/replayed-header": [
        post("first", "/echo", "k-replayed-1", "r", status=201, headers={REPLAYED: ABSENT}),
        post("retry", "/echo", "k-replayed-1", "r", status=201, headers={REPLAYED: "true"},
             body_is="=first"),
    ],
    "profile/retry-after-on-409": [
        post("original", "/slow?ms=1500", "k-retry-after-1", "slow"),
        post("duplicate", "/slow?ms=1500", "k-retry-after-1", "slow", status=409,
             headers={"Retry-After": SECONDS}, alongside="original", delay=0.3),
    ],
    "profile/4xx-replayed": [
        post("first", "/status/404", "k-4xx-1", "s", status=404, body_is="status:404", runs=1),
        post("retry", "/status/404", "k-4xx-1", "s", status=404, body_is="=first",
             headers={REPLAYED: "true"}, runs=1),
    ],
    "profile/5xx-not-stored": [
        post("first", "/status/500", "k-5xx-1", "s", status=500, body_is="status:500", runs=1),
        post("retry", "/status/500", "k-5xx-1", "s", status=500, headers={REPLAYED: ABSENT},
             runs=2),
    ],
    "profile/omitted-body-replay": [
        post("first", "/large?bytes=1048577", "k-omitted-1", "l", size=1048577, runs=1),
        post("retry", "/large?bytes=1048577", "k-omitted-1", "l", size=0, runs=1,
             headers={REPLAYED: "true", "Idempotency-Replay": "omitted"}),
    ],
    "profile/problem-code-member": [
        post("missing", "/echo", None, "no key", status=400, json={"code": "missing-key"}),
        post("first", "/echo", "k-code-1", "payload-a", status=201),
        post("changed", "/echo", "k-code-1", "payload-b", status=422,
             json={"code": "fingerprint-mismatch"}),
    ],
    "profile/problem-content-type": [
        post("missing", "/echo", None, "no key", status=400, headers={"Content-Type": PROBLEM}),
        post("first", "/echo", "k-ctype-1", "payload-a", status=201),
        post("changed", "/echo", "k-ctype-1", "payload-b", status=422,
             headers={"Content-Type": PROBLEM}),
    ],
    "profile/key-too-long": [
        post("too-long", "/echo", "a" * 256, "long", status=400, json={"code": "invalid-key"},
             runs=0),
    ],
    "profile/empty-key-rejected": [
        post("empty", "/echo", '""', "empty", status=400, json={"code": "invalid-key"}, runs=0),
    ],
}  # fmt: skip

#: With the defaults, what differs from the profile, and why (each an option's default).
DEFAULT_DIFFERENCES = {
    "profile/replayed-header": "the replay is marked Idempotent-Replayed (replay_headers)",
    "profile/4xx-replayed": "the replay is marked Idempotent-Replayed (replay_headers)",
    "profile/omitted-body-replay": "409 response-not-replayable (omitted_replay_header)",
}


class Fixture:
    """The suite's fixture routes behind the middleware, with the count of handler runs."""

    def __init__(self, dsn: str, **options: Any) -> None:
        self.runs = 0
        tenant = f"conformance-{uuid.uuid4().hex[:8]}"  # the vectors' keys are fixed strings
        routes = [
            Route("/echo", self.echo, methods=["POST"]),
            Route("/status/{code:int}", self.status, methods=["POST"]),
            Route("/slow", self.slow, methods=["POST"]),
            Route("/large", self.large, methods=["POST"]),
            Route("/counter", self.counter, methods=["GET"]),
        ]
        self.app = IdempotencyMiddleware(
            Starlette(routes=routes),
            store=PostgresStore(dsn),
            # The vectors send no credentials: every request is one caller's.
            tenant=lambda scope: tenant,
            ttl_seconds=2.0,
            **options,
        )

    async def echo(self, request: Request) -> Response:
        self.runs += 1
        media_type = request.headers.get("content-type", "application/octet-stream")
        return Response(await request.body(), 201, media_type=media_type)

    async def status(self, request: Request) -> Response:
        self.runs += 1
        code = request.path_params["code"]
        return Response(f"status:{code}", code, media_type="text/plain")

    async def slow(self, request: Request) -> Response:
        self.runs += 1
        ms = int(request.query_params["ms"])
        await asyncio.sleep(ms / 1000)
        return Response(f"slept:{ms}", 200, media_type="text/plain")

    async def large(self, request: Request) -> Response:
        self.runs += 1
        size = int(request.query_params["bytes"])
        return Response(b"x" * size, 200, media_type="application/octet-stream")

    async def counter(self, request: Request) -> Response:
        return JSONResponse({"count": self.runs})


async def run_case(http: httpx.AsyncClient, fixture: Fixture, steps: list[Step]) -> list[str]:
    """What failed, as `step: what` lines (none: the case passes)."""
    fixture.runs = 0
    bodies: dict[str, bytes] = {}
    pending: dict[str, asyncio.Task[httpx.Response]] = {}
    failures: list[str] = []
    followers = {step.alongside for step in steps if step.alongside}
    for step in steps:
        if step.name in followers:  # sent and left in flight; checked with its group
            pending[step.name] = asyncio.create_task(send(http, step))
            continue
        await asyncio.sleep(step.delay)
        response = await send(http, step)
        group = [(step, response)]
        if step.alongside is not None:
            leader = next(s for s in steps if s.name == step.alongside)
            group.insert(0, (leader, await pending.pop(step.alongside)))
        for done, answer in group:
            bodies[done.name] = answer.content
            failures += [f"{done.name}: {f}" for f in check(done, answer, bodies)]
        if step.runs is not None and fixture.runs != step.runs:
            failures.append(f"{step.name}: handler runs: expected {step.runs}, got {fixture.runs}")
    return failures


async def send(http: httpx.AsyncClient, step: Step) -> httpx.Response:
    headers = {"Content-Type": "text/plain"} if step.method == "POST" else {}
    if step.key is not None:
        headers["Idempotency-Key"] = step.key
    content = step.body.encode() if step.method == "POST" else None
    return await http.request(step.method, step.path, headers=headers, content=content)


def check(step: Step, response: httpx.Response, bodies: dict[str, bytes]) -> list[str]:
    found = []
    if response.status_code != step.status:
        found.append(f"status: expected {step.status}, got {response.status_code}")
    for name, wanted in step.headers.items():
        got = response.headers.get(name)
        if wanted is ABSENT:
            if got is not None:
                found.append(f"header {name}: expected absent, got {got!r}")
        elif isinstance(wanted, re.Pattern):
            if got is None or not wanted.search(got):
                found.append(f"header {name}: expected /{wanted.pattern}/, got {got!r}")
        elif got != wanted:
            found.append(f"header {name}: expected {wanted!r}, got {got!r}")
    if step.body_is is not None:
        wanted_body = (
            bodies[step.body_is[1:]] if step.body_is.startswith("=") else step.body_is.encode()
        )
        if response.content != wanted_body:
            found.append(f"body: expected {wanted_body[:40]!r}, got {response.content[:40]!r}")
    if step.json:
        members = response.json()
        for name, value in step.json.items():
            if members.get(name) != value:
                found.append(f"body.{name}: expected {value!r}, got {members.get(name)!r}")
    if step.size is not None and len(response.content) != step.size:
        found.append(f"body: expected {step.size} bytes, got {len(response.content)}")
    return found


@pytest.mark.parametrize("case", [*CORE, *PROFILE_CASES])
async def test_each_case_passes_with_the_profiles_options(schema, case):
    fixture = Fixture(schema, **PROFILE)
    steps = {**CORE, **PROFILE_CASES}[case]
    async with client(fixture.app) as http:
        assert await run_case(http, fixture, steps) == []


@pytest.mark.parametrize("case", [*CORE, *PROFILE_CASES])
async def test_with_the_defaults_only_the_documented_differences_remain(schema, case):
    fixture = Fixture(schema)
    steps = {**CORE, **PROFILE_CASES}[case]
    async with client(fixture.app) as http:
        failures = await run_case(http, fixture, steps)
    if case in DEFAULT_DIFFERENCES:
        assert failures, f"{case} passes with the defaults: {DEFAULT_DIFFERENCES[case]}?"
    else:
        assert failures == []


async def test_the_omitted_replay_keeps_the_status_and_headers_and_says_it_is_empty(schema):
    fixture = Fixture(schema, **PROFILE)
    headers = {"Idempotency-Key": "k-omitted-headers"}
    async with client(fixture.app) as http:
        first = await http.post("/large?bytes=1048577", headers=headers, content=b"l")
        retry = await http.post("/large?bytes=1048577", headers=headers, content=b"l")
    assert first.status_code == retry.status_code == 200
    assert retry.headers["content-type"] == first.headers["content-type"]
    assert retry.headers["content-length"] == "0" and retry.content == b""
    assert retry.headers["idempotency-key-expires"] == first.headers["idempotency-key-expires"]
    assert "idempotent-replayed" not in retry.headers  # the profile's name replaces it
    assert fixture.runs == 1
