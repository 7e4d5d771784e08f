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
    from bench.figures import soak_figure

    soak_figure([asdict(r) for r in rows], [asdict(s) for s in samples], path, title, ttl, "light")
