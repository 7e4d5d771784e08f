"""Form and multipart bodies for the fuzz, and the variants of each that the fingerprint rule
decides: the same request (replay) or a different one (422)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import urlencode

from hypothesis import assume
from hypothesis import strategies as st

# -- application/x-www-form-urlencoded ---------------------------------------------------


@dataclass(frozen=True)
class Form:
    pairs: tuple[tuple[str, str], ...]

    def render(self) -> bytes:
        return urlencode(self.pairs).encode("ascii")

    def values(self, name: str) -> list[str]:
        return [value for n, value in self.pairs if n == name]


forms = st.lists(
    st.tuples(
        st.one_of(st.sampled_from(["a", "b", "c"]), st.text(max_size=4)), st.text(max_size=6)
    ),
    max_size=6,
).map(lambda pairs: Form(tuple(pairs)))


def interleavings(form: Form) -> list[Form]:
    """The same pairs sent in another order: another request for an application that reads
    them in order (`multi_items()`), so never the same fingerprint."""
    found = []
    for shift in range(1, len(form.pairs)):
        rotated = Form(form.pairs[shift:] + form.pairs[:shift])
        if rotated.render() != form.render():
            found.append(rotated)
    return found


def repeated_swaps(form: Form) -> list[Form]:
    """Two different values of one repeated name swapped: that name's list changes."""
    found = []
    for i, (name, first) in enumerate(form.pairs):
        for j in range(i + 1, len(form.pairs)):
            other_name, second = form.pairs[j]
            if other_name == name and second != first:
                pairs = list(form.pairs)
                pairs[i], pairs[j] = (name, second), (name, first)
                found.append(Form(tuple(pairs)))
    return found


def value_changes(form: Form) -> list[Form]:
    return [
        Form((*form.pairs[:i], (name, value + "x"), *form.pairs[i + 1 :]))
        for i, (name, value) in enumerate(form.pairs)
    ]


# -- multipart/form-data -----------------------------------------------------------------

#: RFC 2046 bchars: what a boundary may hold (a space, but not at the end).
BCHARS = "0123456789abcdefABCDEF'()+_,-./:=? "
_FIELD = "abcxyzABC019_-. "


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None
    content_type: str | None
    content: bytes

    def render(self) -> bytes:
        disposition = f'form-data; name="{self.name}"'
        if self.filename is not None:
            disposition += f'; filename="{self.filename}"'
        head = f"Content-Disposition: {disposition}\r\n"
        if self.content_type is not None:
            head += f"Content-Type: {self.content_type}\r\n"
        return head.encode("ascii") + b"\r\n" + self.content


@dataclass(frozen=True)
class Multipart:
    parts: tuple[Part, ...]
    boundary: str

    def render(self) -> bytes:
        delimiter = b"--" + self.boundary.encode("ascii")
        body = b"".join(delimiter + b"\r\n" + part.render() + b"\r\n" for part in self.parts)
        return body + delimiter + b"--\r\n"

    @property
    def content_type(self) -> bytes:
        quoted = any(c in self.boundary for c in "'()+,/:=? ")
        value = f'"{self.boundary}"' if quoted else self.boundary
        return f"multipart/form-data; boundary={value}".encode("ascii")

    @property
    def well_formed(self) -> bool:
        """No part holds its delimiter, so every parser finds the same parts."""
        delimiter = b"--" + self.boundary.encode("ascii")
        return not self.boundary.endswith(" ") and all(
            delimiter not in part.render() for part in self.parts
        )


boundaries = st.text(BCHARS, min_size=1, max_size=70)

parts = st.builds(
    Part,
    name=st.text(_FIELD, max_size=6),
    filename=st.one_of(st.none(), st.text(_FIELD, max_size=6)),
    content_type=st.one_of(st.none(), st.sampled_from(["text/plain", "application/json"])),
    content=st.binary(max_size=40),
)

multiparts = st.builds(
    # At least one part: RFC 2046 has no empty multipart body.
    Multipart,
    parts=st.lists(parts, min_size=1, max_size=3).map(tuple),
    boundary=boundaries,
).filter(lambda body: body.well_formed)


@st.composite
def reboundaried(draw: st.DrawFn, body: Multipart) -> Multipart:
    """The same parts under a boundary of its own, as a client that rebuilds its request."""
    boundary = draw(boundaries.filter(lambda b: b != body.boundary))
    new = replace(body, boundary=boundary)
    assume(new.well_formed)
    return new


def part_changes(body: Multipart) -> list[tuple[str, Multipart]]:
    """Each part with its content, name or filename changed, and parts that differ swapped."""
    found = []
    for i, part in enumerate(body.parts):
        flipped = part.content[:-1] + bytes([part.content[-1] ^ 0x01]) if part.content else b"x"
        filename = "f" if part.filename is None else part.filename + "f"
        for label, changed in (
            ("content", replace(part, content=flipped)),
            ("name", replace(part, name=part.name + "n")),
            ("filename", replace(part, filename=filename)),
        ):
            found.append((f"multipart-{label}", _with_part(body, i, changed)))
        for j in range(i + 1, len(body.parts)):
            if body.parts[j] != part:
                swapped = list(body.parts)
                swapped[i], swapped[j] = swapped[j], swapped[i]
                found.append(("multipart-order", replace(body, parts=tuple(swapped))))
    return [(label, new) for label, new in found if new.well_formed]


def _with_part(body: Multipart, index: int, part: Part) -> Multipart:
    return replace(body, parts=(*body.parts[:index], part, *body.parts[index + 1 :]))
