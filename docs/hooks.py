"""MkDocs hooks. CHANGELOG.md lives at the repository's root, where its links into the site say
`docs/page.md`; docs/changelog.md includes it with those links made relative to the site."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"


def on_page_markdown(markdown: str, *, page: Any, **_: Any) -> str:
    if page.file.src_uri == "changelog.md":
        included = CHANGELOG.read_text().replace("](docs/", "](")
        return markdown.replace('--8<-- "CHANGELOG.md"', included)
    return markdown
