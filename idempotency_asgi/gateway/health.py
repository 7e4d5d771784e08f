"""The gateway's own health check: answered by the gateway, whatever the methods it covers,
and never forwarded (an upstream route of the same name stays out of reach)."""

from __future__ import annotations

from starlette.types import Send

from . import problems

_BODY = b'{"status":"ok"}'
_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_BODY)).encode()),
    (b"cache-control", b"no-store"),
]


async def answer_health(method: str, path: str, send: Send) -> None:
    """200 to GET, and to HEAD without the body; 405 with `Allow` to anything else."""
    if method == "GET" or method == "HEAD":
        # A list of its own each time: a middleware around the gateway may add to it.
        await send({"type": "http.response.start", "status": 200, "headers": list(_HEADERS)})
        await send({"type": "http.response.body", "body": _BODY if method == "GET" else b""})
        return
    await problems.health_method_not_allowed(path).send(send)
