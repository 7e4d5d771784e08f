"""MkDocs hooks. CHANGELOG.md lives at the repository's root, where its links into the site say
`docs/page.md`; on the site, docs/changelog.md (on GitHub, a link to it) shows it, with those
links made relative to the site."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"


def on_page_markdown(markdown: str, *, page: Any, **_: Any) -> str:
    if page.file.src_uri == "changelog.md":
        return CHANGELOG.read_text().replace("](docs/", "](")
    return markdown
