"""The soak's figures: per-interval throughput and latency, the samples, the JSON and the plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .audit import Answer
from .sample import Sample


@dataclass
class Interval:
    start: float  # seconds since the load began
    requests_per_second: float  # answers completed in the interval, per second
    p50_ms: float
    p99_ms: float
    max_ms: float


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    if not ordered:
        return 0.0
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def intervals(answers: Sequence[Answer], width: float) -> list[Interval]:
    buckets: dict[int, list[float]] = {}
    for a in answers:
        if a.status:
            buckets.setdefault(int((a.sent_at + a.latency) // width), []).append(a.latency)
    out = []
    for index in range(max(buckets) + 1 if buckets else 0):
        latencies = sorted(buckets.get(index, []))
        out.append(
            Interval(
                start=index * width,
                requests_per_second=len(latencies) / width,
                p50_ms=percentile(latencies, 0.50) * 1000,
                p99_ms=percentile(latencies, 0.99) * 1000,
                max_ms=(latencies[-1] * 1000) if latencies else 0.0,
            )
        )
    # The last interval is usually partial (the run ends inside it): leave it out of rates.
    return out[:-1] if len(out) > 1 else out


def overall(answers: Sequence[Answer]) -> dict[str, float]:
    latencies = sorted(a.latency for a in answers if a.status)
    return {
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p90_ms": percentile(latencies, 0.90) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "p999_ms": percentile(latencies, 0.999) * 1000,
        "max_ms": (latencies[-1] * 1000) if latencies else 0.0,
    }


def figures(rows: list[Interval], samples: list[Sample], sent_by: float) -> dict[str, Any]:
    """Spreads over the run. Throughput and p99 over the steady part only: from the third
    interval (after the ramp-up) to the last whole one before the plan's last key went out
    (after it, only the delayed copies trickle in)."""

    def spread(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        ordered = sorted(values)
        return {
            "min": ordered[0],
            "median": percentile(ordered, 0.5),
            "max": ordered[-1],
        }

    width = rows[1].start - rows[0].start if len(rows) > 1 else 1.0
    steady = [r for r in rows[2:] if r.start + width <= sent_by] or rows
    lagging = [s for s in samples if s.reaper_lag > 0]
    return {
        "throughput_rps": spread([r.requests_per_second for r in steady]),
        "p99_ms_per_interval": spread([r.p99_ms for r in steady]),
        "table_total_mb": spread([s.total_bytes / 1e6 for s in samples]),
        "table_total_mb_final": samples[-1].total_bytes / 1e6 if samples else 0.0,
        "live_tuples": spread([float(s.live_tuples) for s in samples]),
        "dead_tuples": spread([float(s.dead_tuples) for s in samples]),
        "reaper_lag_seconds": spread([s.reaper_lag for s in samples]),
        "expired_rows_waiting": spread([float(s.expired_waiting) for s in samples]),
        "first_sample_with_expired_rows_at": lagging[0].t if lagging else None,
        "rows_deleted": samples[-1].deleted if samples else 0,
        "autovacuums": samples[-1].autovacuums if samples else 0,
        "cpu_cores_mean": {
            name: sum(s.cpu.get(name, 0.0) for s in samples) / len(samples)
            for name in (samples[0].cpu if samples else {})
        },
    }


def series(rows: list[Interval], samples: list[Sample]) -> dict[str, Any]:
    return {
        "intervals": [asdict(r) for r in rows],
        "samples": [asdict(s) for s in samples],
    }


def plot(rows: list[Interval], samples: list[Sample], path: Path, title: str, ttl: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(5, 1, figsize=(11, 13), sharex=True)
    width = rows[1].start - rows[0].start if len(rows) > 1 else 0.0
    t = [(r.start + width / 2) / 60 for r in rows]  # each interval at its middle
    s_t = [s.t / 60 for s in samples]

    ax = axes[0]
    ax.plot(t, [r.requests_per_second for r in rows], color="#4f81bd")
    ax.set_ylabel("answers / s")
    ax.set_title("throughput", fontsize=10, loc="left")
    ax.set_ylim(bottom=0)

    ax = axes[1]
    ax.plot(t, [r.p99_ms for r in rows], color="#c0504d", label="p99")
    ax.plot(t, [r.p50_ms for r in rows], color="#888888", label="p50")
    ax.set_ylabel("ms")
    ax.set_title("latency per interval", fontsize=10, loc="left")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[2]
    ax.plot(s_t, [s.total_bytes / 1e6 for s in samples], color="#4f81bd", label="total MB")
    ax.set_ylabel("MB (heap + indexes + TOAST)")
    ax.set_title("idempotency_keys: size and tuples", fontsize=10, loc="left")
    ax.set_ylim(bottom=0)
    right = ax.twinx()
    right.plot(s_t, [s.live_tuples / 1000 for s in samples], color="#9bbb59", label="live k")
    right.plot(s_t, [s.dead_tuples / 1000 for s in samples], color="#c0504d", label="dead k")
    right.set_ylabel("thousand tuples")
    right.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)

    ax = axes[3]
    ax.plot(s_t, [s.reaper_lag for s in samples], color="#8064a2", label="lag s")
    ax.set_ylabel("seconds")
    ax.set_title(
        f"reaper lag: age of the oldest finished row past its retention (TTL {ttl:g} s)",
        fontsize=10,
        loc="left",
    )
    ax.set_ylim(bottom=0)
    ax.axvline(ttl / 60, color="#888888", linestyle=":", linewidth=1)  # first keys expire
    right = ax.twinx()
    right.plot(s_t, [s.expired_waiting / 1000 for s in samples], color="#f79646", label="expired k")
    right.set_ylabel("thousand rows waiting")
    right.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)

    ax = axes[4]
    names = [
        n for n in ("client", "server", "postgres", "others") if samples and n in samples[0].cpu
    ]
    ax.stackplot(
        s_t,
        *[[s.cpu.get(n, 0.0) for s in samples] for n in names],
        labels=names,
        colors=["#f79646", "#4f81bd", "#9bbb59", "#cccccc"][: len(names)],
    )
    ax.set_ylabel("cores")
    ax.set_title("CPU (2 cores; others: other work on the shared machine)", fontsize=10, loc="left")
    ax.set_ylim(0, 2.1)
    ax.legend(loc="lower right", fontsize=8, ncol=4)
    ax.set_xlabel("minutes since the load began")

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
