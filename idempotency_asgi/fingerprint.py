"""The request fingerprint: what makes two requests "the same request".

It covers the method, the path, the raw query string, the configured headers and the body in
canonical form: JSON is re-serialised with sorted keys and no insignificant whitespace, a form
body becomes its sorted pairs, anything else is its raw bytes. Each part is length-prefixed, so
no two different requests can collide by shifting bytes between parts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from urllib.parse import parse_qsl, urlencode

import orjson


def canonical_body(content_type: bytes, body: bytes) -> bytes:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    if media_type == b"application/json" or media_type.endswith(b"+json"):
        try:
            return orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS)
        except orjson.JSONDecodeError:
            # Not valid JSON (or numbers orjson cannot hold): the bytes themselves are the
            # request; the application will reject it, and that answer is what gets stored.
            return body
    if media_type == b"application/x-www-form-urlencoded":
        try:
            pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
        except UnicodeDecodeError:
            return body
        return urlencode(sorted(pairs)).encode("ascii")
    return body


def fingerprint(
    *,
    method: str,
    path: str,
    query_string: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    fingerprint_headers: Sequence[bytes],
    body: bytes,
) -> bytes:
    """sha256 of the canonical request (32 bytes)."""
    header_map: dict[bytes, list[bytes]] = {}
    content_type = b""
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-type":
            content_type = value
        if lowered in fingerprint_headers:
            header_map.setdefault(lowered, []).append(value)
    digest = hashlib.sha256()
    parts = [method.encode("ascii"), path.encode("utf-8"), query_string]
    for name in fingerprint_headers:
        parts.append(name)
        parts.append(b"\n".join(header_map.get(name, [])))
    parts.append(canonical_body(content_type, body))
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()
