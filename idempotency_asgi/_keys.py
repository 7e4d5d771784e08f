"""Reading the Idempotency-Key request header."""

from __future__ import annotations

from collections.abc import Iterable

HEADER = b"idempotency-key"
MAX_KEY_LENGTH = 255


class InvalidKey(ValueError):
    """The header is present but unusable; `str(exc)` says why, for the problem detail."""


def read_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Return the key, None when the header is absent, or raise InvalidKey."""
    values = [value for name, value in headers if name.lower() == HEADER]
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKey("The Idempotency-Key header was sent more than once; send it once.")
    return _parse(values[0].strip(b" \t"))


def _parse(raw: bytes) -> str:
    # RFC 8941 string form ("abc"): the IETF draft defines the header as an sf-string,
    # while most clients send the bare token; both mean the same key.
    if raw[:1] == b'"':
        raw = _unquote(raw)
    if not raw:
        raise InvalidKey("The Idempotency-Key header is empty.")
    if len(raw) > MAX_KEY_LENGTH:
        raise InvalidKey(f"The Idempotency-Key is longer than {MAX_KEY_LENGTH} characters.")
    if any(byte < 0x21 or byte > 0x7E for byte in raw):
        raise InvalidKey(
            "The Idempotency-Key may contain only visible ASCII characters (no spaces)."
        )
    return raw.decode("ascii")


def _unquote(raw: bytes) -> bytes:
    if len(raw) < 2 or raw[-1:] != b'"':
        raise InvalidKey("The quoted Idempotency-Key has no closing quote.")
    inner = raw[1:-1]
    out = bytearray()
    escaped = False
    for byte in inner:
        if escaped:
            if byte not in b'"\\':
                raise InvalidKey("The quoted Idempotency-Key has an invalid escape.")
            out.append(byte)
            escaped = False
        elif byte == 0x5C:  # backslash
            escaped = True
        elif byte == 0x22:  # a bare quote inside the string
            raise InvalidKey("The quoted Idempotency-Key has an unescaped quote.")
        else:
            out.append(byte)
    if escaped:
        raise InvalidKey("The quoted Idempotency-Key ends in a lone backslash.")
    return bytes(out)
