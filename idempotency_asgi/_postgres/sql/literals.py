"""Values written into a simple query: the one place the store builds SQL from values.

The atomic mode's two round trips (see `sql/onecommit.py`) are simple queries of several
statements, and a simple query takes no parameters: its values are written into it. Each is
quoted so that nothing in it can end its literal, whatever the server's settings:

- text goes in an escape string, `E'...'`, whose backslashes are escapes whatever
  `standard_conforming_strings` says: each backslash is doubled and each quote doubled, so
  the only quote that ends the literal is the one written after it. Every character past
  ASCII is written as its `\\uXXXX` (or `\\UXXXXXXXX`) escape, so the statement is ASCII
  whatever it holds: a `client_encoding` a handler set on the request's connection (SJIS,
  BIG5, GBK, whose characters may end in the byte of a backslash or a quote) reads it as
  written. A NUL (which no text column can hold) or a lone surrogate (which has no UTF-8) is
  refused, never dropped;
- bytes go in as hex digits (`E'\\x...'::bytea`: the escape string holds `\\x` and then only
  the digits 0-9 and a-f), so neither their content nor `bytea_output` matters;
- integers are written by Python's own int formatting (digits and a sign), floats refused
  unless finite, and None is NULL.

tests/test_literals.py round-trips arbitrary values through the server with every setting
that changes how a literal is read.
"""

from __future__ import annotations

import math


def literal(value: object) -> str:
    """`value` as a SQL literal for a simple query (see the module)."""
    # The exact types a request's values have, first (a record's thirteen values are
    # written per request); anything else, a subclass included, by the checks below.
    if type(value) is str:
        return text(value)
    if type(value) is bytes:
        return "E'\\\\x" + value.hex() + "'::bytea"
    if type(value) is int:
        return str(value)
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"not a finite number: {value!r}")
        return repr(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "E'\\\\x" + bytes(value).hex() + "'::bytea"
    if isinstance(value, str):
        return text(value)
    raise TypeError(f"no literal for a {type(value).__name__}")


def text(value: str) -> str:
    """A text literal (see the module)."""
    if "\x00" in value:
        raise ValueError("text cannot hold a NUL")
    if value.isascii():  # as nearly every key, tenant and path is: no surrogate, no \u
        return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"
    value.encode("utf-8")  # a lone surrogate raises here, not half way into the server
    quoted = value.replace("\\", "\\\\").replace("'", "''")
    return "E'" + "".join(map(_ascii, quoted)) + "'"


def _ascii(char: str) -> str:
    code = ord(char)
    if code < 0x80:
        return char
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
