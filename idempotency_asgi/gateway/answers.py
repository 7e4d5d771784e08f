"""The head of an upstream's answer: read, checked, and how its body is framed.

An answer is passed on only if both of uvicorn's writers (h11's and httptools') can write it as
it came, and recorded only if where its body ends is beyond doubt. So, besides the status line
and the fields themselves, the head says how the body is framed (RFC 9112, section 6.3):

- `none`: no body at all (a HEAD request, 1xx, 204, 304);
- `length`: `Content-Length` bytes;
- `chunked`: chunks, up to the last one;
- `close`: no length and no transfer coding, so the body ends where the connection does, and
  a crash half way through looks the same (never replayed).

What cannot be passed on as it came makes the answer `invalid` (the reason, for the 502 its
client gets), with the status still known, for a keyed request that ran:

- a field name that is not a token, a value holding a control character (uvicorn's httptools
  writer raises on one, after the answer was recorded), a line that is not a field, a field
  folded over two lines;
- a status outside 200..599 (RFC 9110, section 15: 600 and over are not HTTP), a second status
  after too many interim answers;
- both `Content-Length` and `Transfer-Encoding` (a response split in two, maybe: RFC 9112,
  section 6.3), a transfer coding other than chunked, a `Transfer-Encoding` in an HTTP/1.0
  answer, a `Content-Length` that is not one number (`5, 5`, or the field twice alike, is
  one number: it is passed on, and recorded, as one `content-length: 5`).

A 204 or 304 that declares a non-zero `Content-Length` declares a body it cannot have:
`phantom_length`. A head that is not HTTP at all (no status line) raises `MalformedAnswer`.
"""

from __future__ import annotations

import re

from .upstream import MalformedAnswer

Headers = list[tuple[bytes, bytes]]

#: A status line: HTTP/1.x, three digits, then the reason (anything, even nothing).
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([^\r\n]*))?")

#: RFC 9110's token: what a field name is made of.
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")

#: Bytes a field value may not hold, whoever writes it (HTAB may; CR, LF and NUL never; the
#: other controls and DEL are refused by uvicorn's httptools writer).
CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")

#: The same, over a whole head: line ends aside (a CR only before its LF), and HTAB.
_UNSAFE = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)")

_DIGITS = re.compile(rb"[0-9]{1,18}")

#: Field names seen to be tokens, so that the usual ones are not matched again and again.
_TOKENS_SEEN: set[bytes] = set()
_MAX_TOKENS_SEEN = 4096

#: Statuses whose answers never have a body, whatever their fields say (RFC 9110 6.4.1).
_BODILESS = frozenset({204, 304})


class Head:
    __slots__ = (
        "framing",
        "headers",
        "http10",
        "invalid",
        "keep_alive",
        "length",
        "phantom_length",
        "reason",
        "status",
    )

    def __init__(self, status: int, reason: bytes, headers: Headers, *, http10: bool) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.http10 = http10
        self.framing = "close"
        self.length: int | None = None
        self.keep_alive = not http10
        self.invalid: str | None = None
        self.phantom_length = False

    @property
    def interim(self) -> bool:
        """A 1xx other than 101: an interim answer, the final one comes after it."""
        return 100 <= self.status < 200 and self.status != 101


