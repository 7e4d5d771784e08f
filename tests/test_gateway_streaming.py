"""Requests the middleware does not record pass both ways in constant memory: 200 MiB down
and 200 MiB up through the gateway, with the gateway process's peak memory (VmHWM) read from
/proc before and after. The upload is read whole into a temporary file before it is
forwarded (its spool is raised to 256 MiB here); the download is held in a file of at most
1 MiB here, past which the gateway reads from the upstream only as fast as the client does."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.gateway_support import GatewayProcess, NodeUpstream, memory_kib
from tests.helpers import eventually

pytestmark = pytest.mark.slow

SIZE = 200 * 1024 * 1024
#: Far below the payload: what buffers and the allocator may reasonably keep.
ALLOWED_GROWTH_KIB = 32 * 1024


@pytest.fixture(scope="module")
def upstream():
    node = NodeUpstream().start()
    yield node
    node.stop()


@pytest.fixture(scope="module")
def gateway(upstream, schema):
    process = GatewayProcess(
        upstream.url,
        schema,
        "--tenant-header",
        "x-tenant",
        "--request-spool-bytes",
        str(256 * 1024 * 1024),
        "--response-spool-bytes",
        str(1024 * 1024),
    ).start()
    yield process
    process.stop()


def report(what: str, before: dict[str, int], after: dict[str, int], seconds: float) -> str:
    return (
        f"\n{what}: {SIZE // 2**20} MiB in {seconds:.2f} s; gateway VmRSS "
        f"{before['VmRSS'] / 1024:.1f} -> {after['VmRSS'] / 1024:.1f} MiB, peak VmHWM "
        f"{before['VmHWM'] / 1024:.1f} -> {after['VmHWM'] / 1024:.1f} MiB"
    )


async def test_a_200_mib_download_streams_through_in_constant_memory(gateway, capsys):
    before = memory_kib(gateway.pid)
    received = 0
    started = time.monotonic()
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as http,
        http.stream("GET", "/download", params={"bytes": SIZE}) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-length"] == str(SIZE)
        async for chunk in response.aiter_raw():
            received += len(chunk)
    seconds = time.monotonic() - started
    after = memory_kib(gateway.pid)
    with capsys.disabled():
        print(report("download", before, after, seconds))
    assert received == SIZE
    assert after["VmHWM"] - before["VmHWM"] < ALLOWED_GROWTH_KIB


async def test_a_200_mib_upload_passes_through_in_constant_memory(gateway, capsys):
    chunk = b"u" * (256 * 1024)

    async def body():
        for _ in range(SIZE // len(chunk)):
            yield chunk

    before = memory_kib(gateway.pid)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        # No key: the middleware does not record it, so nothing buffers the body.
        response = await http.post("/upload", content=body())
    seconds = time.monotonic() - started
    after = memory_kib(gateway.pid)
    with capsys.disabled():
        print(report("upload", before, after, seconds))
    assert response.status_code == 200
    assert response.json() == {"bytes": SIZE}
    assert after["VmHWM"] - before["VmHWM"] < ALLOWED_GROWTH_KIB


async def test_a_client_that_leaves_stops_the_download_upstream(gateway, upstream):
    async def stats() -> dict[str, int]:
        async with httpx.AsyncClient(base_url=upstream.url) as http:
            result: dict[str, int] = (await http.get("/download/stats")).json()
            return result

    before = await stats()
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as http,
        http.stream("GET", "/download", params={"bytes": SIZE}) as response,
    ):
        async for _ in response.aiter_raw():
            break  # one chunk, then hang up
    after = await eventually(
        lambda: stats_if(stats, lambda s: s["aborted"] > before["aborted"]), timeout=20
    )
    assert after["completed"] == before["completed"]  # the rest was never pulled from it


async def stats_if(stats, condition):
    result = await stats()
    return result if condition(result) else None
