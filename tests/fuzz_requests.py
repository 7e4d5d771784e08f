"""Requests for the fuzz: a method, a path, a raw query, a content type and a body model.

The body is kept as the model it was rendered from (a JSON tree, form pairs, multipart parts,
raw bytes), so a variant can be made by construction. Body and content type usually match;
sometimes any body goes with any content type, as hostile clients send them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from hypothesis import strategies as st

from tests.fuzz_app import ECHO_PATHS
from tests.fuzz_forms import Form, Multipart, boundaries, forms, multiparts
from tests.fuzz_json import DEEP, JsonDoc, documents

COVERED = ("POST", "PATCH")  # the middleware's default methods
PASSED = ("GET", "PUT", "DELETE")  # not covered: they go through untouched

#: What the application may answer: 2xx and 4xx, all of them recorded and replayed.
STATUSES = (201, 200, 202, 400, 404, 409, 422)


@dataclass(frozen=True)
class Raw:
    data: bytes

    def render(self) -> bytes:
        return self.data


Body = Union[JsonDoc, Form, Multipart, Raw]  # noqa: UP007 (a runtime alias on Python 3.10)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    content_type: bytes | None
    body: Body
    status: int = 201

    @property
    def content(self) -> bytes:
        return self.body.render()

    @property
    def url(self) -> str:
        return self.path + ("?" + self.query if self.query else "")

    @property
    def kind(self) -> str:
        return content_class(self.content_type)

    def __repr__(self) -> str:
        return (
            f"<{self.method} {self.url} content-type={self.content_type!r} "
            f"body={show(self.content)} ({type(self.body).__name__}) status={self.status}>"
        )


def content_class(content_type: bytes | None) -> str:
    """How the contract's fingerprint rule (docs/contract.md) reads a body of this content type."""
    if content_type is None:
        return "raw"
    media_type = content_type.split(b";", 1)[0].strip().lower()
    if media_type == b"application/json":
        return "json"
    if media_type.endswith(b"+json"):
        # application/*+json is JSON; another top-level type with +json is left undecided.
        return "json" if media_type.startswith(b"application/") else "unclear"
    if media_type == b"application/x-www-form-urlencoded":
        return "form"
    if media_type == b"multipart/form-data":
        return "multipart"
    return "raw"


def show(data: bytes, limit: int = 400) -> str:
    """Bytes as a Python expression, long runs folded: b'[' * 256 + b'1' + b']' * 256."""
    pieces, start = [], 0
    for run in re.finditer(rb"(.)\1{7,}", data, re.DOTALL):
        if run.start() > start:
            pieces.append(repr(data[start : run.start()]))
        pieces.append(f"{data[run.start() : run.start() + 1]!r} * {len(run.group())}")
        start = run.end()
    if start < len(data) or not pieces:
        pieces.append(repr(data[start:]))
    text = " + ".join(pieces)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(data)} bytes)"


# -- strategies --------------------------------------------------------------------------

JSON_TYPES = (
    b"application/json",
    b"application/json; charset=utf-8",
    b"application/vnd.api+json",
    b"Application/JSON",
    b"application/merge-patch+json",
)
FORM_TYPES = (
    b"application/x-www-form-urlencoded",
    b"application/x-www-form-urlencoded; charset=UTF-8",
)
RAW_TYPES = (None, b"text/plain", b"application/octet-stream", b"text/plain; charset=utf-8")

#: One content type of each class, for a variant that only changes the class.
CLASS_EXAMPLES = {
    "json": b"application/json",
    "form": FORM_TYPES[0],
    "multipart": b"multipart/form-data; boundary=fuzz",
    "raw": b"text/plain",
}

_HEADER_TEXT = "".join(map(chr, [*range(0x21, 0x7F), *range(0x80, 0x100)])) + " \t"

garbage_types = st.text(_HEADER_TEXT, max_size=24).map(
    lambda text: text.strip(" \t").encode("latin-1")
)
content_types = st.one_of(
    st.sampled_from(JSON_TYPES),
    st.sampled_from(FORM_TYPES),
    st.sampled_from(RAW_TYPES),
    st.just(b"multipart/form-data"),
    boundaries.map(lambda b: b"multipart/form-data; boundary=" + b.strip().encode()),
    garbage_types,
)

raw_bodies = st.binary(max_size=300).map(Raw)
queries = st.text("abcxyz019=&%+._-~", max_size=12)
raw_types = st.one_of(st.sampled_from(RAW_TYPES), garbage_types).filter(
    lambda content_type: content_class(content_type) == "raw"
)

Typed = st.SearchStrategy[tuple[Body, Union[bytes, None]]]  # noqa: UP007 (see Body)


def typed_bodies(max_depth: int) -> dict[str, Typed]:
    """Bodies with the content type each is sent with, by how the fingerprint rule reads
    them; and "any": any body under any label, as hostile clients send them."""
    any_body = st.one_of(raw_bodies, documents(max_depth), forms, multiparts)
    return {
        "json": st.tuples(documents(max_depth), st.sampled_from(JSON_TYPES)),
        "form": st.tuples(forms, st.sampled_from(FORM_TYPES)),
        "multipart": multiparts.map(lambda body: (body, body.content_type)),
        "raw": st.tuples(any_body, raw_types),
        "any": st.tuples(any_body, content_types),
    }


any_typed_body = st.one_of(*typed_bodies(DEEP).values())


@st.composite
def requests(
    draw: st.DrawFn,
    methods: tuple[str, ...] = COVERED + PASSED,
    statuses: tuple[int, ...] = STATUSES,
    bodies: Typed = any_typed_body,
) -> Request:
    body, content_type = draw(bodies)
    return Request(
        method=draw(st.sampled_from(methods)),
        path=draw(st.sampled_from(ECHO_PATHS)),
        query=draw(queries),
        content_type=content_type,
        body=body,
        status=draw(st.sampled_from(statuses)),
    )
