"""MkDocs hooks.

- The repository's address and the version come from the package's metadata (pyproject.toml),
  so the site's header, its edit links and the package never disagree.
- CHANGELOG.md lives at the repository's root, where its links into the site say
  `docs/page.md`; on the site, docs/changelog.md (on GitHub, a link to it) shows it, with those
  links made relative to the site.
- The pages read on GitHub too, which shows neither what mkdocstrings generates nor its
  `::: name` lines: what only the site can show is written in a comment,
  `<!-- on the site: ... -->`, which GitHub hides and this hook opens, and what only GitHub
  needs (a pointer to the site and to the code) between `<!-- on GitHub -->` and
  `<!-- /on GitHub -->`, which this hook drops (tests/test_docs_github.py reads the pages as
  GitHub shows them).
"""

from __future__ import annotations

import re
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


SITE_ONLY = re.compile(r"^<!-- on the site:\n(.*?)^-->\n", re.DOTALL | re.MULTILINE)
GITHUB_ONLY = re.compile(
    r"^<!-- on GitHub -->\n.*?^<!-- /on GitHub -->\n", re.DOTALL | re.MULTILINE
)


def on_page_markdown(markdown: str, *, page: Any, **_: Any) -> str:
    if page.file.src_uri == "changelog.md":
        return CHANGELOG.read_text().replace("](docs/", "](")
    return for_the_site(markdown)


def for_the_site(markdown: str) -> str:
    """The page as the site shows it: its site-only parts opened, its GitHub-only parts gone."""
    return SITE_ONLY.sub(r"\1", GITHUB_ONLY.sub("", markdown))
