"""The fingerprint rule against the parsers applications really use: whenever Starlette's
`request.form()` (python-multipart underneath) reads two bodies differently, or reads one and
refuses the other, their fingerprints differ; and a client that rebuilds a well-formed
multipart body under a new boundary still sends "the same request".

In process and without a database: the property is about the digest and the parser, and
Hypothesis can try thousands of variants a second here. The variants are the ones parsers
disagree on: a preamble, transport padding, an epilogue, a repeated or escaped or starred
boundary parameter, one hidden in another parameter's quoted value, bare LF line ends, header
spelling, and every change of content.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from idempotency_asgi._asgi.fingerprint import fingerprint
from tests.fuzz_forms import Multipart, boundaries, multiparts

pytest.importorskip("python_multipart")

# A refused multipart body leaves the parser's spooled files for the collector to close.
pytestmark = pytest.mark.filterwarnings(
    "ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning"
)

_SETTINGS = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def digest(content_type: bytes, body: bytes) -> bytes:
    return fingerprint(
        method="POST",
        raw_path=b"/upload",
        query_string=b"",
        headers=[(b"content-type", content_type)],
        fingerprint_headers=(),
        body=body,
    )


def read_form(content_type: bytes, body: bytes) -> Any:
    """What a Starlette handler gets from `await request.form()`: every field in order, with
    each file's name, type, headers and bytes; or the kind of error it gets instead."""

    async def read() -> Any:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "headers": [(b"content-type", content_type)]}
        try:
            form = await Request(scope, receive).form()
        except Exception as exc:  # what the handler would see: an error, of some kind
            return ("refused", type(exc).__name__)
        fields = []
        for name, value in form.multi_items():
            if isinstance(value, str):
                fields.append((name, value))
            else:
                content = await value.read()
                fields.append(
                    (name, value.filename, value.content_type, sorted(value.headers.raw), content)
                )
        await form.close()
        return ("read", fields)

    return asyncio.run(read())


def _variants(body: Multipart) -> list[tuple[bytes, bytes]]:
    """The body as sent, and the spellings and damages parsers are known to read apart."""
    boundary = body.boundary.encode()
    rendered, ctype = body.render(), body.content_type
    first_delimiter = b"--" + boundary
    return [
        (ctype, rendered),
        (ctype, b"preamble\r\n" + rendered),
        (ctype, rendered + b"epilogue"),
        (ctype, rendered.replace(first_delimiter + b"\r\n", first_delimiter + b"  \r\n", 1)),
        (ctype, rendered.replace(b"\r\n", b"\n")),
        (ctype, rendered.replace(b"Content-Disposition", b"content-disposition")),
        (ctype, rendered.replace(b": form-data", b":form-data")),
        (ctype + b"; boundary=other", rendered),
        (b"multipart/form-data; boundary=other; boundary=" + boundary, rendered),
        (b'multipart/form-data; a="x; boundary=other"; boundary=' + boundary, rendered),
        (b"multipart/form-data; boundary*=utf-8''" + boundary, rendered),
        (b'multipart/form-data; boundary="' + boundary.replace(b"-", b"\\-") + b'"', rendered),
        (ctype + b"; charset=latin-1", rendered),
        (ctype, rendered[:-4]),  # cut short
    ]


@_SETTINGS
@given(multiparts, st.data())
def test_multipart_bodies_a_parser_reads_apart_never_share_a_fingerprint(body, data):
    variants = _variants(body)
    other = data.draw(multiparts)
    variants += _variants(other)
    seen: dict[bytes, tuple[Any, tuple[bytes, bytes]]] = {}
    for content_type, raw in variants:
        key = digest(content_type, raw)
        read = read_form(content_type, raw)
        if key in seen:
            first_read, first = seen[key]
            assert read == first_read, (first, (content_type, raw))
        else:
            seen[key] = (read, (content_type, raw))


@_SETTINGS
@given(multiparts, boundaries)
def test_a_multipart_body_rebuilt_under_a_new_boundary_is_the_same_request(body, boundary):
    rebuilt = Multipart(body.parts, boundary)
    if not rebuilt.well_formed:
        return
    assert read_form(body.content_type, body.render()) == read_form(
        rebuilt.content_type, rebuilt.render()
    )
    assert digest(body.content_type, body.render()) == digest(
        rebuilt.content_type, rebuilt.render()
    )


_FORM_BYTES = st.sampled_from([b"a", b"A", b"b", b"=", b"&", b";", b"+", b"%20", b"%41", b"1"])


@_SETTINGS
@given(st.lists(st.lists(_FORM_BYTES, max_size=6).map(b"".join), min_size=2, max_size=6))
def test_form_bodies_a_parser_reads_apart_never_share_a_fingerprint(bodies):
    form = b"application/x-www-form-urlencoded"
    seen: dict[bytes, tuple[Any, bytes]] = {}
    for raw in bodies:
        key = digest(form, raw)
        read = read_form(form, raw)  # every pair, in order: what multi_items() gives
        if key in seen:
            assert read == seen[key][0], (seen[key][1], raw)
        else:
            seen[key] = (read, raw)


def test_unclosed_json_strings_cost_linear_time():
    # 129 levels (past the depth bound, so brackets are counted outside strings) and a string
    # that never closes, full of escaped quotes: the scan used to restart at each of them and
    # read to the end (an hour for a 1 MiB body). Bounded far above the linear cost (0.1 s).
    hostile = b"[" * 129 + b'"' + b'\\"' * 500_000
    started = time.perf_counter()
    digest(b"application/json", hostile)
    digest(b"application/json", hostile + b"\\")
    assert time.perf_counter() - started < 10
