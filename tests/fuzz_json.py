"""JSON bodies for the fuzz, kept as a syntax tree so a variant can be built by construction.

A document is rendered from the tree with the bytes sent between tokens, so the same tree in
another layout is the same JSON. Number literals are kept as sent; strings keep their escapes
(and may hold lone surrogate escapes or invalid UTF-8); objects may repeat a key; a `Nest`
wraps its child in thousands of arrays or objects without making the tree itself deep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Union

from hypothesis import strategies as st

BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Num:
    literal: str


@dataclass(frozen=True)
class Str:
    raw: bytes  # the literal as sent, quotes included

    @property
    def strict(self) -> bool:
        """Valid UTF-8 without lone surrogates: RFC 8259 says what this string means."""
        try:
            json.loads(self.raw.decode("utf-8")).encode("utf-8")
        except (UnicodeError, ValueError):
            return False
        return True


@dataclass(frozen=True)
class Lit:
    word: str


@dataclass(frozen=True)
class Arr:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Obj:
    members: tuple[tuple[Str, Node], ...]


@dataclass(frozen=True)
class Nest:
    depth: int
    child: Node
    key: Str | None  # None: depth times `[`; else depth times `{"key":`


Node = Union[Num, Str, Lit, Arr, Obj, Nest]  # noqa: UP007 (a runtime alias on Python 3.10)
Path = tuple[int, ...]


def render(node: Node, ws: bytes) -> bytes:
    sep = ws + b"," + ws
    if isinstance(node, Num):
        return node.literal.encode("ascii")
    if isinstance(node, Str):
        return node.raw
    if isinstance(node, Lit):
        return node.word.encode("ascii")
    if isinstance(node, Arr):
        return b"[" + ws + sep.join(render(item, ws) for item in node.items) + ws + b"]"
    if isinstance(node, Obj):
        members = (key.raw + ws + b":" + ws + render(value, ws) for key, value in node.members)
        return b"{" + ws + sep.join(members) + ws + b"}"
    inner = render(node.child, ws)
    if node.key is None:
        return (b"[" + ws) * node.depth + inner + (ws + b"]") * node.depth
    opening = b"{" + ws + node.key.raw + ws + b":" + ws
    return opening * node.depth + inner + (ws + b"}") * node.depth


def children(node: Node) -> tuple[Node, ...]:
    if isinstance(node, Arr):
        return node.items
    if isinstance(node, Obj):
        return tuple(value for _, value in node.members)
    if isinstance(node, Nest):
        return (node.child,)
    return ()


def walk(node: Node, path: Path = ()) -> list[tuple[Path, Node]]:
    found = [(path, node)]
    for index, child in enumerate(children(node)):
        found.extend(walk(child, (*path, index)))
    return found


def live(node: Node, path: Path = ()) -> list[tuple[Path, Node]]:
    """The nodes whose meaning is certain: not below an object member whose key is repeated
    (a later repeat hides it from last-wins parsers, an earlier one from first-wins parsers)
    or might be (a key that is not strict might decode to another's value)."""
    found = [(path, node)]
    for index, child in enumerate(children(node)):
        if not isinstance(node, Obj) or _unique_key(node, index):
            found.extend(live(child, (*path, index)))
    return found


def _unique_key(obj: Obj, index: int) -> bool:
    if not all(key.strict for key, _ in obj.members):
        return False
    names = [json.loads(key.raw) for key, _ in obj.members]
    return names.count(names[index]) == 1


def at(node: Node, path: Path) -> Node:
    for index in path:
        node = children(node)[index]
    return node


def put(node: Node, path: Path, new: Node) -> Node:
    """`node` with the node at `path` replaced by `new`."""
    if not path:
        return new
    index, rest = path[0], path[1:]
    if isinstance(node, Arr):
        items = list(node.items)
        items[index] = put(items[index], rest, new)
        return Arr(tuple(items))
    if isinstance(node, Obj):
        members = list(node.members)
        key, value = members[index]
        members[index] = (key, put(value, rest, new))
        return Obj(tuple(members))
    assert isinstance(node, Nest)
    return replace(node, child=put(node.child, rest, new))


def strings(node: Node) -> list[Str]:
    found = [key for _, n in walk(node) if isinstance(n, Obj) for key, _ in n.members]
    found += [n.key for _, n in walk(node) if isinstance(n, Nest) and n.key is not None]
    return found + [n for _, n in walk(node) if isinstance(n, Str)]


@dataclass(frozen=True)
class JsonDoc:
    tree: Node
    ws: bytes
    bom: bool = False

    def render(self) -> bytes:
        return (BOM if self.bom else b"") + self.ws + render(self.tree, self.ws) + self.ws

    @property
    def strict(self) -> bool:
        """A document RFC 8259 gives one meaning: the contract's fingerprint rule
        (docs/contract.md) then says which rewrites of it are the same request. (Repeated keys
        are allowed: a rewrite never reorders them.)"""
        return not self.bom and all(s.strict for s in strings(self.tree))


# -- strategies --------------------------------------------------------------------------

_DIGITS = "0123456789"
_SPECIAL_NUMBERS = (
    "18446744073709551616",
    "18446744073709551617",
    "-9223372036854775809",
    "9007199254740993",
    "1e400",
    "-1e400",
    "1e-400",
    "-0",
    "-0.0",
    "1.0",
    "0.1",
    "0.10000000000000001",
    "1E+2",
)


@st.composite
def _number_literal(draw: st.DrawFn) -> str:
    sign = draw(st.sampled_from(["", "-"]))
    head = draw(st.sampled_from("0123456789"))
    tail = "" if head == "0" else draw(st.text(_DIGITS, max_size=30))
    fraction = draw(st.one_of(st.just(""), st.text(_DIGITS, min_size=1, max_size=25)))
    exponent = draw(st.one_of(st.just(""), st.text(_DIGITS, min_size=1, max_size=4)))
    literal = sign + head + tail + ("." + fraction if fraction else "")
    if exponent:
        literal += draw(st.sampled_from(["e", "E", "e+", "e-", "E-"])) + exponent
    return literal


numbers = st.one_of(
    _number_literal(),
    st.sampled_from(_SPECIAL_NUMBERS),
    st.integers().map(str),
).map(Num)


def _lone_surrogate(prefix: str, code: int) -> bytes:
    return json.dumps(prefix).encode("utf-8")[:-1] + b"\\u%04x" % code + b'"'


plain_strings = st.builds(
    lambda s, ascii_only: json.dumps(s, ensure_ascii=ascii_only).encode("utf-8"),
    st.text(max_size=8),
    st.booleans(),
)
odd_strings = st.one_of(
    st.builds(_lone_surrogate, st.text(max_size=3), st.integers(0xD800, 0xDFFF)),
    # Any bytes: invalid UTF-8 too (quotes and backslashes dropped, to stay one string).
    st.binary(max_size=4).map(lambda b: b'"' + b.replace(b'"', b"").replace(b"\\", b"") + b'"'),
)
json_strings = st.one_of(plain_strings, plain_strings, plain_strings, odd_strings).map(Str)

member_keys = st.one_of(
    st.sampled_from(["a", "b", "n", ""]).map(lambda k: Str(json.dumps(k).encode())),
    json_strings,
)

leaves = st.one_of(numbers, json_strings, st.sampled_from(["true", "false", "null"]).map(Lit))

trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda items: Arr(tuple(items))),
        st.lists(st.tuples(member_keys, inner), max_size=4).map(
            lambda members: Obj(tuple(members))
        ),
    ),
    max_leaves=10,
)

