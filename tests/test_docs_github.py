"""The documentation as GitHub shows it: the same Markdown the site is built from, read where
many users read it. GitHub hides HTML comments, renders none of MkDocs' own syntax (`::: name`,
`??? note`, `!!! note`), and resolves links against the repository's files; docs/hooks.py opens
`<!-- on the site: ... -->` and drops `<!-- on GitHub -->` blocks for the site."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
FENCE = re.compile(r"^( *)(```+|~~~+)[^\n]*\n.*?^\1\2[ \t]*$", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)=["']([^"']+)["']""")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_hooks"] = module
    spec.loader.exec_module(module)
    return module


def on_github(text: str) -> str:
    """What GitHub renders of a page: no comments; no code (its text is not Markdown)."""
    return FENCE.sub("", COMMENT.sub("", text))


def prose(text: str) -> str:
    return INLINE_CODE.sub("", on_github(text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text, lowercased, punctuation dropped, each
    space a hyphen (not collapsed: `a — b` is `a--b`)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for match in HEADING.finditer(on_github(page.read_text())):
        slug = github_slug(match.group(2))
        unique, n = slug, 0
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_no_line_of_mkdocs_syntax_is_left_for_github_to_show(page):
    for line in on_github(page.read_text()).splitlines():
        for opening in (":::", "???", "!!!", '=== "'):
            assert not line.lstrip().startswith(opening), f"{relative(page)}: {line!r}"


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_every_link_resolves_on_github(page):
    text = prose(page.read_text())
    targets = [m.group(1) for m in LINK.finditer(text)]
    targets += [m.group(1) for m in HTML_LINK.finditer(text)]
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # off the repository
        path, _, fragment = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        assert destination.exists(), f"{relative(page)}: {target} is not in the repository"
        if fragment and destination.suffix == ".md" and not fragment.startswith("gh-"):
            assert fragment in anchors(destination), (
                f"{relative(page)}: {target}: GitHub gives {relative(destination)} no such anchor"
            )


def test_the_reference_pages_show_github_readers_where_the_reference_is():
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        text = page.read_text()
        shown = on_github(text)
        assert "::: " not in shown
        assert "generated from the docstrings" in text, relative(page)
        # The site opens what GitHub hides, and drops what only GitHub needs.
        site = hooks().for_the_site(text)
        assert re.search(r"^::: idempotency_asgi", site, re.MULTILINE), relative(page)
        assert "on GitHub" not in site and "on the site" not in site


def test_each_install_line_works_while_the_package_is_unpublished():
    readme = (ROOT / "README.md").read_text()
    if "not on PyPI yet" not in readme:
        pytest.skip("the package is published: installing it by name works")
    for page in PAGES:
        if page.name == "benchmarks.md" or relative(page) == "docs/gateway.md":
            # Their owners' pages; gateway.md's `pip install 'idempotency-asgi[gateway]'` is
            # reported to its owner.
            continue
        for line in page.read_text().splitlines():
            found = re.search(r"pip install\s+(?:-\S+\s+)*(\S+)", line)
            if found and "idempotency-asgi" in found.group(1):
                assert "./idempotency-asgi" in found.group(1), f"{relative(page)}: {line.strip()}"


def test_links_to_this_repositorys_files_name_files_that_are_there():
    found = re.search(r'^Repository = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found
    prefix = found.group(1) + "/blob/main/"
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text())):
            if target.startswith(prefix):
                path = target.removeprefix(prefix).partition("#")[0]
                assert (ROOT / path).exists(), f"{relative(page)}: {target}"


def test_the_site_is_served_on_a_port_of_its_own():
    # A reader runs the example (8000, its provider 8001), the gateway (8080) and
    # `mkdocs serve` at once: the site must not want the example's port.
    found = re.search(r"^dev_addr: 127\.0\.0\.1:(\d+)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert found, "mkdocs.yml names the address `mkdocs serve` takes"
    port = found.group(1)
    assert port not in ("8000", "8001", "8080")
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "testing.md"):
        for line in page.read_text().splitlines():
            if "mkdocs serve" in line or "To read this site locally" in line:
                assert "127.0.0.1:8000" not in line, f"{relative(page)}: {line}"
        assert f"127.0.0.1:{port}" in page.read_text(), relative(page)
