"""The documentation site, checked in a real browser: scripts/browser-check runs this.

It builds the site, serves it on 127.0.0.1, and opens every page in headless Chromium (Debian's
`chromium`, driven by Playwright), in the light and the dark theme, at 1280 x 900. A page fails
on:

- a console error or an uncaught exception;
- a request that leaves the site (a CDN: the site must work with no network), or one that fails;
- a broken image (not loaded, or loaded empty);
- a link to a page or an anchor that is not there (links off the site are not followed);
- a diagram left as text (a `mermaid` block the renderer did not replace with a picture);
- a diagram's arrowhead with less than 3:1 contrast against the page (WCAG's least for
  graphics): without it a sequence diagram no longer says who sends to whom;
- a figure (an SVG of the site's own, as the page shows it in that theme) with a text drawn
  past its edges (a clipped title), or a legend swatch with less than 3:1 contrast against what
  lies under it, the plot or the page;
- a code block wider than its box (a reader would have to scroll it sideways);
- a name in a table broken across lines ("require_ke" / "y").

`--screenshots DIR` also saves each page as DIR/<page>-<theme>.png (its top 1,800 px, or
SCREENSHOT_HEIGHT).
Exit status 1 when a page fails; each failure is printed with its page and theme.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
#: As this machine's Chromium wants them headless, as root, with no network of its own.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # No host but this one resolves: a request off the site fails at once, and is reported.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
WIDTH, HEIGHT = 1280, 900
THEMES = ("light", "dark")
#: A screenshot is the page's top, as much as can be read at once.
SCREENSHOT_HEIGHT = int(os.environ.get("SCREENSHOT_HEIGHT", "1800"))
#: WCAG 2.1's least contrast for graphics a reader needs (1.4.11, non-text contrast).
ARROWHEAD_CONTRAST = 3.0
SWATCH_CONTRAST = 3.0

#: The theme draws each diagram in a closed shadow root; opened, the check can read it.
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (options) {
  return attach.call(this, { ...options, mode: "open" });
};
"""

