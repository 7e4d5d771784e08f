"""MkDocs hooks.

- The repository's address and the version come from the package's metadata (pyproject.toml),
  so the site's header, its edit links and the package never disagree.
- CHANGELOG.md lives at the repository's root, where its links into the site say
  `docs/page.md`; on the site, docs/changelog.md (on GitHub, a link to it) shows it, with those
  links made relative to the site.
"""

from __future__ import annotations

from importlib.metadata import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"


def on_config(config: Any, **_: Any) -> Any:
    package = metadata("idempotency-asgi")  # scripts/bootstrap installs it anew on a change
    urls = dict(entry.split(", ", 1) for entry in package.get_all("Project-URL") or [])
    config.repo_url = urls["Repository"]
    config.edit_uri = "edit/main/docs/"
    config.site_url = urls["Documentation"]
    config.extra["version"] = package["Version"]
    return config


def on_page_markdown(markdown: str, *, page: Any, **_: Any) -> str:
    if page.file.src_uri == "changelog.md":
        return CHANGELOG.read_text().replace("](docs/", "](")
    return markdown
