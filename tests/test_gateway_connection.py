"""The gateway's own HTTP/1.1 connection to the upstream (connection.py), against small
servers that answer exactly as each test writes: chunks with extensions and trailers, interim
answers, an answer before the request's body was read, bytes after an answer, a body cut
short. Each through the pool, as the proxy uses it."""

from __future__ import annotations

import asyncio

import httpcore
import httpx
import pytest

from idempotency_asgi.gateway.pool import UpstreamPool
from idempotency_asgi.gateway.upstream import LeftoverBytes, MalformedAnswer
from tests.test_gateway_backend import Upstream

TIMEOUTS = {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 5.0}


def answering(answer: bytes, *, read_body: bool = True):
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = [
            line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        ]
        if read_body and length:
            await reader.readexactly(int(length[0].split(b":")[1]))
        writer.write(answer)
        await writer.drain()
        await reader.read()  # until the gateway closes

    return handler


async def exchange(port: int, *, content: bytes = b"", method: bytes = b"GET", **pool: object):
    """(status, body, whether the connection went back to the pool idle)."""
    upstream = UpstreamPool(max_connections=1, keepalive_expiry=5, **pool)  # type: ignore[arg-type]
    url = httpcore.URL(scheme=b"http", host=b"127.0.0.1", port=port, target=b"/x")
    headers = [(b"Host", b"up")]
    if content:
        headers.append((b"Content-Length", b"%d" % len(content)))
    try:
        response = await upstream.send(method, url, headers, content, TIMEOUTS)
        try:
            body = b"".join([part async for part in response])
        finally:
            await response.aclose()
        return response.status, body, len(upstream._idle) == 1
    finally:
        await upstream.aclose()


async def test_chunks_with_extensions_and_trailers_are_read_to_their_end():
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n6 ; x\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    async with Upstream(answering(answer)) as upstream:
        assert await exchange(upstream.port) == (200, b"hello world", True)


@pytest.mark.parametrize("trailers", [b"", b"X-Trailer: t\r\n"])
async def test_a_long_answer_whose_chunks_change_shape_reads_whole(trailers):
    # Plain chunks (decoded a read at a time), then one-byte ones with bare LFs and with
    # extensions (decoded a slice at a time), then plain again: the data, to the last byte,
    # and the connection back to the pool.
    plain = b"".join(b"%x\r\n" % 50 + bytes([65 + i % 26]) * 50 + b"\r\n" for i in range(4000))
    odd = b"".join(
        b"1\n" + bytes([97 + i % 26]) + b"\n" if i % 3 else b"1;e=1\r\n%c\r\n" % (97 + i % 26)
        for i in range(150_000)
    )
    expected = (
        b"".join(bytes([65 + i % 26]) * 50 for i in range(4000))
        + b"".join(bytes([97 + i % 26]) for i in range(150_000))
    ) * 2
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (plain + odd) * 2
        + b"0\r\n"
        + trailers
        + b"\r\n"
    )
    async with Upstream(answering(answer)) as upstream:
        status, body, idle = await exchange(upstream.port)
    assert status == 200
    assert len(body) == len(expected)
    assert body == expected
    assert idle


async def test_interim_answers_are_skipped():
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
    )
    async with Upstream(answering(answer)) as upstream:
        assert await exchange(upstream.port) == (201, b"ok", True)


async def test_bytes_after_an_answer_are_leftover_and_the_connection_is_not_kept():
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n"
    async with Upstream(answering(answer)) as upstream:
        with pytest.raises(LeftoverBytes):
            await exchange(upstream.port)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"NOT HTTP\r\n\r\n",
    ],
    ids=["chunk-size", "chunk-longer-than-its-size", "short", "no-status-line"],
)
async def test_a_broken_answer_is_an_error_and_the_connection_is_not_kept(answer):
    async def answer_then_close(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()

    async with Upstream(answer_then_close) as upstream:
        with pytest.raises((MalformedAnswer, httpx.RemoteProtocolError)):
            await exchange(upstream.port)


async def test_an_answer_sent_before_the_body_was_read_is_the_answer():
    """The upstream refuses a large body after its head (413) and closes: writing the rest
    fails, and the answer that came is what the gateway reads, not the write's error."""

    async def refuse(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbig")
        await writer.drain()
        writer.transport.abort()  # unread bytes: a reset

    async def body():
        for _ in range(64):
            yield b"b" * (256 * 1024)
            await asyncio.sleep(0.01)

    async with Upstream(refuse) as upstream:
        pool = UpstreamPool(max_connections=1, keepalive_expiry=5)
        url = httpcore.URL(scheme=b"http", host=b"127.0.0.1", port=upstream.port, target=b"/x")
        headers = [(b"Host", b"up"), (b"Content-Length", b"%d" % (64 * 256 * 1024))]
        try:
            response = await pool.send(b"PUT", url, headers, body(), TIMEOUTS)
            got = b"".join([part async for part in response])
            await response.aclose()
        finally:
            await pool.aclose()
    assert (response.status, got) == (413, b"big")