#: Run in each page once it has settled: everything the checks need, measured in the page.
MEASURE = """
() => {
  // What a reader may unfold is measured unfolded.
  document.querySelectorAll(".md-content details").forEach((d) => { d.open = true; });
  const text = (node) => (node.textContent || "").trim().split("\\n")[0].slice(0, 70);
  const images = [...document.images]
    .filter((img) => img.offsetParent !== null)
    .filter((img) => !img.complete || img.naturalWidth === 0)
    .map((img) => img.getAttribute("src"));
  const code = [...document.querySelectorAll(".md-content pre > code")]
    .filter((block) => block.scrollWidth > block.clientWidth + 1)
    .map((block) => {
      const longest = block.textContent.split("\\n")
        .reduce((a, b) => (b.length > a.length ? b : a), "");
      return `${block.scrollWidth - block.clientWidth} px too wide: ${longest.slice(0, 70)}`;
    });
  const unrendered = [...document.querySelectorAll(".mermaid")]
    .filter((node) => node.tagName === "PRE" || node.getBoundingClientRect().height < 40)
    .map(text);
  // A name wrapped anywhere but where a name may part (after a space, a hyphen, a slash,
  // a colon, URL punctuation): "require_ke" / "y".
  const brokenInside = (node) => {
    const walker = document.createTreeWalker(node, NodeFilter.SHOW_TEXT);
    let top = null, before = "";
    for (let text = walker.nextNode(); text; text = walker.nextNode()) {
      for (let i = 0; i < text.length; i++) {
        const range = document.createRange();
        range.setStart(text, i);
        range.setEnd(text, i + 1);
        const box = range.getBoundingClientRect();
        if (box.width > 0) {
          if (top !== null && box.top > top + 2 && !/[-\\/\\s,(:?&=]/.test(before)) return true;
          top = box.top;
        }
        before = text.data[i];
      }
    }
    return false;
  };
  const broken = [...document.querySelectorAll(".md-content table code")]
    .filter((node) => node.getClientRects().length > 1 && brokenInside(node))
    .map((node) => node.textContent);
  const links = [...document.querySelectorAll(".md-container a[href]")]
    .map((a) => a.href)
    .filter((href) => href.startsWith(location.origin))
    // The theme's own anchors (a code annotation's, a line number's) are made by its script.
    .filter((href) => !new URL(href).hash.startsWith("#__"));
  const ids = [...document.querySelectorAll("[id]")].map((node) => node.id);
  // Each arrowhead a diagram's lines end in, against the page's background.
  const rgba = (text) => {
    const [r, g, b, a = 1] = (text.match(/[\\d.]+/g) || []).map(Number);
    return { r, g, b, a };
  };
  const luminance = ({ r, g, b }) => {
    const linear = (c) => ((c /= 255) <= 0.04045 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4);
    return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b);
  };
  const page = rgba(getComputedStyle(document.body).backgroundColor);
  const arrowheads = {};
  for (const host of document.querySelectorAll(".md-content .mermaid")) {
    const root = host.shadowRoot;
    if (!root) continue;
    for (const line of root.querySelectorAll("[marker-end]")) {
      const id = (line.getAttribute("marker-end").match(/#([^)"']+)/) || [])[1];
      const shape = id && root.getElementById(id)?.querySelector("path, polygon, circle");
      if (!shape) continue;
      const style = getComputedStyle(shape);
      const paint = rgba(style.fill !== "none" ? style.fill : style.stroke);
      const seen = ["r", "g", "b"].reduce(
        (mix, c) => ({ ...mix, [c]: paint[c] * paint.a + page[c] * (1 - paint.a) }), {});
      const [light, dark] = [luminance(seen), luminance(page)].sort((x, y) => y - x);
      const ratio = (light + 0.05) / (dark + 0.05);
      const name = id.replace(/^.*?-/, "");
      if (!(name in arrowheads) || ratio < arrowheads[name].ratio) {
        arrowheads[name] = { ratio, paint: style.fill !== "none" ? style.fill : style.stroke };
      }
    }
  }
  const figures = [...document.images]
    .filter((img) => img.offsetParent !== null && img.src.startsWith(location.origin))
    .map((img) => img.src.split("#")[0])
    .filter((src) => src.endsWith(".svg"));
  const background = getComputedStyle(document.body).backgroundColor;
  return { images, code, unrendered, broken, links, ids, arrowheads, figures, background };
}
"""

#: Run in a figure (an SVG opened on its own): its texts drawn past its edges, and each
#: legend swatch's paint with the paint under its middle (none: the page's, passed in).
FIGURE = """
(background) => {
  const svg = document.documentElement;
  const edge = svg.getBoundingClientRect();
  const said = (group) =>
    ([...(group?.childNodes || [])].find((node) => node.nodeType === 8)?.data || "").trim();
  const clipped = [...svg.querySelectorAll("g[id^='text_']")]
    .filter((group) => {
      const box = group.getBoundingClientRect();
      return box.width > 0 && (box.left < edge.left - 1 || box.right > edge.right + 1 ||
        box.top < edge.top - 1 || box.bottom > edge.bottom + 1);
    })
    .map((group) => said(group).slice(0, 70));
  const swatches = [];
  for (const legend of svg.querySelectorAll("g[id^='legend_']")) {
    const handles = legend.querySelectorAll(
      ":scope > g[id^='patch_'] > path, :scope > g[id^='line2d_'] > path");
    for (const handle of handles) {
      const style = getComputedStyle(handle);
      const paint = style.fill !== "none" ? style.fill : style.stroke;
      const box = handle.getBoundingClientRect();
      const under = document.elementsFromPoint(box.left + box.width / 2, box.top + box.height / 2)
        .find((node) => !legend.contains(node) && node.tagName === "path" &&
          getComputedStyle(node).fill !== "none");
      const label = said(handle.parentElement.nextElementSibling);
      swatches.push({ label, paint, behind: under ? getComputedStyle(under).fill : background });
    }
  }
  return { clipped, swatches };
}
"""


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/browser-check", description=__doc__)
    parser.add_argument("--screenshots", type=Path, help="save every page as a PNG here")
    parser.add_argument("--site", type=Path, help="an already built site (default: build one)")
    parser.add_argument("pages", nargs="*", help="only these pages (paths, e.g. gateway/)")
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        print(f"scripts/browser-check: no {CHROMIUM} (Debian: apt-get install chromium)")
        return 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="site-check-") as scratch:
        site = args.site or build(Path(scratch) / "site")
        pages = args.pages or sorted(
            str(path.parent.relative_to(site)) + "/" if path.parent != site else ""
            for path in site.rglob("index.html")
            if not path.relative_to(site).parts[0].startswith(("assets", "search"))
        )
        pages = [page.replace("./", "") for page in pages]
        with serving(site) as origin:
            failures = check(origin, site, pages, args.screenshots)
    for failure in failures:
        print(failure)
    seconds = time.monotonic() - started
    print(
        f"browser check: {len(pages)} pages x {len(THEMES)} themes in {seconds:.0f} s,"
        f" {len(failures)} failures"
    )
    return 1 if failures else 0


