"""Reading the Idempotency-Key request header, and what a tenant id may be (the key and the
tenant are the key record's primary key)."""

from __future__ import annotations

from collections.abc import Iterable

HEADER = b"idempotency-key"
MAX_KEY_LENGTH = 255
_VISIBLE = bytes(range(0x21, 0x7F))

#: The longest tenant id, in UTF-8 bytes. The tenant and the key (at most 255 bytes) make the
#: primary key, and PostgreSQL refuses an index entry beyond about 2,700 bytes: a longer id
#: would fail every claim the same way. Account ids, token subjects and credential hashes are
#: far shorter.
MAX_TENANT_BYTES = 1024


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
    if raw.translate(None, _VISIBLE):  # what is left is not visible ASCII
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


def unstorable_tenant(tenant: str) -> str | None:
    """Why a tenant id cannot be a key column as it is (a NUL, a lone surrogate, too long),
    or None when it can. It is never rewritten, since two tenants must never become one."""
    if "\x00" in tenant:
        return "it contains NUL"
    try:
        size = len(tenant.encode("utf-8"))
    except UnicodeEncodeError:
        return "it contains a lone surrogate"
    if size > MAX_TENANT_BYTES:
        return f"it is {size} bytes long, more than {MAX_TENANT_BYTES}"
    return None
