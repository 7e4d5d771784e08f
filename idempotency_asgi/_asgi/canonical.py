"""Request bodies in canonical form: what makes two bodies "the same request".

The rule: two bodies an application could treat differently never share a canonical form,
while a faithful retry always does, including one a client rebuilt from the same data (JSON
written again in another key order, a multipart body with a new random boundary).

- JSON (`application/json`, `application/*+json`): parsed and written back with the members
  of each object sorted by name (stably: members that share a name keep their order, since
  parsers differ on which one wins), no insignificant whitespace, one escaping for strings,
  and every number literal exactly as sent (`18446744073709551617` and `0.10000000000000001`
  never become floats). Only strict UTF-8, and at most `MAX_JSON_DEPTH` levels of nesting.
- Forms (`application/x-www-form-urlencoded`): the bytes, so the pairs in the order sent
  (`a=1&b=2` is not `b=2&a=1`): an application may read them in order, with
  `form.multi_items()`, and pair up `item=apple&qty=1&item=pear&qty=5` by position, which a
  sorted form would confuse with `item=apple&item=pear&qty=1&qty=5`. A client that reorders
  its own retry gets a 422, which is safe.
- Multipart (`multipart/*`): the parts in order, each exactly as sent (its headers and its
  content). The boundary is not part of it; so only a Content-Type that names one boundary
  unambiguously, and a body in the one shape every parser reads alike, are read as parts.
- Anything else, and any body that does not parse as what its type says: the bytes.

Each form is tagged with its kind, so no canonical form can equal another kind's. Nothing in
here raises on any input: a body it cannot read is its own bytes.
"""

from __future__ import annotations

import json
import re
import struct
from array import array
from collections.abc import Iterable
from itertools import accumulate
from operator import itemgetter
from typing import Any

#: Deeper JSON is fingerprinted as its bytes. The parser and the writer below recurse once per
#: level; this bound keeps them far from Python's recursion limit wherever they are called
#: from, so the same body always gets the same fingerprint.
MAX_JSON_DEPTH = 128

RAW, JSON, MULTIPART = b"raw", b"json", b"multipart"


def frame(parts: Iterable[bytes]) -> bytes:
    """Length-prefixed concatenation: no two different sequences of parts frame alike."""
    out = bytearray()
    for part in parts:
        out += _LENGTH.pack(len(part))
        out += part
    return bytes(out)


_LENGTH = struct.Struct(">Q")


def canonical_body(media_type: bytes, content_type: bytes, body: bytes) -> bytes:
    """The tagged canonical form of `body`. `media_type` is the lower-cased type/subtype of
    `content_type`, the whole header value (where a multipart boundary is found)."""
    kind, form = RAW, None
    if media_type == b"application/json" or (
        media_type.startswith(b"application/") and media_type.endswith(b"+json")
    ):
        kind, form = JSON, canonical_json(body)
    elif media_type.startswith(b"multipart/"):
        kind, form = MULTIPART, canonical_multipart(content_type, body)
    if form is None:
        return RAW + b":" + body
    return kind + b":" + form


# -- JSON --------------------------------------------------------------------------------


class _Literal(str):
    """A number (or NaN/Infinity, which Python's parser accepts) exactly as it was written."""

    __slots__ = ()


class _Members(list):  # type: ignore[type-arg]
    """An object's members, as (name, value) pairs in the order sent."""

    __slots__ = ()


_DECODER = json.JSONDecoder(
    object_pairs_hook=_Members,
    parse_int=_Literal,
    parse_float=_Literal,
    parse_constant=_Literal,
)
_string = json.encoder.encode_basestring_ascii  # one escaping for every string: injective
_name = itemgetter(0)

# A string, or what is left of one that never closes (its end ends the match): a pattern that
# had to find the closing quote failed at every escaped quote of an unclosed string, after
# scanning to the end each time (32 KiB of them took 4 s).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def canonical_json(body: bytes) -> bytes | None:
    if _deeper_than(body, MAX_JSON_DEPTH):
        return None
    try:
        value = _DECODER.decode(body.decode("utf-8"))
        out: list[str] = []
        _write(value, out)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError included
        return None
    return "".join(out).encode("ascii")


def _deeper_than(body: bytes, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than `limit`; cheap when the body holds
    few brackets at all (as nearly every request does)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    steps = _JSON_STRING.sub(b"", body).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return max(accumulate(array("b", steps)), default=0) > limit


def _write(value: Any, out: list[str]) -> None:
    if type(value) is _Literal:
        out.append(value)
    elif isinstance(value, str):
        out.append(_string(value))
    elif type(value) is _Members:
        out.append("{")
        for index, (name, member) in enumerate(sorted(value, key=_name)):
            if index:
                out.append(",")
            out.append(_string(name))
            out.append(":")
            _write(member, out)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _write(item, out)
        out.append("]")
    else:
        out.append("null" if value is None else "true" if value else "false")


# -- multipart ---------------------------------------------------------------------------

# RFC 9110: a media type and its parameters (section 8.3.1), tokens and quoted strings (5.6).
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_MEDIA_TYPE = re.compile(rb"[ \t]*" + _TOKEN + rb"/" + _TOKEN)
_PARAMETER = re.compile(
    rb"[ \t]*;[ \t]*(" + _TOKEN + rb")=(" + _TOKEN + rb'|"[^"\\]*(?:\\.[^"\\]*)*")', re.DOTALL
)
_BOUNDARY_MARK = b";boundary="


def multipart_boundary(content_type: bytes) -> tuple[bytes, bytes] | None:
    """The boundary a multipart Content-Type names, and the Content-Type with the boundary's
    value taken out (every other byte kept). None unless the header parses as RFC 9110 writes
    it and names one boundary that every parser reads alike: parsers disagree on a repeated
    parameter (the first or the last), on escapes inside a quoted one, and on `boundary*`."""
    found = _MEDIA_TYPE.match(content_type)
    if found is None:
        return None
    position = found.end()
    described = bytearray(content_type[:position])
    boundary = None
    while position < len(content_type):
        parameter = _PARAMETER.match(content_type, position)
        if parameter is None:
            if content_type[position:].strip(b" \t"):
                return None  # not a parameter list as the RFC writes it
            break
        name, value = parameter.group(1).lower(), parameter.group(2)
        if b"boundary" in name:
            if name != b"boundary" or boundary is not None:
                return None
            if value.startswith(b'"'):
                value = value[1:-1]
                if b"\\" in value:
                    return None
            boundary = value
            described += _BOUNDARY_MARK
        else:
            described += content_type[position : parameter.end()]
        position = parameter.end()
    if not boundary:
        return None
    return boundary, bytes(described)


def canonical_multipart(content_type: bytes, body: bytes) -> bytes | None:
    """The parts in order, each exactly as sent (its headers and its content), without the
    delimiters. Only a body in the shape every parser reads the same way is read as parts: it
    opens with its first delimiter (no preamble), each delimiter line is bare (no transport
    padding), and it ends with the close delimiter and at most a CRLF (no epilogue). Parsers
    disagree on everything else (one ignores a preamble, another refuses the body), so anything
    else is compared as its bytes, boundary included."""
    parsed = multipart_boundary(content_type)
    if parsed is None:
        return None
    chunks = (b"\r\n" + body).split(b"\r\n--" + parsed[0])
    if chunks[0] or len(chunks) < 2:
        return None  # a preamble, or no delimiter at all
    *parts, close = chunks[1:]
    if close not in (b"--", b"--\r\n") or not all(part.startswith(b"\r\n") for part in parts):
        return None
    return frame(part[2:] for part in parts)
