"""`python -m bench`: one run, one machine, every configuration side by side.

Starts a throwaway PostgreSQL (on disk, so commits really wait for the WAL, with
pg_stat_statements loaded), and Redis for the Redis-backed peer when `redis-server` is
installed; serves the same endpoint with uvicorn (one worker, uvloop + httptools) in each
configuration; drives it with wrk (a C load generator, so the client is not the bottleneck)
after a warm-up; then counts the statements each outcome makes PostgreSQL run (see
bench/statements.py); prints both tables and writes bench/results.json and bench/results.png.

    python -m bench [--seconds 10] [--warmup 3] [--connections 32] [--only bare,tx]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import asyncpg
import httpx

from bench import statements
from bench.app import INLINE_TABLE
from examples.local_postgres import LocalPostgres
from idempotency_asgi import migrate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Config:
    name: str
    mode: str  # BENCH_MODE (bench/app.py)
    script: str  # the wrk script
    description: str
    env: tuple[tuple[str, str], ...] = ()
    #: paced at a quarter of bare's throughput (its p50 is the row's point), not saturated
    quarter: bool = False
    #: wrk's connections, when not the run's (a storm of one key)
    connections: int | None = None


_ONE_EACH = (("BENCH_BATCH", "0"),)

CONFIGS = [
    Config("bare", "bare", "new_keys.lua", "no middleware"),
    Config("plain new keys", "plain", "new_keys.lua", "IdempotencyMiddleware, new key each"),
    Config(
        "plain new keys (unbatched)",
        "plain",
        "new_keys.lua",
        "the same, one store statement per request (batch=False)",
        _ONE_EACH,
    ),
    Config("tx new keys", "tx", "new_keys.lua", "same, INSERT through connection(request)"),
    Config(
        "tx new keys (unbatched)",
        "tx",
        "new_keys.lua",
        "the same, one store statement per request (batch=False)",
        _ONE_EACH,
    ),
    Config(
        "atomic new keys",
        "atomic",
        "new_keys.lua",
        "atomic=True: the claim, the INSERT and the record in one transaction",
    ),
    Config(
        "atomic new keys (unbatched)",
        "atomic",
        "new_keys.lua",
        "the same, one store statement per request (batch=False)",
        _ONE_EACH,
    ),
    Config("inline plain new keys", "inline-plain", "new_keys.lua", "hand-written floor, plain"),
    Config("inline tx new keys", "inline-tx", "new_keys.lua", "hand-written floor, two commits"),
    Config(
        "inline atomic new keys",
        "inline-atomic",
        "new_keys.lua",
        "hand-written floor, one transaction: lock, read, INSERT, record, COMMIT",
    ),
    Config("replays", "tx", "same_key.lua", "one completed key, replayed"),
    Config("atomic replays", "atomic", "same_key.lua", "one completed key, the atomic mode"),
    Config("inline replays", "inline-tx", "same_key.lua", "hand-written floor, replays"),
    Config(
        "replays, a storm of 256",
        "tx",
        "same_key.lua",
        "one completed key, 256 connections at once",
        connections=256,
    ),
    Config(
        "replays, a storm of 256 (unbatched)",
        "tx",
        "same_key.lua",
        "the same, one store statement per request (batch=False)",
        _ONE_EACH,
        connections=256,
    ),
    Config(
        "inline replays, a storm of 256",
        "inline-tx",
        "same_key.lua",
        "hand-written floor, 256 connections",
        connections=256,
    ),
    Config("bare at quarter load", "bare", "paced_new_keys.lua", "no middleware", quarter=True),
    Config(
        "plain new keys at quarter load",
        "plain",
        "paced_new_keys.lua",
        "batching on (the default)",
        quarter=True,
    ),
    Config(
        "plain new keys at quarter load (unbatched)",
        "plain",
        "paced_new_keys.lua",
        "batch=False: the latency before batching",
        _ONE_EACH,
        quarter=True,
    ),
    Config(
        "tx new keys at quarter load",
        "tx",
        "paced_new_keys.lua",
        "batching on (the default)",
        quarter=True,
    ),
    Config("idemkit new keys", "idemkit", "new_keys.lua", "idemkit + the same PostgreSQL"),
    Config("idemkit replays", "idemkit", "same_key.lua", "idemkit + the same PostgreSQL"),
    Config("redis peer new keys", "peer", "new_keys.lua", "asgi-idempotency-header + Redis"),
    Config("redis peer replays", "peer", "same_key.lua", "asgi-idempotency-header + Redis"),
]

#: Connections for the paced rows: each waits between its requests, so that together they
#: ask for a quarter of what bare served.
PACED_CONNECTIONS = 8


@dataclass
class Result:
    name: str
    description: str
    requests_per_second: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    ratio_to_bare: float = 0.0
    #: store statements PostgreSQL ran per request during the run (pg_stat_statements)
    claims_per_request: float | None = None
    completions_per_request: float | None = None
    statements_per_request: float | None = None
    #: write transactions per request (the next transaction id's advance)
    writes_per_request: float | None = None


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def parse_duration_ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def run_wrk(
    url: str, script: str, seconds: float, connections: int, run_id: str, *extra: str
) -> dict[str, float]:
    output = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{round(seconds)}s",
            "--latency",
            "-s",
            str(HERE / script),
            url,
            "--",
            run_id,
            *extra,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    p50 = parse_duration_ms(re.search(r"\s50%\s+(\S+)", output).group(1))  # type: ignore[union-attr]
    p99 = parse_duration_ms(re.search(r"\s99%\s+(\S+)", output).group(1))  # type: ignore[union-attr]
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    total = int(re.search(r"(\d+) requests in", output).group(1))  # type: ignore[union-attr]
    return {
        "rps": rps,
        "p50": p50,
        "p99": p99,
        "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
        "requests": total,
    }


def serve(
    mode: str, env: dict[str, str], log: Path, launcher: tuple[str, ...] = ("-m", "uvicorn")
) -> tuple[subprocess.Popen[bytes], str]:
    """uvicorn serving bench/app.py in `mode`, started by `python *launcher` (uvicorn's own
    command line by default), once it answers."""
    port = free_port()
    # Its stderr goes to a file: wrk stops mid-request, and the disconnects are noise here.
    process = subprocess.Popen(
        [
            sys.executable,
            *launcher,
            "bench.app:app",
            "--port",
            str(port),
            "--workers",
            "1",
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env={**os.environ, **env, "BENCH_MODE": mode},
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/")
    return process, url


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def prepare(dsn: str) -> None:
    await migrate(dsn)
    if importlib.util.find_spec("idemkit") is not None:
        # The peer's own table, on the same server, made by its own command.
        command = [sys.executable, "-m", "idemkit.cli", "init-pg", dsn]
        await asyncio.to_thread(subprocess.run, command, check=True, capture_output=True)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, payload bytea,"
            " created_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute(INLINE_TABLE)
    finally:
        await conn.close()


def start_redis() -> tuple[subprocess.Popen[bytes], str] | None:
    if shutil.which("redis-server") is None:
        return None
    try:
        import idempotency_header_middleware  # noqa: F401
        import redis  # noqa: F401
    except ImportError:
        return None
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    return process, f"redis://127.0.0.1:{port}/0"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--output", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2

    database = LocalPostgres(
        Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-")) / "data", keep_data=False
    )
    dsn = os.environ.get("DATABASE_URL") or load_statement_statistics(database)
    redis = start_redis()
    results: list[Result] = []
    Path(args.output).with_suffix(".log").unlink(missing_ok=True)
    try:
        asyncio.run(prepare(dsn))
        only = {name.strip() for name in args.only.split(",") if name.strip()}
        counting = asyncio.run(statements.enable(dsn))
        bare_rps = 0.0
        for config in CONFIGS:
            name, mode = config.name, config.mode
            if only and name not in only:
                continue
            if mode == "peer" and redis is None:
                print(f"skipping {name}: redis-server or asgi-idempotency-header missing")
                continue
            if mode == "idemkit" and importlib.util.find_spec("idemkit") is None:
                print(f"skipping {name}: idemkit is not installed")
                continue
            if config.quarter and not bare_rps:
                print(f"skipping {name}: it is paced from bare's throughput, not measured")
                continue
            env = {"DATABASE_URL": dsn, **dict(config.env)}
            if redis is not None:
                env["REDIS_URL"] = redis[1]
            connections, extra = config.connections or args.connections, ()
            if config.quarter:
                # Each connection pauses so that together they ask for bare's rate / 4.
                connections = PACED_CONNECTIONS
                extra = (f"{1000 * connections / (bare_rps / 4):.2f}",)
            process, url = serve(mode, env, Path(args.output).with_suffix(".log"))
            try:
                run_id = uuid.uuid4().hex[:8]
                run_wrk(
                    url + "/orders", config.script, args.warmup, connections, run_id + "w", *extra
                )
                since = asyncio.run(statements.reset(dsn)) if counting else 0
                measured = run_wrk(
                    url + "/orders", config.script, args.seconds, connections, run_id, *extra
                )
                per_request = (
                    asyncio.run(statements.per_request(dsn, measured["requests"], since))
                    if counting
                    else {}
                )
            finally:
                stop(process)
            if name == "bare":
                bare_rps = measured["rps"]
            results.append(
                Result(
                    name,
                    config.description,
                    measured["rps"],
                    measured["p50"],
                    measured["p99"],
                    int(measured["non_2xx"]),
                    claims_per_request=per_request.get("claim", 0) + per_request.get("look", 0),
                    completions_per_request=per_request.get("completion", 0)
                    + per_request.get("record", 0),
                    statements_per_request=per_request.get("all"),
                    writes_per_request=per_request.get("writes"),
                )
            )
            print(
                f"{name:>40}: {measured['rps']:8.0f} req/s  p50 {measured['p50']:6.2f} ms  "
                f"p99 {measured['p99']:6.2f} ms",
                flush=True,
            )
        counts = count_statements(dsn, Path(args.output).with_suffix(".log"))
    finally:
        if redis is not None:
            redis[0].terminate()
            redis[0].wait()
        database.stop()

    bare = next((r for r in results if r.name == "bare"), None)
    for result in results:
        result.ratio_to_bare = result.requests_per_second / bare.requests_per_second if bare else 0
    report(results, counts, args)
    return 0


def load_statement_statistics(database: LocalPostgres) -> str:
    """Start the throwaway server with pg_stat_statements loaded (it needs a restart)."""
    dsn = database.start()

    async def configure() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        finally:
            await conn.close()

    asyncio.run(configure())
    return database.restart()


@contextlib.contextmanager
def statistics_server() -> Iterator[str]:
    """A throwaway server with pg_stat_statements loaded and the schema applied: its URL."""
    database = LocalPostgres(
        Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-")) / "data", keep_data=False
    )
    try:
        dsn = load_statement_statistics(database)
        asyncio.run(prepare(dsn))
        yield dsn
    finally:
        database.stop()


def count_statements(dsn: str, log: Path) -> list[statements.Count]:
    if not asyncio.run(statements.enable(dsn)):
        print("statement counts skipped: pg_stat_statements is not loaded in this server")
        return []
    counts = []
    for mode in dict.fromkeys(statements.OUTCOMES.values()):
        process, url = serve(mode, {"DATABASE_URL": dsn}, log)
        try:
            for outcome, served in statements.OUTCOMES.items():
                if served == mode:
                    counts.append(asyncio.run(statements.count(dsn, url, outcome)))
        finally:
            stop(process)
    return counts


def taken_on() -> tuple[str, str]:
    """When (UTC, to the minute) and on what a run was taken, for its report."""
    taken = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (
        f"{os.cpu_count()} cores, {platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}"
    )
    return taken, machine


def report(results: list[Result], counts: list[statements.Count], args: argparse.Namespace) -> None:
    taken, machine = taken_on()
    lines = [
        f"Taken {taken} on {machine}; wrk -t1 -c{args.connections}, {args.seconds:g} s after a "
        f"{args.warmup:g} s warm-up.",
        "",
        "| configuration | req/s | p50 ms | p99 ms | vs bare | non-2xx |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.requests_per_second:,.0f} | {r.p50_ms:.2f} | "
            f"{r.p99_ms:.2f} | {r.ratio_to_bare:.2f} | {r.non_2xx} |"
        )
    lines += goals(results)
    loaded = [r for r in results if r.statements_per_request]
    if loaded:
        lines += [
            "",
            "Statements and write transactions per request during each run",
            "(pg_stat_statements, and the next transaction id's advance; under load a",
            "batched statement carries many requests' rows, and a storm's one row many",
            "requests). Claims are the atomic mode's first looks there; completions its",
            "records:",
            "",
            "| configuration | claims | completions | all statements | write transactions |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for r in loaded:
            lines.append(
                f"| {r.name} | {r.claims_per_request or 0:.2f} | "
                f"{r.completions_per_request or 0:.2f} | {r.statements_per_request or 0:.2f} | "
                f"{r.writes_per_request or 0:.2f} |"
            )
    if counts:
        lines += [
            "",
            "Statements PostgreSQL ran per request (pg_stat_statements; asyncpg's session reset",
            "is four statements sent in one round trip, the store's reset of a lent connection",
            "seven, sent in its COMMIT's round trip):",
            "",
            "| outcome | statements | write transactions | the statements |",
            "| --- | ---: | ---: | --- |",
        ]
        for count in counts:
            named = "; ".join(f"{name} x{calls:g}" for name, calls in count.statements)
            lines.append(
                f"| {count.outcome} | {count.per_request:.2f} | {count.writes:.2f} | {named} |"
            )
    table = "\n".join(lines)
    print()
    print(table)
    output = Path(args.output)
    output.with_suffix(".json").write_text(
        json.dumps(
            {
                "taken": taken,
                "machine": machine,
                "results": [asdict(r) for r in results],
                "statements": [asdict(c) for c in counts],
            },
            indent=2,
        )
    )
    output.with_suffix(".md").write_text(table + "\n")
    plot(results, output.with_suffix(".png"), f"{taken}, {machine}")


#: configuration -> its least ratio to bare (0: none, the ratio is reported)
GOALS = {
    "plain new keys": 0.55,
    "tx new keys": 0.42,
    "atomic new keys": 0.0,
    "replays": 1.00,
    "atomic replays": 1.00,
}

#: configuration -> (the hand-written floor it is set against, the least ratio to it)
FLOORS = {
    "plain new keys": ("inline plain new keys", 0.9),
    "tx new keys": ("inline tx new keys", 0.85),
    "atomic new keys": ("inline atomic new keys", 0.9),
    "replays": ("inline replays", 0.0),
    "atomic replays": ("inline replays", 0.0),
}


def goals(results: list[Result]) -> list[str]:
    """The project's targets against this run: throughput against bare and against the
    hand-written floor, replays' p99 against bare's, and the p50 at a quarter of bare's
    throughput against the same without batching."""
    by_name = {r.name: r for r in results}
    bare = by_name.get("bare")
    if bare is None:
        return []
    lines = ["", "Targets, in this run:", ""]

    def verdict(value: float, goal: float) -> str:
        return "met" if value >= goal else f"missed by {goal - value:.2f}"

    for name, goal in GOALS.items():
        r = by_name.get(name)
        if r is None:
            continue
        line = f"- {name}: {r.ratio_to_bare:.2f} of bare"
        if goal:
            line += f" (target {goal:.2f}: {verdict(r.ratio_to_bare, goal)})"
        if name.endswith("replays"):
            worse = r.p99_ms > bare.p99_ms
            line += (
                f"; p99 {r.p99_ms:.2f} ms against bare's {bare.p99_ms:.2f} "
                f"({'worse' if worse else 'no worse'})"
            )
        floor_name, least = FLOORS.get(name, ("", 0.0))
        floor = by_name.get(floor_name)
        if floor is not None and floor.requests_per_second:
            times = r.requests_per_second / floor.requests_per_second
            line += f"; {times:.2f}x the hand-written floor"
            if least:
                line += f" (target {least:.2f}x: {verdict(times, least)})"
            if name.endswith("replays"):
                worse = r.p99_ms > floor.p99_ms
                line += (
                    f", p99 {r.p99_ms:.2f} ms against its {floor.p99_ms:.2f} "
                    f"({'worse' if worse else 'no worse'})"
                )
        lines.append(line)
    atomic, two_commits = by_name.get("atomic new keys"), by_name.get("inline tx new keys")
    if atomic is not None and two_commits is not None and two_commits.requests_per_second:
        times = atomic.requests_per_second / two_commits.requests_per_second
        lines.append(
            f"- atomic new keys: {times:.2f}x the two-commit hand-written floor (target: above "
            f"1.00: {'met' if times > 1.0 else 'missed'})"
        )
    storm, alone = (
        by_name.get("replays, a storm of 256"),
        by_name.get("replays, a storm of 256 (unbatched)"),
    )
    if storm is not None and alone is not None and alone.requests_per_second:
        times = storm.requests_per_second / alone.requests_per_second
        lines.append(
            f"- a storm of replays of one key (256 connections): batched {times:.2f}x the "
            f"unbatched throughput, {storm.non_2xx} answers not 2xx"
        )
    for name in ("plain new keys", "tx new keys", "atomic new keys"):
        batched, single = by_name.get(name), by_name.get(f"{name} (unbatched)")
        if batched is not None and single is not None and single.requests_per_second:
            gain = batched.requests_per_second / single.requests_per_second
            lines.append(f"- {name}: batching gives {gain:.2f}x the unbatched throughput")
    paced, unbatched = (
        by_name.get("plain new keys at quarter load"),
        by_name.get("plain new keys at quarter load (unbatched)"),
    )
    if paced is not None and unbatched is not None:
        worse = paced.p50_ms > unbatched.p50_ms
        lines.append(
            f"- at a quarter of bare's throughput, plain new keys: p50 {paced.p50_ms:.2f} ms "
            f"batched against {unbatched.p50_ms:.2f} unbatched "
            f"({'worse' if worse else 'no worse'})"
        )
    ours = {"new keys": by_name.get("tx new keys"), "replays": by_name.get("replays")}
    for peer in ("idemkit", "redis peer"):
        for outcome, mine in ours.items():
            theirs = by_name.get(f"{peer} {outcome}")
            if mine is not None and theirs is not None and theirs.requests_per_second:
                times = mine.requests_per_second / theirs.requests_per_second
                lines.append(f"- against {peer}, {outcome}: {times:.2f}x its throughput")
    return lines


def plot(results: list[Result], path: Path, subtitle: str) -> None:
    from bench.figures import results_figure

    shown = [
        {
            "name": r.name,
            "requests_per_second": r.requests_per_second,
            "p99_ms": r.p99_ms,
            "ratio_to_bare": r.ratio_to_bare,
        }
        for r in results
    ]
    results_figure(shown, path, f"idempotency-asgi benchmark ({subtitle})", "light")


if __name__ == "__main__":
    sys.exit(main())
