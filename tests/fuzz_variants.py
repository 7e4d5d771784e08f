"""Pairs of requests under one key, built so that the contract's fingerprint rule
(docs/contract.md, "The fingerprint") decides for certain whether they are the same request (the
second must replay the first's answer) or different ones (the second must get 422 key-reused
and must not run).

Pairs come in families, one test each, so that each rule gets its own shrunk example:

    json            same: a strict document in another layout (whitespace, the order of
                    distinct keys); different: a number's exact value, an integer written as
                    a float, a repeated key that changes a value
    form            same: pairs of different names interleaved anew; different: two
                    different values of a repeated name swapped, a value changed
    multipart       same: rebuilt under a new boundary; different: a part's content, name,
                    filename or position
    raw             different: one byte of a body sent as raw bytes
    content-type    different: the same body under a content type of another class
    request-line    different: the method, the path, the query
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from tests.fuzz_app import ECHO_PATHS
from tests.fuzz_forms import (
    Form,
    Multipart,
    forms,
    interleavings,
    part_changes,
    reboundaried,
    repeated_swaps,
    value_changes,
)
from tests.fuzz_json import (
    SHALLOW,
    JsonDoc,
    digit_changes,
    duplicate_keys,
    float_spellings,
    put,
    relaid,
)
from tests.fuzz_requests import (
    CLASS_EXAMPLES,
    COVERED,
    FORM_TYPES,
    Raw,
    Request,
    content_class,
    requests,
    typed_bodies,
)


@dataclass(frozen=True)
class Pair:
    base: Request
    variant: Request
    same: bool  # True: the variant must replay the base's answer; False: 422, not run
    change: str


def _json(base: Request) -> list[tuple[str, Request]]:
    body, found = base.body, []
    if isinstance(body, JsonDoc):
        for label, changes in (
            ("json-number-digit", digit_changes(body)),
            ("json-int-as-float", float_spellings(body)),
            ("json-duplicate-key", duplicate_keys(body)),
        ):
            found += [
                (label, replace(base, body=replace(body, tree=put(body.tree, path, new))))
                for path, new in changes
            ]
    return found


def _form(base: Request) -> list[tuple[str, Request]]:
    body = base.body
    assert isinstance(body, Form)
    return [
        *(("form-repeated-swap", replace(base, body=new)) for new in repeated_swaps(body)),
        *(("form-value", replace(base, body=new)) for new in value_changes(body)),
        *(("form-order", replace(base, body=new)) for new in interleavings(body)),
    ]


def _multipart(base: Request) -> list[tuple[str, Request]]:
    assert isinstance(base.body, Multipart)
    return [(label, replace(base, body=new)) for label, new in part_changes(base.body)]


def _raw(base: Request) -> list[tuple[str, Request]]:
    data = base.content
    return [
        ("raw-byte", replace(base, body=Raw(data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :])))
        for i in range(len(data))
    ]


def _content_type(base: Request) -> list[tuple[str, Request]]:
    return [
        (f"content-type-{kind}", replace(base, content_type=example))
        for kind, example in CLASS_EXAMPLES.items()
        if kind != base.kind
    ]


def _request_line(base: Request) -> list[tuple[str, Request]]:
    other_method = COVERED[1 - COVERED.index(base.method)]
    other_path = ECHO_PATHS[(ECHO_PATHS.index(base.path) + 1) % len(ECHO_PATHS)]
    return [
        ("method", replace(base, method=other_method)),
        ("path", replace(base, path=other_path)),
        ("query", replace(base, query=base.query + "&v" if base.query else "v")),
    ]


def _relaid(base: Request) -> st.SearchStrategy[tuple[str, Request]] | None:
    body = base.body
    if not (isinstance(body, JsonDoc) and body.strict):
        return None
    return relaid(body).map(lambda new: ("json-layout", replace(base, body=new)))


def _reboundaried(base: Request) -> st.SearchStrategy[tuple[str, Request]]:
    assert isinstance(base.body, Multipart)
    return reboundaried(base.body).map(
        lambda new: ("multipart-boundary", replace(base, body=new, content_type=new.content_type))
    )


Differences = Callable[[Request], list[tuple[str, Request]]]
Equivalent = Callable[[Request], "st.SearchStrategy[tuple[str, Request]] | None"]

_forms_with_pairs = st.tuples(forms.filter(lambda form: form.pairs), st.sampled_from(FORM_TYPES))
# Documents no deeper than SHALLOW: the rule decides for certain only what parsers agree on.
_TYPED = typed_bodies(SHALLOW)
_any = st.one_of(*_TYPED.values())
_raw_with_bytes = _TYPED["raw"].filter(lambda typed: typed[0].render())
_classed = _any.filter(lambda typed: content_class(typed[1]) != "unclear")

#: family: (base bodies, the different variants, the same variants)
FAMILIES: dict[str, tuple[st.SearchStrategy[Any], Differences, Equivalent | None]] = {
    "json": (_TYPED["json"], _json, _relaid),
    "form": (_forms_with_pairs, _form, None),
    "multipart": (_TYPED["multipart"], _multipart, _reboundaried),
    "raw": (_raw_with_bytes, _raw, None),
    "content-type": (_classed, _content_type, None),
    "request-line": (_any, _request_line, None),
}


@st.composite
def pairs(draw: st.DrawFn, family: str) -> Pair:
    bodies, differences, equivalent = FAMILIES[family]
    base = draw(requests(methods=COVERED, bodies=bodies))
    same = equivalent(base) if equivalent is not None else None
    found = differences(base)
    assume(same is not None or found)
    if same is not None and (not found or draw(st.booleans())):
        change, variant = draw(same)
        return Pair(base, variant, True, change)
    # A kind of change first, then one change of that kind: every kind gets its share.
    kind = draw(st.sampled_from(list(dict.fromkeys(kind for kind, _ in found))))
    variant = draw(st.sampled_from([new for k, new in found if k == kind]))
    return Pair(base, variant, False, kind)
