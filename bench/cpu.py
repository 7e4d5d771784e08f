"""`python -m bench.cpu`: CPU per request, each mode beside the same thing written by hand.

For each served mode (bench/app.py) in one run: uvicorn (one worker, uvloop + httptools) is
loaded with wrk after a warm-up, and the CPU time the server process and every PostgreSQL
process spent meanwhile (from /proc, in ns: each thread's schedstat) is divided by the
requests served. With `--profile`, py-spy samples the server while it is measured, and each
sample is charged to the package of its innermost Python frame: idempotency_asgi, asyncio
(with uvloop), asyncpg, or the rest (uvicorn, starlette, the endpoint). Statements per
request come from pg_stat_statements, write transactions from the transaction id's advance.

    python -m bench.cpu [--seconds 8] [--warmup 2] [--connections 32] [--profile]
                        [--rounds 3] [--modes plain,inline-plain,tx,inline-tx,atomic,...]

With `--rounds N` every mode is measured N times, the modes taking turns, and each figure is
the median of its N: on a shared machine the load drifts within minutes, and a mode measured
only before or only after a busy spell would carry it alone.

Writes bench/cpu.json and bench/cpu.md. CPU per request is steadier on a shared machine
than throughput, but read both within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench import statements
from bench.__main__ import load_statement_statistics, prepare, run_wrk, serve, stop
from examples.local_postgres import LocalPostgres

HERE = Path(__file__).resolve().parent

#: Each mode, and the hand-written floor it is measured against.
FLOORS = {
    "plain": "inline-plain",
    "tx": "inline-tx",
    "atomic": "inline-atomic",
}
DEFAULT_MODES = ("bare", "plain", "inline-plain", "tx", "inline-tx", "atomic", "inline-atomic")

#: Where a sample's innermost frame is, by a part of its file's path.
PACKAGES = (
    ("idempotency_asgi", ("/idempotency_asgi/",)),
    ("asyncio", ("/asyncio/", "/uvloop/")),
    ("asyncpg", ("/asyncpg/",)),
)

#: The file of a frame as py-spy writes it: `function (path:line)`, the path relative to
#: where the module was found (`asyncpg/connection.py`) or absolute.
_FRAME_FILE = re.compile(r"\(([^()]*):\d+\)$")


@dataclass
class Row:
    mode: str
    script: str
    requests_per_second: float
    server_us: float
    postgres_us: float
    statements: float
    writes: float
    non_2xx: int
    #: round trips to PostgreSQL per request, counted in a pass of their own (see `trips`)
    round_trips: float = 0.0
    #: the server's CPU per request by package (µs), when profiled
    split: dict[str, float] = field(default_factory=dict)


def thread_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far, in ns (0 when it is gone)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def postgres_pids(postmaster: int) -> list[int]:
    """The postmaster and every process it started (backends, writers, autovacuum)."""
    found = [postmaster]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == postmaster:
            found.append(int(entry))
    return found


def postgres_ns(postmaster: int) -> dict[int, int]:
    return {pid: thread_ns(pid) for pid in postgres_pids(postmaster)}


def spent(before: dict[int, int], after: dict[int, int]) -> int:
    """CPU spent between two readings: by processes there at both, and all of a new one's."""
    return sum(ns - before.get(pid, 0) for pid, ns in after.items())


def split_profile(raw: Path, server_us: float) -> dict[str, float]:
    """The server's µs per request by the package of each sample's innermost frame."""
    samples: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        found = _FRAME_FILE.search(stack.rsplit(";", 1)[-1])
        path = "/" + (found.group(1) if found else "")
        package = next(
            (name for name, marks in PACKAGES if any(m in path for m in marks)), "the rest"
        )
        samples[package] += int(count)
    total = sum(samples.values())
    if not total:
        return {}
    names = [name for name, _ in PACKAGES] + ["the rest"]
    return {name: server_us * samples[name] / total for name in names}


def postmaster_of(dsn: str) -> int:
    async def read() -> str:
        import asyncpg

        conn = await asyncpg.connect(dsn)
        try:
            directory: str = await conn.fetchval("SHOW data_directory")
        finally:
            await conn.close()
        return directory

    return int(Path(asyncio.run(read()), "postmaster.pid").read_text().split()[0])


