"""The request fingerprint's cost per KiB of body, by kind of JSON body (and form and raw bytes
for scale): `python -m bench.fingerprint`. Each body is about 1 MiB; the figure is the best of
five runs, in microseconds of CPU per KiB."""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson

from idempotency_asgi._asgi.fingerprint import fingerprint

SIZE = 1024 * 1024


def _repeat(item: bytes) -> bytes:
    count = SIZE // (len(item) + 1)
    return b"[" + b",".join([item] * count) + b"]"


BODIES: dict[str, tuple[bytes, bytes]] = {
    "json: array of integers": (b"application/json", _repeat(b"1234567")),
    "json: array of small objects": (
        b"application/json",
        _repeat(b'{"sku":"A-1042","qty":3,"price_cents":1999,"gift":false,"note":null}'),
    ),
    "json: objects with floats": (
        b"application/json",
        _repeat(b'{"lat":52.52,"lon":13.405,"w":0.1}'),
    ),
    "json: floats written long": (b"application/json", _repeat(b"0.10000000000000001")),
    "json: strings, non-ASCII": (b"application/json", _repeat(orjson.dumps("naïve café — 東京"))),
    "json: one object, duplicate names": (
        b"application/json",
        b"{" + b",".join([b'"a":1'] * (SIZE // 6)) + b"}",
    ),
    "form": (b"application/x-www-form-urlencoded", b"a=1&" * (SIZE // 4)),
    "raw bytes": (b"application/octet-stream", b"\x00" * SIZE),
}


def cost(content_type: bytes, body: bytes, run: Callable[..., object] = fingerprint) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        run(
            method="POST",
            raw_path=b"/orders",
            query_string=b"",
            headers=[(b"content-type", content_type)],
            fingerprint_headers=(),
            body=body,
        )
        best = min(best, time.process_time() - started)
    return best * 1e6 / (len(body) / 1024)


def main() -> None:
    for name, (content_type, body) in BODIES.items():
        print(f"{name:38} {cost(content_type, body):8.2f} us/KiB")


if __name__ == "__main__":
    main()
