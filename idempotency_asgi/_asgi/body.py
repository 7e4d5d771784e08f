"""The request body: read once, within a limit, then handed to the application."""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Scope


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


def replay_body(body: bytes, receive: Receive) -> Receive:
    """Hand the buffered body to the application once; then never report a disconnect.

    The request must run to completion and be recorded even when its client has gone (the
    retry will want the replay), so an application that listens for the disconnect (a
    streaming response does) is not told, and finishes normally.
    """
    sent = False

    async def wrapped() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return wrapped
