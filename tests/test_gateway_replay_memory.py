"""The replay cache (`--replay-cache-seconds`, 32 MiB by default) counts what it holds with its
objects, and drops stale entries on time. Answers with about 16,000 short headers grew the
gateway by 895 MiB over 800 keys against the 32 MiB bound (each header counted as its two or
three bytes of text, not as the tuple and two bytes objects it is); typical answers were
undercounted 2.3 times; and a stale entry left only when the cache was full. The gateway is
the real command, the upstream a bare socket, the memory the process's own (/proc)."""

from __future__ import annotations

import asyncio
import gc
import socket
import tracemalloc
import uuid
from datetime import datetime, timedelta, timezone

import httpx

from idempotency_asgi._keystore import Claim
from idempotency_asgi._postgres.replays import ReplayCache
from idempotency_asgi._records import Outcome, StoredResponse
from tests.gateway_support import GatewayProcess, Received, memory_kib
from tests.helpers import headers, new_key

#: 16,000 header lines of four bytes: the head stays under the gateway's 64 KiB bound.
MANY = b"".join(b"h:\r\n" for _ in range(16_000))


def many_headers(conn: socket.socket, request: Received) -> bool:
    conn.sendall(b"HTTP/1.1 201 Created\r\n" + MANY + b"Content-Length: 2\r\n\r\nok")
    return True


async def test_answers_with_many_headers_keep_the_cache_within_its_bound(
    scripted_upstream, schema, tenant
):
    scripted_upstream.routes[b"/many"] = many_headers
    gateway = GatewayProcess(scripted_upstream.url, schema, "--tenant-header", "x-tenant").start()
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:

            async def recorded_and_replayed(key: str) -> None:
                first = await http.post("/many", content=b"{}", headers=headers(tenant, key))
                again = await http.post("/many", content=b"{}", headers=headers(tenant, key))
                assert first.status_code == again.status_code == 201
                assert again.headers["idempotent-replayed"] == "true"

            for _ in range(3):  # warm: the pools, the allocator
                await recorded_and_replayed(new_key())
            before = memory_kib(gateway.pid)["VmRSS"]
            for _ in range(40):
                await recorded_and_replayed(new_key())
            grown = memory_kib(gateway.pid)["VmRSS"] - before
    finally:
        gateway.stop()
    # Forty such replays, counted as about 2.5 MB each: the 32 MiB bound keeps about twelve
    # (7.6 MiB more resident for sixty). Before, all were kept: 68 MiB more for sixty.
    assert grown < 24 * 1024, f"grew {grown / 1024:.1f} MiB"


def claim(headers_count: int, body: bytes, n: int) -> Claim:
    fields = [(b"x-header-%d" % j, b"value-%d-%d" % (n, j)) for j in range(headers_count)]
    return Claim(
        Outcome.COMPLETED,
        response=StoredResponse(201, fields, body),
        expires_at=datetime.now(timezone.utc) + timedelta(days=1),
    )


def test_what_the_cache_counts_is_at_least_what_it_holds():
    for headers_count, body, entries in [(8, b"b" * 200, 2000), (2000, b"ok", 20), (0, b"", 3000)]:
        cache = ReplayCache(seconds=60, max_bytes=1 << 40)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for n in range(entries):
                key = f"key-{uuid.uuid4()}"
                cache.put(f"tenant-{n}", key, b"f" * 32, claim(headers_count, body, n))
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert len(cache) == entries
        assert cache.size >= held, (headers_count, cache.size / entries, held / entries)


async def test_stale_entries_leave_on_time_with_nothing_asked():
    cache = ReplayCache(seconds=0.2, max_bytes=1 << 30)
    for n in range(100):
        cache.put("tenant", f"key-{n}", b"f", claim(4, b"body", n))
    assert len(cache) == 100 and cache.size > 0
    await asyncio.sleep(0.35)
    assert len(cache) == 0 and cache.size == 0