def build(site: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT,
        check=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    return site


class serving:
    """The built site over HTTP on a free port of 127.0.0.1, in a thread."""

    def __init__(self, site: Path) -> None:
        handler = functools.partial(Quiet, directory=str(site))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def check(origin: str, site: Path, pages: list[str], screenshots: Path | None) -> list[str]:
    from playwright.sync_api import sync_playwright

    failures: list[str] = []
    ids_by_page: dict[str, set[str]] = {}
    links_by_page: dict[str, set[str]] = {}
    if screenshots is not None:
        shutil.rmtree(screenshots, ignore_errors=True)
        screenshots.mkdir(parents=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            for theme in THEMES:
                failures += check_theme(
                    browser, theme, origin, pages, screenshots, ids_by_page, links_by_page
                )
        finally:
            browser.close()
    failures += broken_links(origin, site, links_by_page, ids_by_page)
    return failures


def check_theme(
    browser: Any,
    theme: str,
    origin: str,
    pages: list[str],
    screenshots: Path | None,
    ids_by_page: dict[str, set[str]],
    links_by_page: dict[str, set[str]],
) -> list[str]:
    failures: list[str] = []
    context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT}, color_scheme=theme)
    context.add_init_script(OPEN_SHADOW_ROOTS)
    # Nothing may leave the site (the browser resolves no other host: see FLAGS).
    off_site: list[str] = []
    context.on(
        "request",
        lambda request: None if request.url.startswith(origin) else off_site.append(request.url),
    )
    figures: dict[str, tuple[str, str]] = {}  # each figure shown, where, on what background
    for name in pages:
        where = f"{name or 'index'} ({theme})"
        off_site.clear()
        page, errors = opened(context, origin)
        response = page.goto(origin + name, wait_until="load")
        if response is None or response.status != 200:
            failures.append(f"{where}: answered {response and response.status}")
            page.close()
            continue
        settle(page)
        found = page.evaluate(MEASURE)
        failures += [f"{where}: console: {error}" for error in errors]
        failures += [f"{where}: request off the site: {url}" for url in off_site]
        failures += [f"{where}: broken image: {src}" for src in found["images"]]
        failures += [f"{where}: code wider than its box, {c}" for c in found["code"]]
        failures += [f"{where}: diagram left as text: {t}" for t in found["unrendered"]]
        failures += [f"{where}: name broken across lines: {n}" for n in found["broken"]]
        failures += [
            f"{where}: a diagram's {name} ({head['paint']}) has {head['ratio']:.1f}:1 contrast"
            f" against the page, less than {ARROWHEAD_CONTRAST:g}:1"
            for name, head in found["arrowheads"].items()
            if head["ratio"] < ARROWHEAD_CONTRAST
        ]
        if theme == THEMES[0]:
            ids_by_page[name] = set(found["ids"])
            links_by_page[name] = set(found["links"])
        for src in found["figures"]:
            figures.setdefault(src, (where, found["background"]))
        if screenshots is not None:
            stem = (name.strip("/").replace("/", "-") or "index") + f"-{theme}.png"
            height = page.evaluate("document.documentElement.scrollHeight")
            clip = {"x": 0, "y": 0, "width": WIDTH, "height": min(height, SCREENSHOT_HEIGHT)}
            page.screenshot(path=str(screenshots / stem), full_page=True, clip=clip)
        page.close()
    failures += check_figures(context, figures)
    context.close()
    return failures


