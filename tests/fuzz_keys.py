"""Idempotency-Key header values for the fuzz, and what the contract (docs/contract.md) says
each one means.

The oracle is written from the contract and RFC 8941 (sf-string), not from the library: a key is
valid when, once unquoted, it is 1 to 255 visible ASCII characters and the header came once.
Values are kept to what HTTP/1.1 can carry (no NUL, CR or LF; no whitespace at either end):
everything else, obs-text and control bytes included, goes on the wire as generated.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

MAX_LENGTH = 255
VISIBLE = "".join(map(chr, range(0x21, 0x7F)))
OBS_TEXT = "".join(map(chr, range(0x80, 0x100)))
CONTROLS = "".join(map(chr, [*range(0x01, 0x09), *range(0x0E, 0x20), 0x7F]))


class Missing:
    def __repr__(self) -> str:
        return "MISSING"


class Invalid:
    def __repr__(self) -> str:
        return "INVALID"


MISSING, INVALID = Missing(), Invalid()


@dataclass(frozen=True)
class KeyHeader:
    values: tuple[bytes, ...]  # one per header line; () sends none


def designed_key(values: tuple[bytes, ...]) -> str | Missing | Invalid:
    """The key the contract (docs/contract.md) reads from these header values."""
    if not values:
        return MISSING
    if len(values) > 1:
        return INVALID
    raw = values[0]
    value = _sf_string(raw) if raw.startswith(b'"') else raw
    if value is None or not 1 <= len(value) <= MAX_LENGTH:
        return INVALID
    if any(not 0x21 <= byte <= 0x7E for byte in value):
        return INVALID
    return value.decode("ascii")


def forbidden_by_http(values: tuple[bytes, ...]) -> bool:
    """Whether a value holds a control character, which HTTP forbids in a field value
    (RFC 9110 5.5): a server may refuse such a request before any application sees it."""
    return any((byte < 0x20 and byte != 0x09) or byte == 0x7F for value in values for byte in value)


def _sf_string(raw: bytes) -> bytes | None:
    """RFC 8941 §4.2.5: the string's value, or None when `raw` is not exactly one sf-string."""
    out = bytearray()
    index = 1
    while index < len(raw):
        byte = raw[index]
        if byte == 0x5C:  # backslash: only \" and \\ are escapes
            if index + 1 >= len(raw) or raw[index + 1] not in b'"\\':
                return None
            out.append(raw[index + 1])
            index += 2
        elif byte == 0x22:  # the closing quote: it must end the value
            return bytes(out) if index == len(raw) - 1 else None
        elif 0x20 <= byte <= 0x7E:
            out.append(byte)
            index += 1
        else:
            return None
    return None  # no closing quote


def spellings(key: str) -> list[bytes]:
    """Header values that all mean `key`: the bare token and the sf-string."""
    quoted = b'"' + key.encode().replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'
    return [quoted] if key.startswith('"') else [key.encode(), quoted]


# -- strategies --------------------------------------------------------------------------


def _latin1(text: str) -> bytes:
    return text.encode("latin-1")


def _quote(pieces: list[str], closed: bool) -> bytes:
    text = '"' + "".join(pieces) + ('"' if closed else "")
    return _latin1(text.rstrip(" \t"))  # a header value cannot end in whitespace


@st.composite
def _with_inside(draw: st.DrawFn, alphabet: str) -> bytes:
    """A visible token with characters of `alphabet` somewhere inside it."""
    left = draw(st.text(VISIBLE, min_size=1, max_size=8))
    middle = draw(st.text(alphabet, min_size=1, max_size=3))
    right = draw(st.text(VISIBLE, min_size=1, max_size=8))
    return _latin1(left + middle + right)


_good_pieces = st.one_of(
    st.sampled_from(VISIBLE.replace('"', "").replace("\\", "")),
    st.sampled_from(['\\"', "\\\\"]),
)
_quoted_pieces = st.one_of(
    st.sampled_from(VISIBLE.replace('"', "").replace("\\", "") + " "),  # plain
    st.sampled_from(['\\"', "\\\\"]),  # good escapes
    st.sampled_from(VISIBLE.replace('"', "").replace("\\", "")).map(lambda c: "\\" + c),  # bad
    st.just('"'),  # a bare quote inside
    st.sampled_from(OBS_TEXT + "\t"),
)

key_values = st.one_of(
    st.text(VISIBLE, min_size=1, max_size=40).map(_latin1),
    st.builds(_quote, st.lists(_good_pieces, min_size=1, max_size=12), st.just(True)),
    st.integers(MAX_LENGTH - 3, MAX_LENGTH + 3).flatmap(
        lambda n: st.text(VISIBLE, min_size=n, max_size=n).map(_latin1)
    ),
    st.builds(_quote, st.lists(_quoted_pieces, max_size=12), st.booleans()),
    st.integers(MAX_LENGTH - 2, MAX_LENGTH + 2).flatmap(
        lambda n: st.text(VISIBLE.replace('"', ""), min_size=n, max_size=n).map(
            lambda t: _latin1('"' + t.replace("\\", "\\\\") + '"')
        )
    ),
    _with_inside(OBS_TEXT),
    _with_inside(" \t"),
    _with_inside(CONTROLS),
    st.just(b""),
)

_once = key_values.map(lambda value: KeyHeader((value,)))
key_headers = st.one_of(
    _once,
    _once,
    _once,
    st.just(KeyHeader(())),
    st.tuples(key_values, key_values).map(KeyHeader),
    key_values.map(lambda value: KeyHeader((value, value))),
)