whitespace = st.lists(st.sampled_from([b" ", b"\t", b"\n", b"\r"]), max_size=3).map(b"".join)

#: Nesting for documents whose meaning the fingerprint rule must keep: RFC 8259 §9 lets a
#: parser limit depth (Python's json stops near 1,000), so past it "the same document" is not
#: certain. Deeper documents still must never get a 5xx: DEEP is for those.
SHALLOW = 100
DEEP = 6000


def documents(max_depth: int) -> st.SearchStrategy[JsonDoc]:
    nests = st.builds(Nest, st.integers(1, max_depth), trees, st.one_of(st.none(), member_keys))
    return st.builds(
        JsonDoc,
        tree=st.one_of(trees, trees, nests),
        ws=whitespace,
        bom=st.sampled_from([False, False, False, True]),
    )


# -- variants ----------------------------------------------------------------------------


def _distinct_keys(obj: Obj) -> bool:
    names = [json.loads(key.raw) for key, _ in obj.members]
    return len(set(names)) == len(names)


@st.composite
def relaid(draw: st.DrawFn, doc: JsonDoc) -> JsonDoc:
    """The same document in another layout: new whitespace, and the members of every object
    whose keys are all distinct in another order. Only for `doc.strict`."""
    tree = doc.tree
    # Deepest first: reordering an object's members renumbers the paths below it.
    for path, _ in reversed(walk(doc.tree)):
        node = at(tree, path)
        if isinstance(node, Obj) and len(node.members) > 1 and _distinct_keys(node):
            members = draw(st.permutations(node.members))
            tree = put(tree, path, Obj(tuple(members)))
    ws = draw(whitespace.filter(lambda ws: ws != doc.ws))
    return JsonDoc(tree, ws, doc.bom)


def _changed_digit(literal: str, digit: str) -> str | None:
    changed = literal[:-1] + digit
    return changed if Decimal(changed) != Decimal(literal) else None


def digit_changes(doc: JsonDoc) -> list[tuple[Path, Num]]:
    """Every number with its last digit changed so that its exact value changes."""
    found = []
    for path, node in live(doc.tree):
        if isinstance(node, Num):
            for digit in _DIGITS:
                changed = _changed_digit(node.literal, digit)
                if changed is not None:
                    found.append((path, Num(changed)))
    return found


def float_spellings(doc: JsonDoc) -> list[tuple[Path, Num]]:
    """Every integer written as a float (`1` → `1.0`): another literal and, to a Python
    application, another type."""
    return [
        (path, Num(node.literal + ".0"))
        for path, node in live(doc.tree)
        if isinstance(node, Num) and node.literal.lstrip("-").isdigit()
    ]


def duplicate_keys(doc: JsonDoc) -> list[tuple[Path, Obj]]:
    """Every object with one of its keys repeated at the end, holding a value no member of
    the object has: the repeat wins (as in Python's json, orjson and JavaScript), so the
    object's meaning changes."""
    found = []
    for path, node in live(doc.tree):
        if isinstance(node, Obj) and node.members:
            taken = {render(value, b"") for _, value in node.members}
            value: Node = Arr(())
            while render(value, b"") in taken:
                value = Arr((value,))
            for key, _ in node.members:
                found.append((path, Obj((*node.members, (key, value)))))
    return found
