"""An answer's spool (spool.py) holds at most its memory bound in memory, however small the
parts it is given: a million parts of 64 bytes for a client that does not read used to grow
the gateway by 101 MiB while its file held 59 MiB (one queue entry per part, the bytes
counted and the objects not). And a temporary file that fails leaves the parts in memory,
up to the fallback, in order: never an error for the reader."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from idempotency_asgi.gateway import spool as spool_module
from idempotency_asgi.gateway.spool import AnswerSpool, BodySpool, DiskBudget

PART = bytes(range(64))


async def held_while_writing(spool: AnswerSpool, parts: int) -> int:
    """Bytes allocated (tracemalloc) after `parts` parts were put and none taken."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(parts):
            await spool.put(PART)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


async def read_all(spool: AnswerSpool) -> bytes:
    spool.end()
    out = bytearray()
    while (part := await spool.get()) is not None:
        out += part
    return bytes(out)


async def test_small_parts_held_for_a_client_that_does_not_read_stay_within_memory():
    parts = 200_000  # 12.8 MB, nearly all of it in the file
    spool = AnswerSpool(memory=256 * 1024, disk=1024 * 1024 * 1024)
    try:
        held = await held_while_writing(spool, parts)
        assert held < 1024 * 1024, held  # the memory bound, and what the file's region costs
        assert await read_all(spool) == PART * parts
    finally:
        spool.close()


async def test_in_memory_the_parts_are_counted_with_their_objects():
    """No file at all (`disk` 0): the writer waits once the memory bound is reached, counted
    with what each part costs beyond its bytes."""
    spool = AnswerSpool(memory=64 * 1024, disk=0)

    async def write() -> None:  # one writer, as the pump is
        for _ in range(5000):
            await spool.put(PART)

    writing = asyncio.ensure_future(write())
    await asyncio.sleep(0.05)
    assert not writing.done()  # 5000 x 64 bytes is 320 KiB: past the bound, it waits
    assert spool._in_memory <= 64 * 1024
    assert len(spool._waiting) <= 4  # joined: one object per 64 KiB of small parts
    out = bytearray()
    while len(out) < len(PART) * 5000:
        part = await spool.get()
        assert part is not None
        out += part
    await writing
    assert out == PART * 5000
    spool.close()


async def test_a_failing_file_leaves_the_answer_in_memory_up_to_the_fallback(monkeypatch):
    def no_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spool_module.tempfile, "TemporaryFile", no_disk)
    spool = AnswerSpool(memory=1024, disk=1024 * 1024, fallback=640 * 1024)
    body = bytes(range(256)) * 2400  # 600 KB
    for offset in range(0, len(body), 4096):
        await spool.put(body[offset : offset + 4096])
    assert await read_all(spool) == body
    spool.close()


async def test_a_spent_budget_is_a_full_disk_and_is_given_back():
    budget = DiskBudget(100_000)
    body = BodySpool(memory=1000, budget=budget)
    body.write(b"x" * 60_000)
    with pytest.raises(OSError, match="temporary files"):
        body.write(b"y" * 60_000)
    body.close()
    assert budget.available == 100_000
    answer = AnswerSpool(memory=1000, disk=1024 * 1024, budget=budget, fallback=50_000)
    for _ in range(30):
        await answer.put(b"z" * 4000)  # 120 KB: the budget runs out, memory holds the rest
    assert budget.available < 100_000
    assert await read_all(answer) == b"z" * 120_000
    assert budget.available == 100_000  # all read: the file's space is given back
    answer.close()
