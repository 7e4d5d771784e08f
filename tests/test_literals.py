"""Values written into the atomic mode's simple queries (sql/literals.py): every value comes
back from the server as it went in, whatever the settings that change how a literal is read,
and nothing in a value can end its literal."""

from __future__ import annotations

import hashlib

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idempotency_asgi._postgres.sql.literals import literal, text

#: Every setting that changes how PostgreSQL reads a string or a bytea literal.
SETTINGS = [
    {"standard_conforming_strings": "on", "backslash_quote": "safe_encoding"},
    {"standard_conforming_strings": "off", "backslash_quote": "on", "escape_string_warning": "on"},
    {"standard_conforming_strings": "off", "backslash_quote": "off", "bytea_output": "escape"},
]

#: Text a PostgreSQL text value can hold: any character but NUL, no lone surrogate.
TEXT = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)))

#: Text with what could end or escape a literal, often.
NASTY = st.lists(st.sampled_from(["'", "\\", "''", "\\'", "E'", "$$", ";", "\n", "x", "é"])).map(
    "".join
)


@pytest.fixture(scope="module", params=range(len(SETTINGS)), ids=lambda i: f"settings{i}")
async def conn(request: pytest.FixtureRequest, schema: str):
    connection = await asyncpg.connect(schema, server_settings=SETTINGS[request.param])
    yield connection
    await connection.close()


async def round_trip(conn, value: object) -> object:
    """The value read back from a query whose only value is written by `literal`, with a
    marker after it: a literal that ended early would change the row or fail the query."""
    row = await conn.fetchrow(f"SELECT {literal(value)} AS value, 'marker' AS after")
    assert len(row) == 2 and row["after"] == "marker"
    return row["value"]


def closed_properly(written: str) -> bool:
    """Whether a text literal is ASCII and its content only characters and escapes: every
    quote doubled, every backslash doubled or a character's `\\u`/`\\U` escape (what makes
    the closing quote the only one that ends it)."""
    assert written.startswith("E'") and written.endswith("'") and written.isascii()
    content, i = written[2:-1], 0
    while i < len(content):
        if content[i] == "\\" and content[i + 1 : i + 2] in ("u", "U"):
            digits = 4 if content[i + 1] == "u" else 8
            escape = content[i + 2 : i + 2 + digits]
            if len(escape) != digits or not all(c in "0123456789abcdef" for c in escape):
                return False
            i += 2 + digits
        elif content[i] in ("'", "\\"):
            if content[i + 1 : i + 2] != content[i]:
                return False
            i += 2
        else:
            i += 1
    return True


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=st.one_of(TEXT, NASTY))
async def test_text_comes_back_as_it_went(conn, value: str) -> None:
    assert closed_properly(text(value))
    assert await round_trip(conn, value) == value


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=st.binary(max_size=4096))
async def test_bytes_come_back_as_they_went(conn, value: bytes) -> None:
    written = literal(value)
    assert written == "E'\\\\x" + value.hex() + "'::bytea"
    assert await round_trip(conn, value) == value


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=st.integers(min_value=-(2**63), max_value=2**63 - 1))
async def test_integers_come_back_as_they_went(conn, value: int) -> None:
    assert await round_trip(conn, value) == value


async def test_every_byte_and_the_largest_values(conn) -> None:
    every = bytes(range(256)) * 16
    assert await round_trip(conn, every) == every
    body = bytes(range(256)) * 4096  # a 1 MiB stored answer
    assert await round_trip(conn, body) == body
    key = "".join(chr(c) for c in range(33, 127)) * 3  # visible ASCII, past 255
    assert await round_trip(conn, key[:255]) == key[:255]
    tenant = ("\\'é" * 400)[:1024]
    assert await round_trip(conn, tenant) == tenant
    assert await round_trip(conn, None) is None
    assert await round_trip(conn, True) is True


@pytest.mark.parametrize("encoding", ["SJIS", "BIG5", "GBK"])
async def test_a_client_encoding_a_handler_sets_changes_nothing(schema, encoding) -> None:
    # Encodings whose characters may end in the byte of a backslash (0x5c): a raw "ā\\'"
    # written into the query under SJIS with backslash_quote on would end its literal. The
    # literal is ASCII, so what the server reads is what was meant; its md5 comes back in hex.
    values = ["ā\\'; SELECT 1; --", "表\\'", "\\'" + "".join(map(chr, range(0x80, 0x800)))]
    conn = await asyncpg.connect(schema)
    try:
        await conn.execute(
            f"SET client_encoding = '{encoding}'; SET backslash_quote = on;"
            " SET standard_conforming_strings = off"
        )
        for value in values:
            row = await conn.fetchrow(
                f"SELECT md5(convert_to({literal(value)}, 'UTF8')) AS digest, 'marker' AS after"
            )
            assert len(row) == 2 and row["after"] == "marker"
            assert row["digest"] == hashlib.md5(value.encode()).hexdigest()
    finally:
        await conn.close()


def test_what_no_literal_can_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="NUL"):
        literal("a\x00b")
    with pytest.raises(UnicodeEncodeError):
        literal("lone \ud800 surrogate")
    with pytest.raises(ValueError, match="finite"):
        literal(float("nan"))
    with pytest.raises(TypeError):
        literal(object())
