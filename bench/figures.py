"""The benchmarks' figures, drawn from their results (bench/results.json, the soak's JSON).

A run writes them as PNG beside its JSON; `scripts/doc-figures` draws the documentation's copies
from the same JSON as SVG, one for each theme of the site (transparent, with text in that
theme's colours), sized for its column so that a label is as large as the text around it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

#: Text, grid and series colours per theme: "light" on white, "dark" on the site's dark slate.
#: Each series colour, and so each legend swatch, has at least 3:1 contrast against its
#: theme's page (WCAG's least for graphics; scripts/browser-check measures it).
THEMES: dict[str, dict[str, str]] = {
    "light": {
        "text": "#333333",
        "grid": "#dddddd",
        "bare": "#8c8c8c",
        "ours": "#3f72af",
        "inline": "#6394d0",
        "peer": "#c0504d",
        "p50": "#8c8c8c",
        "lag": "#8064a2",
        "live": "#5b9a3c",
        "waiting": "#d06a10",
        "cpu_others": "#8f8f8f",
    },
    "dark": {
        "text": "#e2e4e9",
        "grid": "#444857",
        "bare": "#9a9ca3",
        "ours": "#6fa8ff",
        "inline": "#b4cdf0",
        "peer": "#ff7b72",
        "p50": "#9a9ca3",
        "lag": "#c3a6ff",
        "live": "#8fd16b",
        "waiting": "#ffb067",
        "cpu_others": "#767b89",
    },
}
WIDTH_INCHES = 7.6  # the site's column at 1280 px, about 730 px
FONT_SIZE = 10.5


def _pyplot(theme: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = THEMES[theme]
    plt.rcParams.update(
        {
            "font.size": FONT_SIZE,
            "text.color": colours["text"],
            "axes.labelcolor": colours["text"],
            "axes.edgecolor": colours["grid"],
            "axes.titlecolor": colours["text"],
            "xtick.color": colours["text"],
            "ytick.color": colours["text"],
            "axes.grid": True,
            "grid.color": colours["grid"],
            "axes.axisbelow": True,
            "legend.frameon": False,
            "svg.fonttype": "path",  # text drawn as shapes: the same on every machine
        }
    )
    return plt


def _save(fig: Any, path: Path, theme: str) -> None:
    transparent = path.suffix == ".svg"  # the site's copy sits on the theme's background
    fig.savefig(
        path, dpi=110, transparent=transparent, facecolor="none" if transparent else "white"
    )


def results_figure(results: list[dict[str, Any]], path: Path, subtitle: str, theme: str) -> None:
    """Requests per second for each configuration, each bar with its ratio to bare and its p99."""
    from matplotlib.patches import Patch

    plt = _pyplot(theme)
    colours = THEMES[theme]

    def kind(name: str) -> str:
        if name.startswith("bare"):
            return "bare"
        if name.startswith(("redis peer", "idemkit")):
            return "peer"
        return "inline" if name.startswith("inline") else "ours"

    names = [r["name"] for r in results]
    fig, ax = plt.subplots(figsize=(WIDTH_INCHES, 0.36 * len(results) + 1.6))
    ax.barh(
        names,
        [r["requests_per_second"] for r in results],
        color=[colours[kind(name)] for name in names],
    )
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    ax.set_xlabel("requests per second (higher is better)")
    widest = max(r["requests_per_second"] for r in results)
    ax.set_xlim(0, widest * 1.38)  # room for the labels past the longest bar
    for index, r in enumerate(results):
        ax.text(
            r["requests_per_second"] + widest * 0.01,
            index,
            f"{r['ratio_to_bare']:.2f}x, p99 {r['p99_ms']:.0f} ms",
            va="center",
            fontsize=FONT_SIZE - 1.5,
        )
    legend = [
        Patch(color=colours["bare"], label="bare endpoint"),
        Patch(color=colours["ours"], label="idempotency-asgi"),
        Patch(color=colours["inline"], label="written by hand (the floor)"),
        Patch(color=colours["peer"], label="other packages"),
    ]
    # Above the bars, never over them.
    ax.legend(
        handles=legend,
        loc="lower left",
        bbox_to_anchor=(0, 1.01),
        ncol=2,
        fontsize=FONT_SIZE - 1,
        title=subtitle,
        title_fontsize=FONT_SIZE - 1,
        alignment="left",
    )
    fig.tight_layout()
    _save(fig, path, theme)
    plt.close(fig)


def soak_figure(
    intervals: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    path: Path,
    title: str,
    ttl: float,
    theme: str,
) -> None:
    """The soak over time: throughput, latency, the key table, the reaper, the CPU."""
    plt = _pyplot(theme)
    colours = THEMES[theme]
    fig, axes = plt.subplots(5, 1, figsize=(WIDTH_INCHES, 13), sharex=True)
    width = intervals[1]["start"] - intervals[0]["start"] if len(intervals) > 1 else 0.0
    t = [(r["start"] + width / 2) / 60 for r in intervals]  # each interval at its middle
    s_t = [s["t"] / 60 for s in samples]
    small = FONT_SIZE - 1.5

    def legend(ax: Any, right: Any = None, where: str = "upper left") -> None:
        handles, labels = ax.get_legend_handles_labels()
        if right is not None:
            more = right.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        ax.legend(handles, labels, loc=where, fontsize=small, ncol=len(labels))

    ax = axes[0]
    ax.plot(
        t,
        [r["requests_per_second"] for r in intervals],
        color=colours["ours"],
        label="answers per second",
    )
    ax.set_title("throughput", loc="left")
    ax.set_ylim(bottom=0)
    legend(ax, where="lower right")

    ax = axes[1]
    ax.plot(t, [r["p99_ms"] for r in intervals], color=colours["peer"], label="p99")
    ax.plot(t, [r["p50_ms"] for r in intervals], color=colours["p50"], label="p50")
    ax.set_ylabel("ms")
    ax.set_title("latency per 5 s interval", loc="left")
    ax.set_ylim(bottom=0)
    legend(ax, where="upper right")

    ax = axes[2]
    ax.plot(s_t, [s["total_bytes"] / 1e6 for s in samples], color=colours["ours"], label="size, MB")
    ax.set_ylabel("MB")
    ax.set_title("idempotency_keys: size (heap, indexes, TOAST) and tuples", loc="left")
    ax.set_ylim(bottom=0)
    right = ax.twinx()
    right.grid(visible=False)
    right.plot(
        s_t,
        [s["live_tuples"] / 1000 for s in samples],
        color=colours["live"],
        label="live, thousands",
    )
    right.plot(
        s_t,
        [s["dead_tuples"] / 1000 for s in samples],
        color=colours["peer"],
        label="dead, thousands",
    )
    right.set_ylim(bottom=0)
    legend(ax, right)

    ax = axes[3]
    ax.plot(s_t, [s["reaper_lag"] for s in samples], color=colours["lag"], label="reaper lag, s")
    ax.set_ylabel("seconds")
    ax.set_title(f"the reaper: finished rows past their retention (TTL {ttl:g} s)", loc="left")
    ax.set_ylim(bottom=0)
    ax.axvline(ttl / 60, color=colours["p50"], linestyle=":", linewidth=1)  # first keys expire
    right = ax.twinx()
    right.grid(visible=False)
    right.plot(
        s_t,
        [s["expired_waiting"] / 1000 for s in samples],
        color=colours["waiting"],
        label="rows waiting, thousands",
    )
    right.set_ylim(bottom=0)
    legend(ax, right)

    ax = axes[4]
    names = [
        n for n in ("client", "server", "postgres", "others") if samples and n in samples[0]["cpu"]
    ]
    palette = {
        "client": colours["waiting"],
        "server": colours["ours"],
        "postgres": colours["live"],
        "others": colours["cpu_others"],
    }
    ax.stackplot(
        s_t,
        *[[s["cpu"].get(n, 0.0) for s in samples] for n in names],
        labels=names,
        colors=[palette[n] for n in names],
    )
    ax.set_ylabel("cores")
    ax.set_title("CPU of 2 cores (others: other work on the shared machine)", loc="left")
    ax.set_ylim(0, 2.1)
    ax.set_xlabel("minutes since the load began")
    # Below the plot: the areas fill it, and a swatch drawn over the area of its own colour
    # cannot be seen.
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28),
        fontsize=small,
        ncol=len(labels),
    )

    # The run, then when and where it ran, on a line of its own: in one line the title ran
    # past both edges of the figure. Wrapped still, should either be longer than the figure.
    lines = title.split(" (", 1)
    wrapped = [textwrap.fill(lines[0], 96)] + [textwrap.fill("(" + rest, 96) for rest in lines[1:]]
    fig.suptitle("\n".join(wrapped), fontsize=small)
    fig.tight_layout()
    _save(fig, path, theme)
    plt.close(fig)