def check_figures(context: Any, figures: dict[str, tuple[str, str]]) -> list[str]:
    """Each figure as its page shows it: opened on its own, at its natural size."""
    failures = []
    page = context.new_page()
    page.set_viewport_size({"width": 2000, "height": 2400})  # the whole figure, hit-testable
    for src, (where, background) in sorted(figures.items()):
        page.goto(src, wait_until="load")
        found = page.evaluate(FIGURE, background)
        figure = src.rsplit("/", 1)[-1]
        failures += [f"{where}: {figure}: text past its edges: {t}" for t in found["clipped"]]
        for swatch in found["swatches"]:
            ratio = contrast(swatch["paint"], swatch["behind"])
            if ratio < SWATCH_CONTRAST:
                failures.append(
                    f"{where}: {figure}: the legend's {swatch['label']!r} swatch"
                    f" ({swatch['paint']}) has {ratio:.1f}:1 contrast against what is under it"
                    f" ({swatch['behind']}), less than {SWATCH_CONTRAST:g}:1"
                )
    page.close()
    return failures


def contrast(paint: str, behind: str) -> float:
    """WCAG's contrast ratio of a CSS colour (its alpha blended) over another."""
    front, back = _rgba(paint), _rgba(behind)
    seen = [front[i] * front[3] + back[i] * (1 - front[3]) for i in range(3)]
    lighter, darker = sorted((_luminance(seen), _luminance(back[:3])), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


def _rgba(text: str) -> tuple[float, float, float, float]:
    numbers = [float(n) for n in re.findall(r"[\d.]+", text)]
    if len(numbers) == 3:
        numbers.append(1.0)
    if not text.startswith("rgb") or len(numbers) != 4:
        return (255.0, 255.0, 255.0, 0.0)  # transparent, or a paint server: not compared
    return (numbers[0], numbers[1], numbers[2], numbers[3])


def _luminance(rgb: list[float] | tuple[float, ...]) -> float:
    def linear(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def opened(context: Any, origin: str) -> tuple[Any, list[str]]:
    """A new tab, and the errors it reports as they come."""
    page = context.new_page()
    errors: list[str] = []

    def console(message: Any) -> None:
        if message.type == "error":
            errors.append(message.text)

    def failed(request: Any) -> None:
        if request.url.startswith(origin):
            errors.append(f"request failed: {request.url}")

    page.on("console", console)
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    page.on("requestfailed", failed)
    return page, errors


def settle(page: Any) -> None:
    """Wait until the diagrams are drawn (the renderer runs after load), at most 10 s."""
    with contextlib.suppress(Exception):  # a diagram still not drawn is reported
        page.wait_for_function(
            "() => document.querySelectorAll('pre.mermaid').length === 0", timeout=10_000
        )


def broken_links(
    origin: str, site: Path, links: dict[str, set[str]], ids: dict[str, set[str]]
) -> list[str]:
    failures = []
    for name, hrefs in links.items():
        for href in sorted(hrefs):
            parts = urlsplit(href)
            path = unquote(parts.path)
            target = site / path.lstrip("/")
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                failures.append(f"{name or 'index'}: broken link: {href}")
                continue
            if parts.fragment and target.name == "index.html":
                page = str(target.parent.relative_to(site)) + "/"
                page = "" if page == "./" else page
                known = ids.get(page)
                if known is None:
                    known = set(re.findall(r'\bid="([^"]+)"', target.read_text()))
                if unquote(parts.fragment) not in known:
                    failures.append(f"{name or 'index'}: link to a missing anchor: {href}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
