"""The documentation's benchmark figures, drawn from the recorded results: scripts/doc-figures.

bench/results.json (the benchmark) and bench/soak_results.json (the soak) become
docs/img/benchmark-{light,dark}.svg and docs/img/soak-{light,dark}.svg: one per theme of the
site, which shows the one that matches (`#gh-light-mode-only`, `#gh-dark-mode-only` in the
pages: GitHub reads the same marks). Run it after a new run's JSON is committed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.figures import THEMES, results_figure, soak_figure  # noqa: E402

IMAGES = ROOT / "docs" / "img"


def main() -> int:
    bench = json.loads((ROOT / "bench" / "results.json").read_text())
    soak = json.loads((ROOT / "bench" / "soak_results.json").read_text())
    settings = soak["settings"]
    soak_title = (
        f"soak: {settings['requests']:,} requests, {settings['workers']} workers,"
        f" TTL {settings['ttl_seconds']:g} s ({soak['taken']}, {soak['machine']})"
    )
    for theme in THEMES:
        results_figure(
            bench["results"],
            IMAGES / f"benchmark-{theme}.svg",
            f"{bench['taken']}, {bench['machine']}",
            theme,
        )
        soak_figure(
            soak["intervals"],
            soak["samples"],
            IMAGES / f"soak-{theme}.svg",
            soak_title,
            settings["ttl_seconds"],
            theme,
        )
        print(f"wrote docs/img/benchmark-{theme}.svg and docs/img/soak-{theme}.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
