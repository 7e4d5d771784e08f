"""The request body: read once, within a limit, then handed to the application."""

from __future__ import annotations

from starlette.types import Receive, Scope


class BodyTooLarge(Exception):
    """The request body is larger than the configured limit."""


def declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0  # the server rejects malformed lengths; the byte count decides
    return 0


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None when the client disconnected; raises past `limit`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
