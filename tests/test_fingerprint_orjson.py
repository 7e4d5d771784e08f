"""JSON canonicalised by orjson (_asgi/canonical.py's fast way) gives exactly the bytes the
definition gives, so no fingerprint changes across the upgrade: a retry sent before it and
one sent after still match. Checked three ways: a corpus whose canonical forms were computed
by the code before the change (tests/data/canonical_json_corpus.json: the digest of each
form, None where the body is read as bytes), the fuzz's JSON documents in every layout, and
the bodies orjson must not be trusted with (floats not in their shortest form, integers past
64 bits, -0, a name twice, nesting past the limit, escaped colons)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idempotency_asgi._asgi import canonical as _canonical
from idempotency_asgi._asgi.canonical import MAX_JSON_DEPTH, canonical_json
from tests.fuzz_json import documents, relaid

CORPUS = json.loads((Path(__file__).parent / "data" / "canonical_json_corpus.json").read_text())


def definition(body: bytes) -> bytes | None:
    """The canonical form by the definition's own writer alone."""
    return None if _canonical._deeper_than(body, MAX_JSON_DEPTH) else _canonical._defined(body)


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case["body"][:30])
def test_the_canonical_form_is_what_it_was_before(case):
    body = case["body"].encode("latin-1")
    form = canonical_json(body)
    digest = None if form is None else hashlib.sha256(form).hexdigest()
    assert digest == case["canonical"]


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case["body"][:30])
def test_orjson_is_used_only_where_it_agrees(case):
    body = case["body"].encode("latin-1")
    fast = _canonical._sorted_by_orjson(body)
    if fast is not None:
        assert fast == definition(body)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_document_in_any_layout_gets_the_definitions_form(data):
    doc = data.draw(documents(max_depth=4))
    variants = [doc, data.draw(relaid(doc))] if doc.strict else [doc]
    for variant in variants:
        body = variant.render()
        assert canonical_json(body) == definition(body)


NOT_FOR_ORJSON = [
    b"[0.10000000000000001]",
    b"[1.50]",
    b"[1E2]",
    b"[1e400]",
    b"[18446744073709551616]",
    b"[-9223372036854775809]",
    b"[-0]",
    b'{"a":1,"a":2}',
    b'{"\\u0061":1,"a":2}',
    b'{"a":1,"\\u003a":2,"a":3}',
    b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
    # Deeper than orjson writes (it reads up to 1,024 levels, writes up to 255): it raised.
    b"[" * 300 + b"]" * 300,
    b"[" * 2000 + b"]" * 2000,
    b'{"x":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
]


@pytest.mark.parametrize("body", NOT_FOR_ORJSON, ids=lambda body: body[:20].decode())
def test_what_orjson_would_write_otherwise_takes_the_definitions_writer(body):
    assert _canonical._sorted_by_orjson(body) is None
    assert canonical_json(body) == definition(body)


def test_nesting_at_the_limit_is_json_and_past_it_bytes():
    at = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    past = b'{"k":' * (MAX_JSON_DEPTH + 1) + b"[]" + b"}" * (MAX_JSON_DEPTH + 1)
    assert canonical_json(at) == at
    assert canonical_json(past) is None
    wide = b"[" + b",".join([b"[[1]]"] * 200) + b"]"  # many brackets, shallow
    assert canonical_json(wide) == wide


@pytest.mark.parametrize(
    "text",
    ["naïve café", "東京 \U0001f600", "\x7f\x00\x1f", 'quote " backslash \\ slash /', "\\ é"],
)
def test_strings_are_escaped_as_the_definition_escapes_them(text):
    body = json.dumps({"é": text, "a": [text]}, ensure_ascii=False).encode()
    assert canonical_json(body) == definition(body)
    assert _canonical._sorted_by_orjson(body) == definition(body)
