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
"""

from __future__ import annotations

import asyncio
import collections
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import IO

#: What a file-backed body is read back in, per part.
READ_SIZE = 64 * 1024


class BodySpool:
    """A body in memory up to `memory` bytes; past that, all of it in a temporary file."""

    def __init__(self, *, memory: int) -> None:
        self._memory = memory
        self._parts: list[bytes] = []
        self._file: IO[bytes] | None = None
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
        if self._file is not None:
            self._file.close()
            self._file = None


class AnswerSpool:
    """The parts of an answer's body between the one who writes them (`put`, then `end` or
    `fail`) and the one who reads them (`get`), in order. Up to `memory` bytes wait in memory,
    then up to `disk` bytes in a temporary file; past both, `put` waits for `get`."""

    def __init__(self, *, memory: int, disk: int) -> None:
        self._memory = memory
        self._disk = disk
        # Each waiting part: bytes in memory, or (offset, length) in the file.
        self._waiting: collections.deque[bytes | tuple[int, int]] = collections.deque()
        self._in_memory = 0
        self._file: IO[bytes] | None = None
        self._written = 0  # bytes ever written to the file (its space is not reused)
        self._ended = False
        self._error: BaseException | None = None
        self._reader: asyncio.Future[None] | None = None
        self._writer: asyncio.Future[None] | None = None

    async def put(self, data: bytes) -> None:
        while True:
            if self._in_memory + len(data) <= self._memory or (
                not self._waiting and not self._in_memory
            ):
                self._waiting.append(data)
                self._in_memory += len(data)
                break
            if self._written + len(data) <= self._disk:
                self._waiting.append((self._to_file(data), len(data)))
                break
            # Both full: the upstream waits for the client (nginx does the same past
            # proxy_max_temp_file_size).
            self._writer = asyncio.get_running_loop().create_future()
            await self._writer
        self._wake_reader()

    def put_now(self, data: bytes) -> None:
        """`put` without waiting: for what is in memory already (read with the head)."""
        self._waiting.append(data)
        self._in_memory += len(data)
        self._wake_reader()

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
        item = self._waiting.popleft()
        if isinstance(item, bytes):
            self._in_memory -= len(item)
            data = item
        else:
            assert self._file is not None
            data = os.pread(self._file.fileno(), item[1], item[0])
        if self._writer is not None and not self._writer.done():
            self._writer.set_result(None)
        return data

    def _to_file(self, data: bytes) -> int:
        if self._file is None:
            self._file = tempfile.TemporaryFile(buffering=0)  # noqa: SIM115 (close())
        offset = self._written
        done = 0
        while done < len(data):
            done += os.pwrite(self._file.fileno(), data[done:], offset + done)
        self._written += len(data)
        return offset

    def _wake_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    def close(self) -> None:
        self._waiting.clear()
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()
        if self._file is not None:
            self._file.close()
            self._file = None