def parse_head(data: bytes, *, head_request: bool) -> Head:
    """The head in `data` (up to and without its empty line), checked and its body's framing
    decided. Raises MalformedAnswer when the first line is not an HTTP/1.x status line."""
    lines = data.split(b"\n")
    first = lines[0].removesuffix(b"\r")
    matched = _STATUS_LINE.fullmatch(first)
    if matched is None:
        raise MalformedAnswer(f"not an HTTP/1.x status line: {first[:80]!r}")
    head = Head(
        int(matched.group(2)),
        matched.group(3) or b"",
        [],
        http10=matched.group(1) == b"0",
    )
    lengths: set[bytes] = set()
    length_fields = 0
    codings: list[bytes] = []
    # Then no value holds a control character. The head comes as the connection read it, up
    # to its empty line: with CRLF line ends, its last line's CR is still on it, and is no
    # bare CR (one before it would be: the search then ends on it).
    end = len(data) - 1 if data.endswith(b"\r") else len(data)
    clean = _UNSAFE.search(data, 0, end) is None
    for raw in lines[1:]:
        line = raw.removesuffix(b"\r")
        name, colon, value = line.partition(b":")
        if not colon or not is_token(name):
            # A continuation line (obs-fold) starts with a space; anything else is no field.
            head.invalid = head.invalid or (
                "a field folded over two lines"
                if line[:1] in (b" ", b"\t")
                else f"a line that is not a field: {line[:40]!r}"
            )
            continue
        value = value.strip(b" \t")
        if not clean and CONTROL.search(value) is not None:
            head.invalid = head.invalid or f"a control character in the value of {name!r}"
        head.headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length":
            lengths.update(part.strip(b" \t") for part in value.split(b","))
            length_fields += 1 if b"," not in value else 2
        elif lowered == b"transfer-encoding":
            codings += [c.strip(b" \t").lower() for c in value.split(b",") if c.strip(b" \t")]
        elif lowered == b"connection":
            tokens = {token.strip(b" \t").lower() for token in value.split(b",")}
            if b"close" in tokens:
                head.keep_alive = False
    if not 200 <= head.status <= 599 and not head.interim:
        head.invalid = head.invalid or f"the status {head.status} (HTTP's are 200 to 599)"
    _frame(head, lengths, codings, head_request=head_request)
    if head.invalid is not None:
        head.keep_alive = False
    elif length_fields > 1:
        _one_length(head)
    return head


def _one_length(head: Head) -> None:
    """A length said more than once, always the same (`5, 5`, or the field twice: RFC 9110,
    section 8.6, lets a recipient take it as one): said once, as `content-length: 5`, where
    it first stood. As it came, uvicorn's httptools writer raises on `5, 5` (after the
    answer was recorded) and writes the field twice."""
    (length,) = {
        part.strip(b" \t")
        for name, value in head.headers
        if name.lower() == b"content-length"
        for part in value.split(b",")
    }
    headers: Headers = []
    said = False
    for name, value in head.headers:
        if name.lower() != b"content-length":
            headers.append((name, value))
        elif not said:
            headers.append((b"content-length", length))
            said = True
    head.headers = headers


def is_token(name: bytes) -> bool:
    """Whether `name` is a token (a method, a field name); the names seen are remembered, up
    to a bound, so the usual ones cost a set lookup."""
    if name in _TOKENS_SEEN:
        return True
    if _TOKEN.fullmatch(name) is None:
        return False
    if len(_TOKENS_SEEN) < _MAX_TOKENS_SEEN:
        _TOKENS_SEEN.add(name)
    return True


def _frame(head: Head, lengths: set[bytes], codings: list[bytes], *, head_request: bool) -> None:
    length: int | None = None
    if lengths:
        if len(lengths) != 1 or _DIGITS.fullmatch(next(iter(lengths))) is None:
            head.invalid = head.invalid or "a Content-Length that is not one number"
        else:
            length = int(next(iter(lengths)))
    if codings:
        if lengths:
            head.invalid = head.invalid or "both Content-Length and Transfer-Encoding"
        elif head.http10:
            head.invalid = head.invalid or "Transfer-Encoding in an HTTP/1.0 answer"
        elif codings != [b"chunked"]:
            head.invalid = head.invalid or f"the transfer coding {b', '.join(codings)!r}"
    if head_request or head.status < 200 or head.status in _BODILESS:
        head.framing = "none"
        head.phantom_length = head.status in _BODILESS and bool(length)
    elif head.invalid is not None:
        # Where its body ends is not known: nothing of it is read, the connection is closed.
        head.framing = "close"
    elif codings:
        head.framing = "chunked"
    elif length is not None:
        head.framing = "length"
        head.length = length
    else:
        head.framing = "close"
        head.keep_alive = False