def measure(mode: str, script: str, dsn: str, args: argparse.Namespace, log: Path) -> Row:
    postmaster = postmaster_of(dsn)
    process, url = serve(mode, {"DATABASE_URL": dsn}, log)
    profile: subprocess.Popen[bytes] | None = None
    raw = Path(tempfile.mkdtemp(prefix="bench-cpu-")) / "profile.txt"
    try:
        run_id = uuid.uuid4().hex[:8]
        run_wrk(url + "/orders", script, args.warmup, args.connections, run_id + "w")
        since = asyncio.run(statements.reset(dsn))
        if args.profile:
            profile = subprocess.Popen(
                [
                    shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "--pid",
                    str(process.pid),
                    "--rate",
                    "200",
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                    "--duration",
                    str(round(args.seconds)),
                    "--nonblocking",
                    *(["--native"] if args.native else []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.3)  # attached before the measured load starts
        server_before, pg_before = thread_ns(process.pid), postgres_ns(postmaster)
        measured = run_wrk(url + "/orders", script, args.seconds, args.connections, run_id)
        server_after, pg_after = thread_ns(process.pid), postgres_ns(postmaster)
        per = asyncio.run(statements.per_request(dsn, int(measured["requests"]), since))
        if profile is not None:
            profile.wait(timeout=args.seconds + 30)
    finally:
        stop(process)
    requests = measured["requests"]
    server_us = (server_after - server_before) / 1000 / requests
    row = Row(
        mode=mode,
        script=script,
        requests_per_second=measured["rps"],
        server_us=server_us,
        postgres_us=spent(pg_before, pg_after) / 1000 / requests,
        statements=per.get("all", 0.0),
        writes=per.get("writes", 0.0),
        non_2xx=int(measured["non_2xx"]),
    )
    if profile is not None and raw.exists():
        row.split = split_profile(raw, server_us)
    return row


def trips(mode: str, script: str, dsn: str, log: Path) -> float:
    """Round trips to PostgreSQL per request, the store's and the handler's: counted by
    asyncpg's query logger on every connection of the server (BENCH_COUNT=1, see
    bench/app.py), in a short pass of its own, since the logger costs CPU."""
    process, url = serve(mode, {"DATABASE_URL": dsn, "BENCH_COUNT": "1"}, log)
    try:
        run_wrk(url + "/orders", script, 1, 4, uuid.uuid4().hex[:8] + "w")  # warm, uncounted
        before = _count(url)
        measured = run_wrk(url + "/orders", script, 2, 4, uuid.uuid4().hex[:8])
        return (_count(url) - before) / max(measured["requests"], 1)
    finally:
        stop(process)


def _count(url: str) -> int:
    with urllib.request.urlopen(url + "/round-trips", timeout=10) as answer:
        return int(json.loads(answer.read())["round_trips"])


def median(rows: list[Row]) -> Row:
    """Each figure the median of the rounds' (the split too, package by package)."""

    def mid(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    split = {
        name: mid([row.split[name] for row in rows if name in row.split]) for name in rows[0].split
    }
    return Row(
        mode=rows[0].mode,
        script=rows[0].script,
        requests_per_second=mid([row.requests_per_second for row in rows]),
        server_us=mid([row.server_us for row in rows]),
        postgres_us=mid([row.postgres_us for row in rows]),
        statements=mid([row.statements for row in rows]),
        writes=mid([row.writes for row in rows]),
        non_2xx=max(row.non_2xx for row in rows),
        split=split,
    )


def report(rows: list[Row]) -> str:
    by_mode = {(row.mode, row.script): row for row in rows}
    lines = [
        "| mode | requests | req/s | server µs | of which ours | asyncio | asyncpg | the rest "
        "| PostgreSQL µs | round trips | statements | writes |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        split = [f"{row.split[name]:.0f}" if row.split else "" for name in _SPLIT]
        kind = "replays" if row.script == "same_key.lua" else "new keys"
        lines.append(
            f"| {row.mode} | {kind} | {row.requests_per_second:,.0f} | {row.server_us:.0f} | "
            + " | ".join(split)
            + f" | {row.postgres_us:.0f} | {row.round_trips:.1f} | {row.statements:.1f}"
            + f" | {row.writes:.2f} |"
        )
    ratios = ["", "| mode | against | throughput | server CPU | PostgreSQL CPU |"]
    ratios.append("| --- | --- | ---: | ---: | ---: |")
    for mode, floor in FLOORS.items():
        ours, theirs = by_mode.get((mode, "new_keys.lua")), by_mode.get((floor, "new_keys.lua"))
        if ours is None or theirs is None:
            continue
        ratios.append(
            f"| {mode} | {floor} | {ours.requests_per_second / theirs.requests_per_second:.2f}x"
            f" | {ours.server_us / theirs.server_us:.2f}x"
            f" | {ours.postgres_us / theirs.postgres_us:.2f}x |"
        )
    return "\n".join(lines + ratios) + "\n"


_SPLIT = ("idempotency_asgi", "asyncio", "asyncpg", "the rest")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--replays", action="store_true", help="also replays of one key")
    parser.add_argument("--rounds", type=int, default=1, help="times each mode is measured")
    parser.add_argument("--profile", action="store_true", help="split the server's CPU (py-spy)")
    parser.add_argument("--native", action="store_true", help="py-spy samples C frames too")
    parser.add_argument("--output", default=str(HERE / "cpu"))
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    database = LocalPostgres(
        Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-")) / "data", keep_data=False
    )
    dsn = os.environ.get("DATABASE_URL") or load_statement_statistics(database)
    log = Path(args.output).with_suffix(".log")
    rows: list[Row] = []
    try:
        asyncio.run(prepare(dsn))
        asyncio.run(statements.enable(dsn))
        runs = [(mode, "new_keys.lua") for mode in args.modes.split(",") if mode]
        if args.replays:
            runs += [(m, "same_key.lua") for m in ("tx", "atomic", "inline-tx")]
        measured: dict[tuple[str, str], list[Row]] = {run: [] for run in runs}
        for _ in range(args.rounds):
            for mode, script in runs:
                row = measure(mode, script, dsn, args, log)
                measured[(mode, script)].append(row)
                print(
                    f"{mode:>14} {script:>13}: {row.requests_per_second:7.0f} req/s, server "
                    f"{row.server_us:4.0f} µs, PostgreSQL {row.postgres_us:4.0f} µs, "
                    f"{row.statements:.1f} statements, {row.writes:.2f} writes per request",
                    flush=True,
                )
        rows = [median(measured[run]) for run in runs]
        for row in rows:
            row.round_trips = trips(row.mode, row.script, dsn, log)
    finally:
        database.stop()
    table = report(rows)
    print(table)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m bench.cpu " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.output).with_suffix(".md").write_text(
        f"# CPU per request, {when}\n\n`{command.strip()}`, {os.cpu_count()} cores\n\n{table}"
    )
    Path(args.output).with_suffix(".json").write_text(
        json.dumps({"when": when, "rows": [asdict(row) for row in rows]}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
