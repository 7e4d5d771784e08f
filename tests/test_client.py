"""The retrying transports of idempotency_asgi.client: what they retry and how (against
httpx's MockTransport, a scripted server), and, against the example payments API under
uvicorn with connections cut before and after it answers, exactly one payment for each
logical request, audited in the database."""

from __future__ import annotations

import asyncio
import gzip
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from idempotency_asgi.client import (
    AsyncIdempotentTransport,
    IdempotentTransport,
    attempts,
    replayed,
)
from tests.cutting_proxy import CuttingProxy
from tests.server import UvicornProcess

# -- what is retried, scripted -------------------------------------------------------------


#: A step of a Script: a 201 whose body ends half-way, the connection lost under it.
CUT_BODY = "cut-body"


class CutBody(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body that ends early: its first bytes, then the connection is gone (as httpx's own
    transports raise it)."""

    def __iter__(self) -> Iterator[bytes]:
        yield b'{"attempt": '
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'{"attempt": '
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


class Script:
    """A server that answers each attempt with the next step: a status (and headers), an
    answer whose body is cut (CUT_BODY), or an exception raised as the transport would."""

    def __init__(self, *steps: int | tuple[int, dict[str, str]] | Exception | str) -> None:
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []
        #: the key of each attempt, as sent (the transport sends one Request object again)
        self.keys: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.keys.append(request.headers.get("idempotency-key"))
        step = self.steps.pop(0) if self.steps else 201
        if isinstance(step, Exception):
            raise step
        if step == CUT_BODY:
            return httpx.Response(201, headers={"content-length": "100"}, stream=CutBody())
        if isinstance(step, str) and step.startswith(CUT_BODY + " "):
            status = int(step.split()[1])  # "cut-body 500": that status, its body cut
            return httpx.Response(status, headers={"content-length": "100"}, stream=CutBody())
        status, headers = step if isinstance(step, tuple) else (step, {})
        return httpx.Response(status, headers=headers, json={"attempt": len(self.requests)})


def sync_client(script: Script, **options: object) -> httpx.Client:
    transport = IdempotentTransport(httpx.MockTransport(script), backoff=0.001, **options)
    return httpx.Client(transport=transport, base_url="http://svc")


def lost(request_sent: bool = True) -> Exception:
    if request_sent:
        return httpx.RemoteProtocolError("Server disconnected without sending a response.")
    return httpx.ConnectError("connection refused")


def test_one_key_is_made_for_a_request_and_sent_on_every_attempt():
    script = Script(lost(False), httpx.ReadTimeout("slow"), lost(), (503, {}), 201)
    with sync_client(script) as http:
        answer = http.post("/payments", json={"amount": 1})
    assert answer.status_code == 201 and attempts(answer) == 5
    [key] = set(script.keys)
    assert key and len(key) == 36  # a UUID
    assert answer.request.headers["idempotency-key"] == key  # the caller can see it
    assert {r.content for r in script.requests} == {b'{"amount":1}'}  # the body, each time


def test_an_answer_cut_mid_body_is_a_lost_answer_retried_with_the_same_key():
    # The service ran the request and its answer was cut after the head: the body is read in
    # the retry loop, so the retry, with the same key, gets the stored answer.
    script = Script(CUT_BODY, (201, {"idempotent-replayed": "true"}))
    with sync_client(script) as http:
        answer = http.post("/payments", json={"amount": 1})
    assert answer.status_code == 201 and replayed(answer) and attempts(answer) == 2
    assert answer.json() == {"attempt": 2}
    assert len(script.keys) == 2 and len(set(script.keys)) == 1
    cut_every_time = Script(*[CUT_BODY] * 5)
    with (
        sync_client(cut_every_time, max_attempts=3) as http,
        pytest.raises(httpx.RemoteProtocolError),
    ):
        http.post("/payments")
    assert len(cut_every_time.requests) == 3 and len(set(cut_every_time.keys)) == 1


@pytest.mark.parametrize("status", [500, 400, 422, 402, 303])
def test_an_answer_never_retried_is_not_retried_when_its_body_is_cut(status):
    # A 500 freed the key (a retry would run the request again), a 4xx is final, a 3xx may
    # not be recorded (the gateway frees the key of one to a tenant it has not seen succeed):
    # a cut in its body is the caller's error, after one attempt, as without the transport.
    script = Script(f"{CUT_BODY} {status}", 201)
    with sync_client(script) as http, pytest.raises(httpx.RemoteProtocolError):
        http.post("/payments", json={"amount": 1})
    assert len(script.requests) == 1


async def test_the_async_transport_does_not_retry_a_500_whose_body_is_cut():
    script = Script(f"{CUT_BODY} 500", 201)
    transport = AsyncIdempotentTransport(httpx.MockTransport(script), backoff=0.001)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post("/payments", json={})
    assert len(script.requests) == 1


async def test_an_event_stream_is_passed_on_as_it_comes():
    # Read whole, a stream's first event would wait for its last (or for ever).
    first_read = asyncio.Event()

    class Events(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b"data: one\n\n"
            await asyncio.wait_for(first_read.wait(), 5)  # the caller has the first event
            yield b"data: two\n\n"

    def events(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Events())

    transport = AsyncIdempotentTransport(httpx.MockTransport(events))
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://svc") as http,
        http.stream("POST", "/completions", json={}) as streamed,
    ):
        chunks = streamed.aiter_bytes()
        assert await chunks.__anext__() == b"data: one\n\n"
        first_read.set()
        assert [chunk async for chunk in chunks] == [b"data: two\n\n"]


async def test_the_async_transport_retries_an_answer_cut_mid_body():
    script = Script(CUT_BODY, CUT_BODY, (201, {"idempotent-replayed": "true"}))
    transport = AsyncIdempotentTransport(httpx.MockTransport(script), backoff=0.001)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        answer = await http.post("/payments", json={"amount": 2})
    assert answer.status_code == 201 and replayed(answer) and attempts(answer) == 3
    assert answer.json() == {"attempt": 3}
    assert len(script.keys) == 3 and len(set(script.keys)) == 1


def test_a_covered_answer_is_read_whole_and_still_streams_and_decodes_as_sent():
    # The transport reads a covered request's answer before returning it; the caller's
    # client.stream() then iterates the bytes read, decoded as the service encoded them.
    body = gzip.compress(b'{"paid": true}')

    def gzipped(request: httpx.Request) -> httpx.Response:
        # A stream, as httpx's own transports answer (content= would be read at once).
        return httpx.Response(
            201, headers={"content-encoding": "gzip"}, stream=httpx.ByteStream(body)
        )

    transport = IdempotentTransport(httpx.MockTransport(gzipped))
    with httpx.Client(transport=transport, base_url="http://svc") as http:
        with http.stream("POST", "/payments", json={}) as streamed:
            chunks = list(streamed.iter_bytes())
        assert b"".join(chunks) == b'{"paid": true}'
        assert streamed.elapsed.total_seconds() >= 0  # closed: as httpx's own response
        assert http.post("/payments", json={}).json() == {"paid": True}


def test_a_key_the_caller_gave_is_kept_and_each_logical_request_gets_its_own():
    script = Script(lost(), 201, 201)
    with sync_client(script) as http:
        mine = http.post("/payments", headers={"Idempotency-Key": "order-7"})
        other = http.post("/payments")
    assert mine.status_code == other.status_code == 201
    assert script.keys[:2] == ["order-7", "order-7"]
    assert script.keys[2] not in (None, "order-7")


@pytest.mark.parametrize(
    "final",
    [
        (422, {}),  # the key was used for another request: never retried
        (400, {}),
        (404, {}),
        (429, {"retry-after": "1"}),  # a 4xx: not retried unless configured
        (409, {}),  # the application's own 409 (no Retry-After): recorded, final
        (500, {}),
        (502, {}),
    ],
)
def test_final_answers_are_returned_after_one_attempt(final):
    script = Script(final, 201)
    with sync_client(script) as http:
        answer = http.post("/payments")
    assert answer.status_code == final[0] and attempts(answer) == 1
    assert len(script.requests) == 1


def test_a_409_with_retry_after_is_waited_for_then_retried():
    script = Script((409, {"retry-after": "1"}), (201, {"idempotent-replayed": "true"}))
    with sync_client(script) as http:
        started = time.monotonic()
        answer = http.post("/payments")
        waited = time.monotonic() - started
    assert answer.status_code == 201 and replayed(answer) and attempts(answer) == 2
    assert waited >= 1.0  # as Retry-After asked


@pytest.mark.parametrize("status", [503, 504])
def test_503_and_504_are_retried_with_or_without_retry_after(status):
    script = Script((status, {"retry-after": "0"}), (status, {}), 201)
    with sync_client(script) as http:
        answer = http.post("/payments")
    assert answer.status_code == 201 and attempts(answer) == 3
    assert len(set(script.keys)) == 1


def test_attempts_are_bounded_then_the_last_answer_or_error_is_the_callers():
    with sync_client(Script(*[(503, {})] * 10), max_attempts=3) as http:
        answer = http.post("/payments")
    assert answer.status_code == 503 and attempts(answer) == 3
    failing = Script(*[lost()] * 10)
    with sync_client(failing, max_attempts=4) as http, pytest.raises(httpx.RemoteProtocolError):
        http.post("/payments")
    assert len(failing.requests) == 4


def test_a_wait_past_the_time_bound_is_not_made():
    script = Script((409, {"retry-after": "30"}), 201)
    with sync_client(script, max_elapsed=5) as http:
        started = time.monotonic()
        answer = http.post("/payments")
    assert answer.status_code == 409 and attempts(answer) == 1
    assert time.monotonic() - started < 1


def test_other_methods_pass_through_without_a_key_or_a_retry():
    script = Script(lost())
    with sync_client(script) as http, pytest.raises(httpx.RemoteProtocolError):
        http.get("/payments")
    assert script.keys == [None]
    covered = Script(lost(), 201)
    with sync_client(covered, methods=("PUT",)) as http:
        assert http.put("/payments/1").status_code == 201
    assert len(set(covered.keys)) == 1 and len(covered.keys) == 2


async def test_the_async_transport_keys_and_retries_alike():
    script = Script(lost(False), (409, {"retry-after": "0"}), (504, {}), 201)
    transport = AsyncIdempotentTransport(httpx.MockTransport(script), backoff=0.001)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        answer = await http.post("/payments", json={"amount": 2})
        final = await http.post("/payments", json={"amount": 2})  # a new logical request
    assert answer.status_code == 201 and attempts(answer) == 4
    assert len(set(script.keys[:4])) == 1 and script.keys[4] != script.keys[0]
    assert final.status_code == 201


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        IdempotentTransport(max_attempts=0)
    with pytest.raises(ValueError):
        AsyncIdempotentTransport(max_elapsed=0)


# -- against the example payments API, connections cut ---------------------------------------

ACME = {"authorization": "Bearer sk_test_acme"}


@pytest.fixture(scope="module")
def payments_api(schema: str) -> Iterator[UvicornProcess]:
    env = {
        "DATABASE_URL": schema,
        "PAYMENTS_FAULT_INJECTION": "1",
        "IDEMPOTENCY_LEASE_SECONDS": "1",  # Retry-After on a 409: one second
    }
    server = UvicornProcess("examples.payments.app:app", env).start(ready_path="/healthz")
    yield server
    server.stop()


def payment(customer: str) -> dict[str, object]:
    return {"amount": 1999, "currency": "EUR", "customer_id": customer}


async def payments_of(db, customer: str) -> int:
    """The payments made for one logical request (each has a customer of its own): a
    payment made by an attempt that sent another key would be counted here too."""
    return int(await db.fetchval("SELECT count(*) FROM payments WHERE customer_id = $1", customer))


#: Each cut, and what the answer the caller finally gets must say.
CUTS = {
    # Nothing reached the service: the retry runs it, once.
    "lose-request": False,
    # The service ran it and answered; the answer was lost: the retry gets the stored one.
    "lose-answer": True,
    # Cut while the service runs it: the retry meets 409 + Retry-After, waits, then replays.
    "cut-early": True,
    # The service answered; the answer was cut half-way through its body: the retry replays.
    "cut-body": True,
}


@pytest.mark.slow
@pytest.mark.parametrize("cut", sorted(CUTS))
async def test_the_sync_transport_makes_one_payment_whatever_is_cut(payments_api, db, cut):
    customer = f"cus_{uuid.uuid4().hex}"

    def pay(proxy: CuttingProxy) -> httpx.Response:
        transport = IdempotentTransport(backoff=0.05)
        with httpx.Client(transport=transport, base_url=proxy.url, timeout=10) as http:
            return http.post(
                "/payments",
                json=payment(customer),
                headers={**ACME, "x-fault-delay-ms": "300" if cut == "cut-early" else "0"},
            )

    with CuttingProxy(payments_api.port, [cut]) as proxy:
        answer = await asyncio.to_thread(pay, proxy)  # a sync caller, in a thread of its own
    assert answer.status_code == 201, answer.text
    assert replayed(answer) is CUTS[cut]
    assert proxy.seen[0] == cut and attempts(answer) >= 2
    assert await payments_of(db, customer) == 1


@pytest.mark.slow
async def test_the_async_transport_makes_one_payment_per_logical_request_under_cuts(
    payments_api, db
):
    # Twelve logical requests at once, each through its own cuts (the plan is shared: a
    # connection takes the next step, whichever request opened it).
    plan = ["lose-request", "lose-answer", "cut-early", "cut-body"] * 3
    customers = [f"cus_{uuid.uuid4().hex}" for _ in range(12)]
    with CuttingProxy(payments_api.port, plan) as proxy:
        transport = AsyncIdempotentTransport(backoff=0.05, max_elapsed=60)
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(
            transport=transport, base_url=proxy.url, timeout=10, limits=limits
        ) as http:
            answers = await asyncio.gather(
                *(
                    http.post(
                        "/payments",
                        json=payment(customer),
                        headers={**ACME, "x-fault-delay-ms": "200"},
                    )
                    for customer in customers
                )
            )
    assert [a.status_code for a in answers] == [201] * 12, [a.text for a in answers]
    assert len({a.request.headers["idempotency-key"] for a in answers}) == 12
    for customer in customers:
        assert await payments_of(db, customer) == 1
    assert {"lose-request", "lose-answer", "cut-early", "cut-body"} <= set(proxy.seen)
