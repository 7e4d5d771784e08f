"""The documentation's code blocks are copies of tested files, kept equal to them.

A page says which file a block shows, in a comment just above it:

    <!-- code: docs/snippets/quickstart.py -->
    ```python title="quickstart.py"
    ...the file, as it is...
    ```

or one part of it, `<!-- code: docs/snippets/every_option.py:options -->`, the lines between
`# start: options` and `# end: options` in the file. The path is from the repository's root.
So the Markdown holds the code itself (GitHub shows it as it is; so does the site), and the
files hold what the tests run (tests/test_docs_snippets.py) and what ruff checks.

`python scripts/doc_code.py` rewrites every block from its file (a marker with no block after it
gets one); `--check` only compares, and tests/test_docs_snippets.py runs that. The pages are
README.md and every page under docs/.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(?P<indent> *)<!-- code: (?P<path>[^ :>]+)(?::(?P<part>[\w-]+))? -->$")
FENCE = re.compile(r"^ *(`{3,})")
LANGUAGES = {".py": "python", ".conf": "nginx", ".js": "javascript", ".toml": "toml"}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def source(path: str, part: str | None) -> str:
    """The file's text, or the lines of one part of it (not the start and end lines)."""
    text = (ROOT / path).read_text()
    if part is None:
        return text
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == f"# start: {part}"]
    ends = [i for i, line in enumerate(lines) if line.strip() == f"# end: {part}"]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"{path}: no single '# start: {part}' ... '# end: {part}' in it")
    return "".join(lines[starts[0] + 1 : ends[0]])


def rewrite(text: str, where: str) -> str:
    """The page with each marked block made equal to its file."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        found = MARKER.match(line.rstrip("\n"))
        if not found:
            continue
        indent, path, part = found["indent"], found["path"], found["part"]
        if not (ROOT / path).is_file():
            raise ValueError(f"{where}: {path} is not a file")
        body = source(path, part)
        opening = f"{indent}```{LANGUAGES.get(Path(path).suffix, '')}\n"
        fence = "```"
        if i < len(lines) and (started := FENCE.match(lines[i])):
            opening, fence = lines[i], started.group(1)
            end = i + 1
            while end < len(lines) and lines[end].strip() != fence:
                end += 1
            if end == len(lines):
                raise ValueError(f"{where}: the block after '{line.strip()}' never ends")
            i = end + 1
        out.append(opening)
        out.extend(
            indent + body_line if body_line.strip() else body_line
            for body_line in body.splitlines(keepends=True)
        )
        out.append(f"{indent}{fence}\n")
    return "".join(out)


def differences(*, write: bool) -> list[str]:
    """Pages whose blocks differ from their files (rewritten when `write`)."""
    changed = []
    for page in pages():
        text = page.read_text()
        made = rewrite(text, str(page.relative_to(ROOT)))
        if made != text:
            changed.append(str(page.relative_to(ROOT)))
            if write:
                page.write_text(made)
    return changed


def main() -> int:
    check = sys.argv[1:] == ["--check"]
    changed = differences(write=not check)
    for page in changed:
        print(("differs from its files: " if check else "rewritten: ") + page, file=sys.stderr)
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
