"""A chunked body (RFC 9112, section 7.1) decoded in time linear in its size, whatever its
chunks' sizes.

An upstream that writes an export row by row sends chunks of a few dozen bytes: 10 MB in
80-byte chunks is 125,000 of them. The decoder this replaces sliced its buffer for every
line and every chunk (each slice a copy of the rest of a 256 KiB read), and handed each
chunk on as a part of its own: 2.0 s of the gateway's CPU for that answer, against 0.01 s
for the same bytes with a Content-Length, while every other request on the worker waited.
Here:

- each read is decoded in one pass over it, with positions instead of copies, and what it
  held of the body goes on as one part (never held back for the next read: an event
  stream still arrives event by event);
- a read made only of whole chunks in the plain shape (`<hex>\\r\\n<data>\\r\\n`, no
  extensions) is checked all at once: split at its CRLFs, each size line must be hex
  digits and name the length of the piece after it. When every pair agrees, reading it
  chunk by chunk would find the same chunks (each size line ends at the first CRLF after
  the previous chunk's, and its data is exactly the bytes before the next CRLF), so the
  data is those pieces; otherwise (a CRLF inside a chunk's data, an extension, a bare LF)
  the read is decoded chunk by chunk from the first pair that did not agree.
"""

from __future__ import annotations

import re

from .upstream import MalformedAnswer

#: The longest chunk-size line (with its extensions) read.
MAX_LINE = 4096

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_HEX_DIGITS = b"0123456789abcdefABCDEF"

#: Fewer whole chunks than this in a read: decoded one by one (checking them all at once
#: costs more than it saves).
_AT_ONCE = 8

#: Chunks decoded one by one in a feed, at most, before it returns what it has (`paused`):
#: about 4 ms of CPU on a slow machine. Such chunks cost about half a microsecond a byte (a
#: bare LF or an extension on each one-byte chunk): a 256 KiB read of them decoded at once
#: held the event loop 0.12 s.
ONE_BY_ONE = 2048


class ChunkedDecoder:
    """Feed it the bytes read, in order; it returns the body's data in them. `ended` once
    the last chunk (size 0) was read: what follows it (trailers) is the caller's."""

    __slots__ = ("_crlf", "_left", "ended", "paused")

    def __init__(self) -> None:
        self._left = 0  # bytes of the current chunk's data still to come
        self._crlf = False  # the CRLF after a chunk's data is still to come
        self.ended = False
        #: the last feed stopped after `ONE_BY_ONE` chunks: what it left is to feed again now
        self.paused = False

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """The body's data in `data` (as one part), and what of `data` is left undecoded: an
        incomplete line to read again with the next bytes, what follows the last chunk, or,
        when it stopped after `ONE_BY_ONE` chunks decoded one by one (`paused`), the rest, to
        feed again (with no bytes read since: it goes on one by one)."""
        parts: list[bytes] = []
        end = len(data)
        pos = 0
        at_once = end >= 64 * _AT_ONCE and not self.paused
        self.paused = False
        one_by_one = 0
        while pos < end:
            if self._left:
                take = min(self._left, end - pos)
                parts.append(data if take == end else data[pos : pos + take])
                pos += take
                self._left -= take
                if self._left:
                    break
                self._crlf = True
            if self._crlf:
                if data.startswith(b"\r\n", pos):
                    pos += 2
                elif data.startswith(b"\n", pos):
                    pos += 1
                elif pos == end or (pos + 1 == end and data[pos] == 0x0D):
                    break  # it comes (or its LF does) with the next read
                else:
                    raise MalformedAnswer("a chunk longer than its size")
                self._crlf = False
                continue
            if at_once:
                at_once = False  # once per read: a read that does not agree goes one by one
                whole, pos = _whole_chunks(data, pos)
                if whole:
                    parts.append(whole)
                    continue
            if one_by_one == ONE_BY_ONE:
                self.paused = True
                break
            newline = data.find(b"\n", pos)
            if newline < 0:
                if end - pos > MAX_LINE:
                    raise MalformedAnswer("a line of the chunked body past its bound")
                break
            line = data[pos:newline]
            pos = newline + 1
            one_by_one += 1
            size_text = line.removesuffix(b"\r").split(b";", 1)[0].strip(b" \t")
            if _HEX.fullmatch(size_text) is None:
                raise MalformedAnswer(f"a chunk size that is not one: {line[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                self.ended = True
                break
            self._left = size
        rest = data[pos:] if pos else data
        if len(parts) == 1:
            return parts[0], rest
        return b"".join(parts), rest


def _whole_chunks(data: bytes, pos: int) -> tuple[bytes, int]:
    """The data of the whole chunks from `pos` on, checked all at once (see the module's
    docstring), up to the first that is not in the plain shape, the last chunk, or the end of
    `data`; and the position after them. Every step is one pass of C over the pieces: the
    sizes are checked as the few distinct values they nearly always are."""
    pieces = (data[pos:] if pos else data).split(b"\r\n")
    pairs = (len(pieces) - 1) // 2  # each (size line, data) followed by a CRLF
    if pairs < _AT_ONCE:
        return b"", pos
    sizes = pieces[0 : 2 * pairs : 2]
    datas = pieces[1 : 2 * pairs : 2]
    lengths = list(map(len, datas))
    first = sizes[0]
    if sizes.count(first) == pairs:
        # One size throughout (a writer that flushes a buffer of a fixed size): one look.
        size = _plain_size(first)
        if size > 0 and lengths.count(size) == pairs:
            return b"".join(datas), pos + (len(first) + size + 4) * pairs
        values = {first: size}
    else:
        values = {size: _plain_size(size) for size in set(sizes)}
    expected = list(map(values.__getitem__, sizes))
    if expected != lengths:
        # Up to the first pair that does not agree (or whose size line is no plain size:
        # its value is -1), the chunks are what they seem.
        pairs = next(
            i for i, (want, got) in enumerate(zip(expected, lengths, strict=True)) if want != got
        )
    if 0 in values.values():
        # The last chunk: decoded one by one, with what follows it.
        pairs = min(pairs, expected.index(0))
    if not pairs:
        return b"", pos
    if pairs < len(datas):
        datas, lengths, sizes = datas[:pairs], lengths[:pairs], sizes[:pairs]
    consumed = sum(map(len, sizes)) + sum(lengths) + 4 * pairs
    return b"".join(datas), pos + consumed


def _plain_size(size: bytes) -> int:
    """The chunk size a size line says when it is hex digits only (no extension, no space);
    else -1, which no piece's length is."""
    if 0 < len(size) <= 16 and not size.translate(None, _HEX_DIGITS):
        return int(size, 16)
    return -1
