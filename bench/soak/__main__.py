"""`python -m bench.soak`: a million keyed payments against the example, then an audit.

Starts a PostgreSQL on disk (a throwaway data directory under the system's temporary folder,
never /dev/shm: commits wait for the WAL on a real disk), serves `examples.payments.app:app`
with uvicorn (`--workers 4`, uvloop, httptools) with fault injection on and the example's own
background reaper and sweeper running, sends the plan (see plan.py) through `--concurrency`
drivers of a lean keep-alive client (http.py, load.py) while sampling the key table, the
reaper's lag and everyone's CPU every `--interval` seconds (sample.py), then audits every answer
against the database (audit.py, ledger.py). Writes `<output>.json` and `<output>.png`; exits 0
when the audit holds and 1 when it does not, naming the keys.

    python -m bench.soak                       # 1,000,000 requests: tens of minutes
    python -m bench.soak --smoke               # 20,000 requests, output in a temporary folder
    python -m bench.soak --requests 50000 --concurrency 48 --ttl 120
    python -m bench.soak --self-check          # show that the auditor catches each violation

Not a test: nothing in CI runs it, and pytest does not collect it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import asyncpg

from examples.local_postgres import LocalPostgres

from . import ledger, load, plan, report, sample
from .audit import audit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "soak_results"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout:g} s")


def start_server(
    dsn: str, port: int, workers: int, ttl: float, log: Path
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DATABASE_URL": dsn,
        "PAYMENTS_FAULT_INJECTION": "1",
        "IDEMPOTENCY_TTL_SECONDS": f"{ttl:g}",
    }
    env.pop("PAYMENTS_OUTBOX_WORKER", None)  # the events stay in the outbox: the audit counts them
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "examples.payments.app:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--no-access-log",
        "--log-level",
        "warning",
        # A driver's second and third connections sit idle between concurrent keys: keep them
        # open, so that no request races the server closing an idle connection.
        "--timeout-keep-alive",
        "3600",
    ]
    with log.open("wb") as sink:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_server(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


async def postgres_facts(dsn: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        names = (
            "server_version",
            "data_directory",
            "fsync",
            "synchronous_commit",
            "wal_sync_method",
            "shared_buffers",
            "max_connections",
            "autovacuum_naptime",
            "autovacuum_vacuum_scale_factor",
            "autovacuum_vacuum_threshold",
        )
        return {name: await conn.fetchval(f"SHOW {name}") for name in names}
    finally:
        await conn.close()


def _progress(load_: load.Load, samples: list[sample.Sample], total: int, last: list[int]) -> None:
    s = samples[-1]
    done = len(load_.answers)
    rate = (done - last[0]) / (s.t - last[1]) if s.t > last[1] else 0.0
    last[:] = [done, int(s.t)]
    print(
        f"{s.t:7.0f}s  {done:>9,}/{total:,} answered  {rate:6.0f}/s  "
        f"table {s.total_bytes / 1e6:6.1f} MB  live {s.live_tuples:>8,}  "
        f"dead {s.dead_tuples:>8,}  expired waiting {s.expired_waiting:>7,} "
        f"(lag {s.reaper_lag:5.1f}s)  in flight {s.in_flight:>3}  "
        f"cpu client {s.cpu.get('client', 0):.2f} server {s.cpu.get('server', 0):.2f} "
        f"pg {s.cpu.get('postgres', 0):.2f} all {s.cpu.get('machine', 0):.2f}",
        flush=True,
    )


async def drive(
    args: argparse.Namespace,
    dsn: str,
    port: int,
    jobs: list[plan.Job],
    server_pid: int,
    postgres_pid: int,
) -> tuple[load.Load, list[sample.Sample]]:
    cpu = sample.CpuMeter(
        {"client": os.getpid(), "server": server_pid, "postgres": postgres_pid},
        trees=frozenset({"server", "postgres"}),
    )
    samples: list[sample.Sample] = []
    result = load.Load(began=time.perf_counter())
    stop = asyncio.Event()
    last = [0, 0]
    total = sum(j.requests for j in jobs)

    async def sampler() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            cpu.read()
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.interval)
                samples.append(
                    await sample.sample_once(conn, time.perf_counter() - result.began, cpu)
                )
                _progress(result, samples, total, last)
        finally:
            await conn.close()

    sampling = asyncio.create_task(sampler())
    try:
        await load.run(
            jobs,
            "127.0.0.1",
            port,
            concurrency=args.concurrency,
            delay_min=args.delay_min,
            delay_max=args.delay_max,
            seed=args.seed,
            load=result,
        )
    finally:
        stop.set()
        await sampling
    return result, samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=1_000_000, help="requests in all")
    parser.add_argument("--smoke", action="store_true", help="20,000 requests, temporary output")
    parser.add_argument("--concurrency", type=int, default=32, help="drivers (see load.py)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--duplicates", type=float, default=0.10, help="share of requests")
    parser.add_argument("--faults", type=int, default=None, help="default: 3 per 10,000")
    parser.add_argument("--ttl", type=float, default=120.0, help="IDEMPOTENCY_TTL_SECONDS")
    parser.add_argument("--delay-min", type=float, default=1.0)
    parser.add_argument("--delay-max", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds per sample")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--output", type=Path, default=None, help="<output>.json and .png")
    parser.add_argument("--self-check", action="store_true", help="audit fabricated runs")
    args = parser.parse_args(argv)

    if args.self_check:
        from . import selfcheck

        return selfcheck.main()
    if args.smoke:
        args.requests = 20_000
    if args.output is None:
        if args.smoke or args.requests != 1_000_000:
            args.output = Path(tempfile.mkdtemp(prefix="soak-")) / "soak_results"
        else:
            args.output = DEFAULT_OUTPUT
    faults = args.faults if args.faults is not None else max(10, args.requests * 3 // 10_000)
    counts = plan.counts(args.requests, args.duplicates, faults)
    run_id = uuid.uuid4().hex[:8]
    jobs = plan.jobs(run_id, counts, args.seed)
    gc.freeze()  # the plan: a million jobs the collector need never walk
    if args.ttl <= args.delay_max + 30:
        print(
            f"warning: TTL {args.ttl:g} s leaves less than 30 s beyond the longest delay"
            f" ({args.delay_max:g} s): delayed copies may find their key expired",
            file=sys.stderr,
        )
    print(
        f"soak {run_id}: {counts.requests:,} requests, {counts.keys:,} keys "
        f"({counts.singles:,} single, {counts.concurrent_pairs:,} concurrent pairs, "
        f"{counts.concurrent_triples:,} concurrent triples, {counts.delayed:,} delayed, "
        f"{counts.faults:,} faults), {args.workers} workers, {args.concurrency} drivers, "
        f"TTL {args.ttl:g} s",
        flush=True,
    )

    # On disk: the system's temporary folder, not /dev/shm (LocalPostgres.temporary's choice).
    base = Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-", dir="/var/tmp"))
    database = LocalPostgres(base / "data", keep_data=False)
    # Outside the repository: the committed results are the JSON and the plot.
    server_log = Path(tempfile.mkdtemp(prefix="soak-server-")) / "server.log"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    dsn = database.start()
    server = None
    try:
        facts = asyncio.run(postgres_facts(dsn))
        postgres_pid = int((base / "data" / "postmaster.pid").read_text().split()[0])
        port = free_port()
        server = start_server(dsn, port, args.workers, args.ttl, server_log)
        wait_healthy(f"http://127.0.0.1:{port}/healthz")
        time.sleep(2)  # every worker through its startup (schema check, pools)

        try:
            import uvloop

            runner: Any = uvloop.run
        except ImportError:
            runner = asyncio.run
        result, samples = runner(drive(args, dsn, port, jobs, server.pid, postgres_pid))
        elapsed = result.ended - result.began

        async def read_ledger() -> Any:
            conn = await asyncpg.connect(dsn)
            try:
                return await ledger.read(conn, run_id, jobs)
            finally:
                await conn.close()

        audited_at = time.perf_counter()
        held = asyncio.run(read_ledger())
        verdict = audit(jobs, result.answers, held)
        audit_seconds = time.perf_counter() - audited_at
    finally:
        exit_status = stop_server(server) if server is not None else None
        database.stop()

    log_text = server_log.read_text(errors="replace") if server_log.exists() else ""
    rows = report.intervals(result.answers, args.interval)
    taken = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (
        f"{os.cpu_count()} cores, {platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, PostgreSQL {facts['server_version'].split()[0]}"
    )
    summary = verdict.summary(examples=1000)  # per check, in the JSON
    document = {
        "taken": taken,
        "machine": machine,
        "command": " ".join(["python -m bench.soak", *(sys.argv[1:] if argv is None else argv)]),
        "run_id": run_id,
        "settings": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "workers": args.workers,
            "ttl_seconds": args.ttl,
            "lease_seconds": float(os.environ.get("IDEMPOTENCY_LEASE_SECONDS", "10")),
            "delayed_copy_after_seconds": [args.delay_min, args.delay_max],
            "duplicate_share": args.duplicates,
            "sample_interval_seconds": args.interval,
            "seed": args.seed,
            "postgres": facts,
        },
        "plan": asdict(counts),
        "load": {
            "seconds": elapsed,
            "plan_sent_by_seconds": result.exhausted_at,
            "mean_rps": len(result.answers) / elapsed if elapsed else 0.0,
            "longest_delayed_copy_seconds": result.longest_delay,
            "widest_concurrent_spread_ms": result.widest_concurrent_spread * 1000,
            "connections_opened": result.connections_opened,
            "client_max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "latency": report.overall(result.answers),
        },
        "audit": summary,
        "audit_seconds": audit_seconds,
        "figures": report.figures(rows, samples, result.exhausted_at),
        "server": {
            "log": str(server_log),
            "exit_status": exit_status,
            "log_lines": len(log_text.splitlines()),
            "tracebacks": log_text.count("Traceback"),
            "log_tail": log_text.splitlines()[-20:],
        },
        **report.series(rows, samples),
    }
    json_path = args.output.with_suffix(".json")
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    report.plot(
        rows,
        samples,
        args.output.with_suffix(".png"),
        f"soak: {len(result.answers):,} requests, {args.workers} workers, TTL {args.ttl:g} s "
        f"({taken}, {machine})",
        args.ttl,
    )
    print()
    brief = {k: document[k] for k in ("load", "audit", "figures", "server")}
    brief["audit"] = {k: v for k, v in summary.items() if k != "violation_examples"}
    print(json.dumps(brief, indent=1))
    print(f"\nwrote {json_path} and {args.output.with_suffix('.png')}")
    shown: dict[str, int] = {}
    for v in verdict.violations:
        shown[v.check] = shown.get(v.check, 0) + 1
        if shown[v.check] <= 10:
            print(f"  {v.check}: {v.tenant} {v.key}: {v.detail}")
    print("AUDIT PASSED" if verdict.passed else f"AUDIT FAILED: {verdict.by_check()}")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
