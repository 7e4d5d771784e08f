"""A TCP relay between the store and PostgreSQL, in the test's own event loop, that can hold
back what the server sends: a statement then runs (and commits) on the server while its
client has heard nothing yet, as when an answer is lost on a slow or broken network."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Collection
from urllib.parse import parse_qs, urlsplit, urlunsplit

#: The requests a client may send before its startup message (SSL, GSS encryption).
_ENCRYPTION_REQUESTS = (80877103, 80877104)


class Relay:
    """`refuse`: startup parameters refused as PgBouncer refuses those it does not know (an
    error, SQLSTATE 08P01, and the connection closed), or, with `as_unknown`, as a server
    refuses one it does not know (42704, an older PostgreSQL's answer to a newer setting);
    `refused` counts the refusals."""

    def __init__(self, dsn: str, *, refuse: Collection[str] = (), as_unknown: bool = False) -> None:
        self._dsn = dsn
        self._refuse = frozenset(refuse)
        self._as_unknown = as_unknown
        self.refused = 0
        parts = urlsplit(dsn)
        query = parse_qs(parts.query)
        host = (query.get("host") or [parts.hostname or "127.0.0.1"])[0]
        port = int((query.get("port") or [parts.port or 5432])[0])
        # The embedded server listens on a unix socket only (host=<its directory>).
        self._unix = f"{host}/.s.PGSQL.{port}" if host.startswith("/") else None
        self._target = (host, port)
        self._held = asyncio.Event()
        self._held.set()  # set: bytes flow
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def dsn(self) -> str:
        """The same database, through the relay."""
        parts = urlsplit(self._dsn)
        user = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
        netloc = f"{user}@127.0.0.1:{self.port}" if user else f"127.0.0.1:{self.port}"
        query = "&".join(
            f"{name}={value}"
            for name, values in parse_qs(parts.query).items()
            if name not in ("host", "port")
            for value in values
        )
        return urlunsplit((parts.scheme, netloc, parts.path, query, ""))

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._held.set()
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    def hold(self) -> None:
        """From now on, what the server sends waits here."""
        self._held.clear()

    def release(self) -> None:
        self._held.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._unix is not None:
            up_reader, up_writer = await asyncio.open_unix_connection(self._unix)
        else:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        if self._refuse and not await self._startup(reader, writer, up_reader, up_writer):
            writer.close()
            up_writer.close()
            return
        down = asyncio.ensure_future(self._pipe(up_reader, writer, held=True))
        up = asyncio.ensure_future(self._pipe(reader, up_writer, held=False))
        self._tasks.update((down, up))
        try:
            await asyncio.wait((down, up), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (down, up):
                task.cancel()
            for stream in (writer, up_writer):
                stream.close()

    async def _startup(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> bool:
        """Pass on the client's encryption requests and its startup message, unless that
        names a refused parameter: then answer as PgBouncer does, and say False."""
        while True:
            head = await reader.readexactly(8)
            length, code = struct.unpack("!II", head)
            if code not in _ENCRYPTION_REQUESTS:
                break
            up_writer.write(head)
            await up_writer.drain()
            writer.write(await up_reader.readexactly(1))  # 'N': not here
            await writer.drain()
        rest = await reader.readexactly(length - 8)
        names = {name.decode() for name in rest.split(b"\0")[0::2] if name}
        refused = sorted(names & self._refuse)
        if refused:
            self.refused += 1
            if self._as_unknown:
                code, message = "42704", f'unrecognized configuration parameter "{refused[0]}"'
            else:
                code, message = "08P01", f"unsupported startup parameter: {refused[0]}"
            fields = f"SFATAL\0VFATAL\0C{code}\0M{message}\0\0".encode()
            writer.write(b"E" + struct.pack("!I", len(fields) + 4) + fields)
            await writer.drain()
            return False
        up_writer.write(head + rest)
        await up_writer.drain()
        return True

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, held: bool
    ) -> None:
        while data := await reader.read(65536):
            if held:
                await self._held.wait()
            writer.write(data)
            await writer.drain()


async def storm(port: int, request: bytes, count: int) -> list[int]:
    """`count` connections to 127.0.0.1:`port`, each sending `request` (one whole HTTP/1.1
    request with `Connection: close`) at the same moment, once all are connected: the
    statuses answered. A storm as the server sees one, which a client library's own pace
    (one request built and parsed at a time in the test's process) never makes."""
    opening = asyncio.Semaphore(256)

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with opening:
            return await asyncio.open_connection("127.0.0.1", port)

    streams = await asyncio.gather(*(connect() for _ in range(count)))
    for _, writer in streams:
        writer.write(request)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        try:
            head = await reader.readline()
            await reader.read()  # to the close
            return int(head.split()[1])
        finally:
            writer.close()

    return await asyncio.gather(*(answer(r, w) for r, w in streams))
