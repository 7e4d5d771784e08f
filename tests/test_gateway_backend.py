"""The gateway's network backend (plain asyncio under httpcore), on asyncio's loop and uvloop's:
what a failure raises, flow control, a close seen before reuse, and TLS."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest
import uvloop

from idempotency_asgi.gateway.backend import _HIGH_WATER, AsyncioBackend
from idempotency_asgi.gateway.pool import UpstreamPool
from tests.server import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    """Run a coroutine to completion on a new loop of the kind named."""
    return asyncio.run if request.param == "asyncio" else uvloop.run


class Upstream:
    """A TCP server for one scenario; on exit every connection and handler is finished, so
    that the loop closes with nothing left open."""

    def __init__(self, handler: Handler, **options: Any) -> None:
        self._handler = handler
        self._options = options
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def __aenter__(self) -> Upstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, **self._options)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._server.close()
        await self._server.wait_closed()
        await asyncio.sleep(0.01)  # let the transports finish closing


def test_a_read_returns_what_arrived_then_b_empty_at_the_end(run):
    async def handler(reader, writer):
        writer.write(b"x" * 100)
        await writer.drain()

    async def scenario():
        async with Upstream(handler) as upstream:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", upstream.port, timeout=5)
            received = b""
            while chunk := await stream.read(30, timeout=5):
                assert len(chunk) <= 30
                received += chunk
            assert received == b"x" * 100
            assert await stream.read(30, timeout=5) == b""
            await stream.aclose()

    run(scenario())


def test_silence_past_the_read_timeout_is_a_read_timeout(run):
    async def handler(reader, writer):
        await reader.read(1)

    async def scenario():
        async with Upstream(handler) as upstream:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", upstream.port, timeout=5)
            started = time.monotonic()
            with pytest.raises(httpcore.ReadTimeout):
                await stream.read(10, timeout=0.1)
            assert 0.09 < time.monotonic() - started < 0.9
            await stream.aclose()

    run(scenario())


def test_a_refused_connection_is_a_connect_error(run):
    async def scenario():
        with pytest.raises(httpcore.ConnectError):
            await AsyncioBackend().connect_tcp("127.0.0.1", free_port(), timeout=5)

    run(scenario())


def test_a_reset_connection_is_a_read_error_and_writing_on_then_fails(run):
    async def handler(reader, writer):
        await reader.read(1)
        # SO_LINGER 0: close with a reset, as the kernel of a crashed upstream would.
        writer.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        writer.transport.abort()

    async def scenario():
        async with Upstream(handler) as upstream:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", upstream.port, timeout=5)
            await stream.write(b"GET", timeout=5)
            with pytest.raises(httpcore.ReadError):
                await stream.read(10, timeout=5)
            with pytest.raises(httpcore.WriteError):
                await stream.write(b"more", timeout=5)
            await stream.aclose()

    run(scenario())


def test_reading_stops_while_the_buffer_is_full_and_resumes_as_it_drains(run):
    size = 16 * 1024 * 1024

    async def scenario():
        sent = asyncio.Event()

        async def handler(reader, writer):
            writer.write(b"y" * size)
            await writer.drain()
            sent.set()

        async with Upstream(handler) as upstream:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", upstream.port, timeout=5)
            await asyncio.sleep(0.3)
            # Not read ahead: the rest waits in the kernels' buffers and the upstream's.
            assert stream._buffer.size <= _HIGH_WATER + 1024 * 1024
            assert not sent.is_set()
            total = 0
            while total < size:
                total += len(await stream.read(64 * 1024, timeout=5))
            assert total == size
            await asyncio.wait_for(sent.wait(), 5)
            await stream.aclose()

    run(scenario())


def test_an_idle_connection_the_upstream_closed_is_readable_before_the_loop_sees_it(run):
    """The pool asks before it reuses a connection; the upstream's FIN may still sit in the
    kernel when the loop has been busy since it arrived."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    close_now = threading.Event()

    def upstream() -> None:
        conn, _ = listener.accept()
        close_now.wait(5)
        conn.close()

    thread = threading.Thread(target=upstream)
    thread.start()

    async def scenario():
        stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
        await asyncio.sleep(0.05)
        assert not stream.get_extra_info("is_readable")
        close_now.set()
        thread.join(5)
        time.sleep(0.1)  # noqa: ASYNC251 -- blocks the loop: only the kernel knows of the close
        assert stream.get_extra_info("is_readable")
        await stream.aclose()
        await asyncio.sleep(0.01)

    try:
        run(scenario())
    finally:
        close_now.set()
        thread.join(5)
        listener.close()


def test_tcp_nodelay_is_set(run):
    async def handler(reader, writer):
        await reader.read(1)

    async def scenario():
        async with Upstream(handler) as upstream:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", upstream.port, timeout=5)
            sock = stream.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            await stream.aclose()

    run(scenario())


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made with the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the TLS tests need the openssl command")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def server_tls(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    return context


def test_an_https_upstream_is_reached_over_tls_and_its_connection_reused(run, certificate):
    async def answer(reader, writer):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            body = b"over tls: " + head.split(b" ")[1]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def scenario():
        async with Upstream(answer, ssl=server_tls(certificate)) as upstream:
            trusting = ssl.create_default_context(cafile=str(certificate[0]))
            pool = UpstreamPool(max_connections=2, keepalive_expiry=5, ssl_context=trusting)
            async with httpx.AsyncClient(transport=pool) as http:
                first = await http.get(f"https://127.0.0.1:{upstream.port}/one")
                second = await http.get(f"https://127.0.0.1:{upstream.port}/two")
            assert (first.status_code, first.content) == (200, b"over tls: /one")
            assert second.content == b"over tls: /two"
            stream = first.extensions["network_stream"]
            assert stream is second.extensions["network_stream"]  # kept alive
            assert stream.get_extra_info("ssl_object").version().startswith("TLS")

    run(scenario())


def test_an_untrusted_certificate_is_a_connect_error_nothing_sent(run, certificate):
    requests: list[bytes] = []

    async def handler(reader, writer):
        requests.append(await reader.read(100))

    async def scenario():
        async with Upstream(handler, ssl=server_tls(certificate)) as upstream:
            pool = UpstreamPool(max_connections=1, keepalive_expiry=5)  # the default trust
            async with httpx.AsyncClient(transport=pool) as http:
                with pytest.raises(httpx.ConnectError):
                    await http.get(f"https://127.0.0.1:{upstream.port}/")

    run(scenario())
    assert requests == []  # the handshake failed: no request reached the upstream
