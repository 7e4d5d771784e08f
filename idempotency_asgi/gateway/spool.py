"""Bodies held between a slow peer and a fast one: in memory up to a bound, then in an unnamed
temporary file up to another (as nginx's client body and proxy buffers do), so that a client
that sends or reads slowly holds its own socket and some disk, never an upstream connection,
and never more memory than the first bound.

- `BodySpool`: a request body, written whole (while the client sends it), then read back.
- `AnswerSpool`: an answer's body, written as the upstream sends it and read as the client
  takes it, at the same time; past both bounds, the writer waits for the reader.

The files are made with `tempfile.TemporaryFile` (in `$TMPDIR`, unlinked at once, gone when
closed) and read and written with positional calls; disk I/O runs on the event loop, as in
nginx's workers: these files are written and read back within moments, from the page cache.

All of a process's files together hold at most what its `DiskBudget` allows (a full budget
is met as a full disk is). An answer's spool never fails because its disk does: what cannot
go to the file stays in memory up to its fallback bound (the storage limit for a keyed answer,
which the middleware holds in memory anyway; the memory bound otherwise), and past that the
writer waits for the reader. A keyed answer read whole from the upstream so always reaches
the middleware, which records it (a full disk used to end such an exchange as "outcome
unknown", and the key's retry ran the request again after the lease). A request body that
cannot be held is refused before anything is forwarded (`OSError`: 503).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import IO

logger = logging.getLogger("idempotency_asgi.gateway")

#: What a file-backed body is read back in, per part.
READ_SIZE = 64 * 1024

#: What each part held in memory costs beyond its bytes (the object and its place in the
#: queue), counted against the memory bound: a million parts of 64 bytes held +101 MiB
#: when only their bytes were counted.
PART_COST = 128

#: Parts smaller than this are joined to the one before them while they wait (up to
#: `READ_SIZE`): one object, and one send to the client, for many.
_SMALL = 4096


class DiskBudget:
    """The bytes all of a process's temporary files may hold together (`spool_disk_bytes`):
    per connection the bounds are `request_spool_bytes` and `response_spool_bytes`, and a
    thousand connections times those is more disk than any machine has."""

    __slots__ = ("available", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.available = limit

    def take(self, size: int) -> bool:
        if size > self.available:
            return False
        self.available -= size
        return True

    def give(self, size: int) -> None:
        self.available += size


def _full() -> OSError:
    return OSError(errno.ENOSPC, "the temporary files of this process hold all they may")


class BodySpool:
    """A body in memory up to `memory` bytes; past that, all of it in a temporary file."""

    def __init__(self, *, memory: int, budget: DiskBudget | None = None) -> None:
        self._memory = memory
        self._budget = budget
        self._parts: list[bytes] = []
        self._file: IO[bytes] | None = None
        self._charged = 0  # taken from the budget
        self.size = 0

    @property
    def in_memory(self) -> bool:
        return self._file is None

    def write(self, data: bytes) -> None:
        if not data:
            return
        self.size += len(data)
        if self._file is None and self.size <= self._memory:
            self._parts.append(data)
            return
        budget = self._budget
        if budget is not None:
            grows = len(data) if self._file is not None else self.size
            if not budget.take(grows):
                raise _full()
            self._charged += grows
        if self._file is None:
            self._file = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
            for part in self._parts:
                self._file.write(part)
            self._parts = []
        self._file.write(data)

    def whole(self) -> bytes:
        """All of it, as one bytes object (for a body held in memory)."""
        if self._file is None:
            return self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        return b"".join(self.parts())

    def parts(self) -> Iterator[bytes]:
        if self._file is None:
            yield from self._parts
            return
        self._file.flush()
        fd = self._file.fileno()
        offset = 0
        while offset < self.size:
            part = os.pread(fd, min(READ_SIZE, self.size - offset), offset)
            if not part:
                raise OSError("the temporary file holding a body was cut short")
            offset += len(part)
            yield part

    async def stream(self) -> AsyncIterator[bytes]:
        for part in self.parts():
            yield part

    def close(self) -> None:
        self._parts = []
        if self._budget is not None and self._charged:
            self._budget.give(self._charged)
            self._charged = 0
        if self._file is not None:
            self._file.close()
            self._file = None


class AnswerSpool:
    """The parts of an answer's body between the one who writes them (`put`, then `end` or
    `fail`) and the one who reads them (`get`), in order. Up to `memory` bytes wait in memory
    (each part counted with `PART_COST`, small ones joined), then up to `disk` bytes in a
    temporary file (one region per run of parts, however many; its space is used again once
    read); past both, `put` waits for `get`. When the file cannot be made or written (a full
    disk, no descriptors, the process's `budget` spent), memory holds up to `fallback`."""

    def __init__(
        self,
        *,
        memory: int,
        disk: int,
        budget: DiskBudget | None = None,
        fallback: int = 0,
    ) -> None:
        self._memory = memory
        self._disk = disk
        self._budget = budget
        self._fallback = max(fallback, memory)
        # Each waiting item: bytes (or a bytearray of joined small parts) in memory, or a
        # [offset, length] region of the file.
        self._waiting: collections.deque[bytes | bytearray | list[int]] = collections.deque()
        self._in_memory = 0  # bytes waiting in memory, each item counted with PART_COST
        self._file: IO[bytes] | None = None
        self._written = 0  # the file's end: where the next region starts
        self._in_file = 0  # bytes waiting in the file
        self._charged = 0  # taken from the budget
        self._disk_failed = False
        self._ended = False
        self._error: BaseException | None = None
        self._reader: asyncio.Future[None] | None = None
        self._writer: asyncio.Future[None] | None = None

    async def put(self, data: bytes) -> None:
        if not data:
            return
        while not self._place(data):
            # Full: the upstream waits for the client (nginx does the same past
            # proxy_max_temp_file_size).
            self._writer = asyncio.get_running_loop().create_future()
            await self._writer
        self._wake_reader()

    def put_now(self, data: bytes) -> None:
        """`put` without waiting: for what is in memory already (read with the head)."""
        if data:
            self._hold(data)
            self._wake_reader()

    def _place(self, data: bytes) -> bool:
        """Queue `data` where it fits; False when nothing has room for it yet."""
        waiting = self._waiting
        after_file = bool(waiting) and isinstance(waiting[-1], list)
        if not after_file and (
            self._in_memory + len(data) + PART_COST <= self._memory or not waiting
        ):
            self._hold(data)
            return True
        if not self._disk_failed:
            # The file's size, not what waits in it: its space is used again only once all
            # of it was read (a reader that keeps up but never catches up would otherwise
            # grow it without end).
            if self._written + len(data) > self._disk:
                return False
            try:
                self._to_file(data)
                return True
            except OSError as exc:
                # From now on this answer waits in memory only, up to its fallback.
                self._disk_failed = True
                logger.warning("an answer's temporary file failed, held in memory: %r", exc)
        if self._in_memory + len(data) + PART_COST <= self._fallback or not self._in_memory:
            self._hold(data)
            return True
        return False

    def _hold(self, data: bytes) -> None:
        waiting = self._waiting
        last = waiting[-1] if waiting else None
        if (
            len(data) < _SMALL
            and isinstance(last, bytearray)
            and len(last) + len(data) <= READ_SIZE
        ):
            last += data
            self._in_memory += len(data)
            return
        waiting.append(bytearray(data) if len(data) < _SMALL else data)
        self._in_memory += len(data) + PART_COST

    def end(self) -> None:
        self._ended = True
        self._wake_reader()

    def fail(self, error: BaseException) -> None:
        self._ended = True
        self._error = error
        self._wake_reader()

    async def get(self) -> bytes | None:
        """The next part; None once the writer ended and all was read. Raises what the
        writer failed with, once the parts before the failure were read."""
        while not self._waiting:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._reader = asyncio.get_running_loop().create_future()
            await self._reader
        item = self._waiting[0]
        if isinstance(item, list):
            data = self._from_file(item)
        else:
            self._waiting.popleft()
            self._in_memory -= len(item) + PART_COST
            data = bytes(item) if isinstance(item, bytearray) else item
        if self._writer is not None and not self._writer.done():
            self._writer.set_result(None)
        return data

    def _to_file(self, data: bytes) -> None:
        if self._budget is not None:
            if not self._budget.take(len(data)):
                raise _full()
            self._charged += len(data)
        if self._file is None:
            self._file = tempfile.TemporaryFile(buffering=0)  # noqa: SIM115 (close())
        offset = self._written
        done = 0
        while done < len(data):
            done += os.pwrite(self._file.fileno(), data[done:], offset + done)
        self._written += len(data)
        self._in_file += len(data)
        last = self._waiting[-1] if self._waiting else None
        if isinstance(last, list) and last[0] + last[1] == offset:
            last[1] += len(data)  # the same run of parts: one region
        else:
            self._waiting.append([offset, len(data)])

    def _from_file(self, region: list[int]) -> bytes:
        assert self._file is not None
        offset, length = region
        data = os.pread(self._file.fileno(), min(length, READ_SIZE), offset)
        if not data:
            raise OSError("the temporary file holding an answer was cut short")
        region[0] += len(data)
        region[1] -= len(data)
        self._in_file -= len(data)
        if not region[1]:
            self._waiting.popleft()
            if not self._in_file:
                # All read: the file's space is used again from its start, and given back.
                os.ftruncate(self._file.fileno(), 0)
                self._written = 0
                self._give_back()
        return data

    def _give_back(self) -> None:
        if self._budget is not None and self._charged:
            self._budget.give(self._charged)
            self._charged = 0

    def _wake_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    def close(self) -> None:
        self._waiting.clear()
        self._in_memory = self._in_file = 0
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()
        self._give_back()
        if self._file is not None:
            self._file.close()
            self._file = None
