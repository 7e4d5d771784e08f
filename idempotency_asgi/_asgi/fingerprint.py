"""The request fingerprint: sha256 of what makes two requests "the same request".

It covers the method, the path as sent (the raw path: `/a%2Fb` is not `/a/b`), the raw query
string, the configured headers, what says how to read the body (Content-Type, without the
boundary of a multipart body read as parts, and Content-Encoding) and the body in canonical
form (see canonical.py). Every part is length-prefixed, so no two different requests collide
by shifting bytes from one part to the next.

`fingerprint_of` is the same, awaited: a large body is canonicalised in a thread of its own,
so that the event loop never waits for it (JSON written out of orjson's reach, a float not
in its shortest form say, costs the definition's own writer up to 0.3 ms per KiB).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from .canonical import MULTIPART, canonical_body, frame, multipart_boundary

#: Bumped whenever the definition changes: the digest of a request under one definition never
#: equals its digest under another by accident.
VERSION = b"idempotency-asgi fingerprint 5"


def fingerprint(
    *,
    method: str,
    raw_path: bytes,
    query_string: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    fingerprint_headers: Sequence[bytes],
    body: bytes,
) -> bytes:
    """sha256 of the canonical request (32 bytes). `fingerprint_headers` are lower case."""
    content_types: list[bytes] = []
    encodings: list[bytes] = []
    chosen: dict[bytes, list[bytes]] = {}
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-type":
            content_types.append(value.strip())
        elif lowered == b"content-encoding":
            encodings.append(value.strip())
        if lowered in fingerprint_headers:
            chosen.setdefault(lowered, []).append(value)
    if len(content_types) == 1:
        content_type = content_types[0]
        media_type = content_type.split(b";", 1)[0].strip().lower()
    else:
        content_type = media_type = b""  # none, or ambiguous: the body is read as bytes
    body_form = canonical_body(media_type, content_type, body)
    # A multipart body read as parts counts without its boundary (it changes when a client
    # rebuilds the body, and the parts are compared without it) but with every other
    # parameter (a charset changes what the parts say). One read as bytes keeps it all.
    parsed = multipart_boundary(content_type) if body_form.startswith(MULTIPART) else None
    described = content_types if parsed is None else [parsed[1]]
    chosen_headers = (
        frame(frame((name, frame(chosen.get(name, [])))) for name in fingerprint_headers)
        if fingerprint_headers
        else _NONE
    )
    parts = (
        VERSION,
        method.encode("ascii"),
        raw_path,
        query_string,
        chosen_headers,
        frame(described),
        frame(encodings) if encodings else _NONE,
        body_form,
    )
    return hashlib.sha256(frame(parts)).digest()


_NONE = frame(())

#: Bodies up to this size are fingerprinted on the event loop: orjson canonicalises 64 KiB of
#: JSON in about a millisecond, less than handing it to a thread and back costs in latency.
INLINE_BYTES = 64 * 1024

#: Threads canonicalising large bodies at once, per process: a bound on the CPU that bodies
#: sent by anyone (made-up credentials too) take from everything else; more wait their turn,
#: without holding the event loop.
THREADS = 2

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


async def fingerprint_of(
    *,
    method: str,
    raw_path: bytes,
    query_string: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    fingerprint_headers: Sequence[bytes],
    body: bytes,
) -> bytes:
    """`fingerprint(...)`, computed in a thread when the body is larger than `INLINE_BYTES`."""
    if len(body) <= INLINE_BYTES:
        return fingerprint(
            method=method,
            raw_path=raw_path,
            query_string=query_string,
            headers=headers,
            fingerprint_headers=fingerprint_headers,
            body=body,
        )
    compute = partial(
        fingerprint,
        method=method,
        raw_path=raw_path,
        query_string=query_string,
        headers=list(headers),
        fingerprint_headers=fingerprint_headers,
        body=body,
    )
    return await asyncio.get_running_loop().run_in_executor(_threads(), compute)


def _threads() -> ThreadPoolExecutor:
    # Made on first use, in the process that uses it (a worker forked by a server gets its
    # own, never a copy of its parent's threads).
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(THREADS, thread_name_prefix="idempotency-fingerprint")
        return _executor
