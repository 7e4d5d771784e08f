"""The response body on its way back: each chunk goes to the client as the upstream sends it,
and what the upstream sent before breaking off still reaches the client. The upstream is one
of the test's own, so that it can hold its second chunk until the test has the first (a
handshake, not a clock), and reset the connection after its first 1000 bytes."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest

from idempotency_asgi.gateway import build_gateway
from tests.gateway_support import (
    GatewayProcess,
    Received,
    reset,
    wait_until_delivered,
)

#: Only a guard against hanging: on the success path each read returns at once.
PATIENCE = 10.0


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    return scripted_upstream


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(upstream.url, schema, "--tenant-header", "x-tenant").start()
    yield process
    process.stop()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_each_chunk_reaches_the_client_before_the_upstream_sends_the_next(
    gateway, upstream, framing
):
    """An event stream: the upstream sends its first event, and its second only once the test
    says that the client has the first. A gateway that held a chunk back until the next one
    arrived would never deliver the first."""
    client_has_first = threading.Event()

    def two_events(conn: socket.socket, request: Received) -> bool:
        if framing == "chunked":
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            conn.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + b"9\r\ndata: 1\n\n\r\n")
            client_has_first.wait(PATIENCE * 3)
            conn.sendall(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        else:
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            conn.sendall(head + b"Content-Length: 18\r\n\r\n" + b"data: 1\n\n")
            client_has_first.wait(PATIENCE * 3)
            conn.sendall(b"data: 2\n\n")
        return True

    path = "/events-" + framing
    upstream.routes[path.encode()] = two_events
    received = []
    try:
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=PATIENCE) as http,
            http.stream("GET", path) as response,
        ):
            assert response.status_code == 200
            chunks = response.aiter_raw()
            try:
                received.append(await anext(chunks))
            except httpx.ReadTimeout:
                pytest.fail("the first event was held back until the upstream sent more")
            assert received == [b"data: 1\n\n"]
            client_has_first.set()
            received += [chunk async for chunk in chunks]
    finally:
        client_has_first.set()
    assert b"".join(received) == b"data: 1\n\ndata: 2\n\n"


async def test_what_the_upstream_sent_before_a_reset_reaches_the_client(gateway, upstream):
    """The upstream promises 100000 bytes, sends 1000, and resets the connection once they are
    delivered: the client gets those 1000 bytes, then a response that ends short."""

    def broken(conn: socket.socket, request: Received) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"y" * 1000)
        wait_until_delivered(conn)  # in the gateway's hands: nothing is lost on the way
        reset(conn)
        return False

    upstream.routes[b"/broken"] = broken
    received = bytearray()
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=PATIENCE) as http,
        http.stream("GET", "/broken") as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-length"] == "100000"
        with pytest.raises(httpx.RemoteProtocolError):
            async for chunk in response.aiter_raw():
                received += chunk
    assert received == b"y" * 1000
    # And the gateway goes on serving.
    async with httpx.AsyncClient(base_url=gateway.url, timeout=PATIENCE) as http:
        assert (await http.get("/echo")).status_code == 200


# -- in process: the messages the proxy sends ------------------------------------------------


def gateway_on(upstream: httpx.MockTransport):
    return build_gateway(
        "http://up:9000",
        store="postgresql://127.0.0.1:1/none",
        tenant=lambda scope: "t",
        apply_schema=False,
        transport=upstream,
    )


def get(path: str) -> dict[str, object]:
    return {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"g")],
        "scheme": "http",
        "client": ("10.0.0.9", 1234),
    }


async def test_a_whole_answer_takes_one_send_and_a_stream_ends_with_an_empty_one():
    async def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/whole":
            return httpx.Response(200, content=b"made")  # with its Content-Length

        async def chunks():
            yield b"a"
            yield b"b"

        return httpx.Response(200, content=chunks())  # chunked: no length

    app = gateway_on(httpx.MockTransport(upstream))

    async def bodies(path: str) -> list[tuple[bytes, bool]]:
        sent: list[dict[str, object]] = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def collect(message):
            sent.append(message)

        await app(get(path), receive, collect)  # type: ignore[arg-type]
        assert sent[0]["type"] == "http.response.start"
        return [(m["body"], m.get("more_body", False)) for m in sent[1:]]  # type: ignore[misc]

    assert await bodies("/whole") == [(b"made", False)]
    # Both parts were in hand at once: they wait, and go, together (one send, not two).
    assert await bodies("/stream") == [(b"ab", True), (b"", False)]


async def test_a_late_part_of_the_request_is_not_the_client_leaving():
    """The upstream answered without reading the whole request body; the rest arrives while
    the answer streams back. Only `http.disconnect` means the client has gone."""
    client_left = asyncio.Event()

    async def upstream(request: httpx.Request) -> httpx.Response:
        async def chunks():
            for chunk in (b"one", b"two", b"three"):
                yield chunk
                for _ in range(5):
                    await asyncio.sleep(0)  # the proxy's other tasks run meanwhile

        return httpx.Response(200, content=chunks())

    messages = iter(
        [
            {"type": "http.request", "body": b"", "more_body": False},
            {"type": "http.request", "body": b"late", "more_body": False},
        ]
    )

    async def receive():
        message = next(messages, None)
        if message is None:
            await client_left.wait()  # the client stays
            return {"type": "http.disconnect"}
        return message

    sent: list[dict[str, object]] = []

    async def collect(message):
        sent.append(message)

    app = gateway_on(httpx.MockTransport(upstream))
    await app(get("/stream"), receive, collect)  # type: ignore[arg-type]
    client_left.set()
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"onetwothree"  # type: ignore[misc]
    assert sent[-1] == {"type": "http.response.body", "body": b""}
