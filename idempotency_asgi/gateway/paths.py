"""Paths as an upstream may read them, for `required_paths`.

The middleware matches `required_paths` as sent: `/orders` requires a key on `/orders`, and
on nothing else. An upstream reads more paths as that one: Express and Spring route
case-insensitively by default and ignore a trailing slash, most routers collapse `//`, and
servlet containers drop `;parameters` from a segment. Each of those spellings went through
without a key. So the gateway also compares each covered request's path in a loose form
(lower case, `\\` as `/`, empty segments and `;parameters` dropped) with the required paths
in the same form, and refuses one that matches without a key (400 missing-key) before the
middleware sees it. Loosening only ever requires a key on more paths, never on fewer.
"""

from __future__ import annotations

from collections.abc import Collection


def loose(path: str) -> str:
    """`path` as loosely as an upstream may read it: `/Orders//7;v=1/` -> `/orders/7`."""
    segments = (segment.split(";", 1)[0] for segment in path.replace("\\", "/").split("/"))
    return "/" + "/".join(segment for segment in segments if segment).lower()


class LoosePaths:
    """Exact paths and `/prefix/*` patterns, matched in their loose form."""

    def __init__(self, patterns: Collection[str]) -> None:
        self._exact = frozenset(loose(p) for p in patterns if not p.endswith("*"))
        self._prefixes = tuple(loose(p[:-1]).rstrip("/") + "/" for p in patterns if p.endswith("*"))

    def matches(self, path: str) -> bool:
        form = loose(path)
        return form in self._exact or (form + "/").startswith(self._prefixes)
