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

JSON is canonicalised by orjson (parsed, and written back with its keys sorted) whenever that
gives exactly the bytes the definition above gives, which is nearly always: 5 to 20 us of
CPU per KiB instead of 110 to 310 (`python -m bench.fingerprint`; a 1 MiB body held the event
loop for a quarter of a second). The definition, and so every fingerprint stored before, is
unchanged: orjson's form is used only when the body has no number orjson would write back
otherwise (a float not in its shortest form, an integer past 64 bits, `-0`) and no object
with a name twice (orjson keeps the last), and its strings are escaped back into the
definition's ASCII-only form. Anything else takes the definition's own writer, below.
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

import orjson

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


def _literal(text: str) -> _Literal:
    # A function, not the class itself: its frames are where the interpreter may hand the
    # GIL to another thread, so that a large body decoded in a thread (`fingerprint_of`)
    # never holds the event loop for the whole of json's C scanner.
    return _Literal(text)


def _members(pairs: list[tuple[str, Any]]) -> _Members:
    return _Members(pairs)


_DECODER = json.JSONDecoder(
    object_pairs_hook=_members,
    parse_int=_literal,
    parse_float=_literal,
    parse_constant=_literal,
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
    fast = _sorted_by_orjson(body)  # None too for a body nested too deep
    if fast is not None:
        return fast
    if _deeper_than(body, MAX_JSON_DEPTH):
        return None
    return _defined(body)


def _defined(body: bytes) -> bytes | None:
    """The canonical form as the module's docstring defines it, written here value by value
    (no depth check: `canonical_json` makes it)."""
    try:
        value = _DECODER.decode(body.decode("utf-8"))
        out: list[str] = []
        _write(value, out)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError included
        return None
    return "".join(out).encode("ascii")


#: A float, from its first digit (never from one inside an integer: no quadratic search).
_FLOAT = re.compile(rb"(?<![0-9.])-?[0-9]++(?:\.[0-9]++(?:[eE][+-]?[0-9]++)?|[eE][+-]?[0-9]++)")
_NEGATIVE_ZERO = re.compile(rb"-0(?![.eE0-9])")
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0000000000")
#: 19 digits in a row: an integer orjson may not read exactly (past 64 bits it reads a float).
_LONG_RUN = b"0" * 19
_BRACKETS_IN = (b"[", b"{")


def _sorted_by_orjson(body: bytes) -> bytes | None:
    """The canonical form, from orjson, when it is exactly the definition's; else None.

    Each check looks at the whole body, strings included (looking past strings costs more
    than the rest together): a number-like text inside a string can only send a body to the
    definition's writer needlessly, never let a number through that orjson writes otherwise."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    digits = body.translate(_DIGITS_AS_ZERO)
    if _LONG_RUN in digits:
        return None
    if b"-0" in body and _NEGATIVE_ZERO.search(body) is not None:
        return None  # orjson reads -0 as 0
    if b"0." in digits or b"0e" in digits or b"0E" in digits:
        # Floats: the definition keeps each as written, orjson writes its shortest form.
        for text in _floats(body):
            if orjson.dumps(float(text)) != text:
                return None
    # A name twice in an object: orjson keeps the last member, the definition both. Every
    # member has its ':', and a ':' in a string stays one (unless written \u003a); so with
    # a name twice, orjson's form holds fewer.
    if b"\\u003a" in body or b"\\u003A" in body:
        return None
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _nested_deeper(value):
        return None  # read as its bytes (and orjson writes less deep than it reads)
    try:
        form = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # nothing here raises, whatever the body
        return None
    if form.count(b":") != body.count(b":"):
        return None
    return _ascii(form)


#: What `_floats` searches at once (the regular expression holds the GIL while it runs).
_SEARCHED_AT_ONCE = 64 * 1024
_NOT_IN_A_NUMBER = re.compile(rb"[^-+.eE0-9]")


def _floats(body: bytes) -> set[bytes]:
    """The float-like texts in `body`, searched a slice at a time, each cut at a byte no
    number holds (so no number is cut in two)."""
    found: set[bytes] = set()
    start = 0
    while start < len(body):
        end = start + _SEARCHED_AT_ONCE
        if end < len(body):
            cut = _NOT_IN_A_NUMBER.search(body, end)
            end = len(body) if cut is None else cut.start()
        found.update(_FLOAT.findall(body, start, end))
        start = end
    return found


def _nested_deeper(value: Any) -> bool:
    """Whether the parsed value nests containers deeper than `MAX_JSON_DEPTH` (the types of
    a container's items are looked at in C, and only its containers in Python)."""
    if type(value) is not dict and type(value) is not list:
        return False
    level = [value]
    for _ in range(MAX_JSON_DEPTH):
        inner = []
        for container in level:
            items = container.values() if type(container) is dict else container
            kinds = set(map(type, items))
            if dict in kinds or list in kinds:
                inner += [item for item in items if type(item) is dict or type(item) is list]
        if not inner:
            return False
        level = inner
    return True


def _ascii(form: bytes) -> bytes:
    """orjson's output with its strings escaped as the definition escapes them
    (`json.encoder.encode_basestring_ascii`): DEL and everything past ASCII as `\\uNNNN`, a
    surrogate pair past the BMP; both escape the rest alike (`\\"`, `\\\\`, `\\n`,
    `\\u001f`...).

    The whole output goes through that escaping at once, which also doubles each of its
    backslashes and puts one before each of its quotes; undoing those two, in that order,
    leaves the new `\\uNNNN` escapes, each a single backslash before a `u`."""
    if form.isascii() and b"\x7f" not in form:
        return form
    escaped = _string(form.decode("utf-8"))[1:-1]
    return escaped.replace("\\\\", "\\").replace('\\"', '"').encode("ascii")


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
