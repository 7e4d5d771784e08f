"""`python -m bench.gateway`: the Node orders service called directly, through the gateway, and
through nginx in front of both (examples/gateway/nginx.conf), side by side in one run.

Starts a throwaway PostgreSQL on disk, the Node service (examples/gateway/upstream.js) and the
gateway (`idempotency-asgi gateway`, as the command runs it: one uvicorn worker, on uvloop and
httptools when they are installed; the table says which ran),
then drives each pair with wrk after a warm-up:

    pass-through GET   GET /items                  direct  vs  through the gateway
    keyed new POST     POST /orders, a new key     direct  vs  through the gateway
    keyed replay       POST /orders, one key       direct (the service runs it every time)
                                                   vs  through the gateway (replays)

With nginx installed (`apt-get install nginx-light`; `--no-nginx` to leave it out), the same
three again through nginx: the GET goes from nginx straight to the service, the keyed POSTs
through nginx and then the gateway, as the example config routes them, each against the same
direct figure. New keys once more through a second gateway without the per-tenant key bound
(`--max-keys-per-tenant ''`), last: what the bound's count costs, within the run (every key
of the run is one tenant's).

Prints a table and writes bench/gateway_results.json and .md (with --upstream-delay-ms N,
bench/gateway_results_delay_N.*: the service then waits N ms on each of those requests, as one
that calls a database or a provider would).

    python -m bench.gateway [--seconds 10] [--warmup 3] [--connections 32]
                            [--upstream-delay-ms 0] [--workers 1] [--no-nginx]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.__main__ import free_port, run_wrk, stop, taken_on, wait_http
from examples.gateway import nginx
from examples.local_postgres import LocalPostgres
from idempotency_asgi import migrate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: name, path, wrk script, mode (the script's second argument), what the target is
PAIRS = [
    ("pass-through GET", "/items", "gateway_get.lua", "", 0.7),
    ("keyed new POST", "/orders", "gateway_orders.lua", "new", 0.5),
    ("keyed replay", "/orders", "gateway_orders.lua", "same", 1.0),
]


#: The same requests through nginx: what each row's "through" goes through.
VIA = {"pass-through GET": "nginx -> service", "keyed new POST": "nginx -> gateway"}


@dataclass
class Pair:
    name: str
    through: str
    direct_rps: float
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_rps: float
    gateway_p50_ms: float
    gateway_p99_ms: float
    gateway_non_2xx: int
    ratio: float
    target: float


def start_upstream(port: int, delay_ms: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        ["node", str(ROOT / "examples" / "gateway" / "upstream.js")],
        env={
            **os.environ,
            "PORT": str(port),
            "HOST": "127.0.0.1",
            "UPSTREAM_DELAY_MS": str(delay_ms),
        },
        stdout=subprocess.DEVNULL,
    )
    wait_http(f"http://127.0.0.1:{port}/health")
    return process


def start_gateway(
    upstream: str, dsn: str, port: int, workers: int, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "idempotency_asgi",
            "gateway",
            "--upstream",
            upstream,
            "--database-url",
            dsn,
            "--port",
            str(port),
            "--tenant-header",
            "x-tenant",
            "--workers",
            str(workers),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    wait_http(f"http://127.0.0.1:{port}/_idempotency/health")
    return process


def measure(url: str, script: str, mode: str, args: argparse.Namespace) -> dict[str, float]:
    run_id = uuid.uuid4().hex[:8]
    # New keys: another run id for the warm-up, so that the measured run repeats none of its
    # keys. One key: the same, so that the measured run is all replays.
    warmup_id = run_id if mode == "same" else run_id + "w"
    run_wrk(url, script, args.warmup, args.connections, f"{warmup_id}/{mode}")
    return run_wrk(url, script, args.seconds, args.connections, f"{run_id}/{mode}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--upstream-delay-ms", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    parser.add_argument(
        "--nginx",
        action=argparse.BooleanOptionalAction,
        default=nginx.available(),
        help="also measure through nginx in front (default: when nginx is installed)",
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.output is None:
        suffix = f"_delay_{args.upstream_delay_ms}" if args.upstream_delay_ms else ""
        args.output = str(HERE / f"gateway_results{suffix}")
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    if shutil.which("node") is None:
        print("node is not installed", file=sys.stderr)
        return 2
    database = LocalPostgres(
        Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-")) / "data", keep_data=False
    )
    dsn = os.environ.get("DATABASE_URL") or database.start()
    upstream_port, gateway_port, front_port = free_port(), free_port(), free_port()
    unbounded_port = free_port()
    upstream = gateway = unbounded = None
    front: nginx.Nginx | None = None
    pairs: list[Pair] = []
    try:
        asyncio.run(migrate(dsn))
        upstream = start_upstream(upstream_port, args.upstream_delay_ms)
        direct_url = f"http://127.0.0.1:{upstream_port}"
        gateway = start_gateway(direct_url, dsn, gateway_port, args.workers)
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        unbounded = start_gateway(
            direct_url,
            dsn,
            unbounded_port,
            args.workers,
            env={
                "IDEMPOTENCY_GATEWAY_MAX_KEYS_PER_TENANT": "",
                "IDEMPOTENCY_GATEWAY_MAINTENANCE": "0",
            },
        )
        if args.nginx:
            front = nginx.Nginx(listen=front_port, gateway=gateway_port, service=upstream_port)
            front.start()
        routes = [("gateway", gateway_url)]
        if front is not None:
            routes.append(("nginx", front.url))
        for name, path, script, mode, target in PAIRS:
            direct = measure(direct_url + path, script, mode, args)
            extra = [("unbounded", f"http://127.0.0.1:{unbounded_port}")] if mode == "new" else []
            for route, url in routes + extra:
                through = measure(url + path, script, mode, args)
                pair = Pair(
                    name,
                    VIA.get(name, "nginx -> gateway")
                    if route == "nginx"
                    else ("gateway, no key bound" if route == "unbounded" else "gateway"),
                    direct["rps"],
                    direct["p50"],
                    direct["p99"],
                    through["rps"],
                    through["p50"],
                    through["p99"],
                    int(through["non_2xx"]),
                    through["rps"] / direct["rps"],
                    target,
                )
                pairs.append(pair)
                print(
                    f"{name:>17}: direct {pair.direct_rps:8.0f} req/s, {pair.through} "
                    f"{pair.gateway_rps:8.0f} req/s ({pair.ratio:.2f}x, target {target})",
                    flush=True,
                )
    finally:
        if front is not None:
            front.stop()
        for process in (gateway, unbounded, upstream):
            if process is not None:
                stop(process)
        database.stop()
    report(pairs, args)
    return 0


def report(pairs: list[Pair], args: argparse.Namespace) -> None:
    taken, machine = taken_on()
    machine += f", node {node_version()}"
    lines = [
        f"Taken {taken} on {machine}; wrk -t1 -c{args.connections}, {args.seconds:g} s after "
        f"a {args.warmup:g} s warm-up; gateway workers: {args.workers} ({server_stack()}); "
        f"the service waits {args.upstream_delay_ms} ms per request.",
        "",
        "| request | through | direct req/s | through req/s | through / direct | target | "
        "direct p50 / p99 ms | through p50 / p99 ms | through non-2xx |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in pairs:
        lines.append(
            f"| {p.name} | {p.through} | {p.direct_rps:,.0f} | {p.gateway_rps:,.0f} | "
            f"{p.ratio:.2f} | "
            f"{p.target:g} | {p.direct_p50_ms:.2f} / {p.direct_p99_ms:.2f} | "
            f"{p.gateway_p50_ms:.2f} / {p.gateway_p99_ms:.2f} | {p.gateway_non_2xx} |"
        )
    table = "\n".join(lines)
    print()
    print(table)
    output = Path(args.output)
    output.with_suffix(".json").write_text(
        json.dumps(
            {"taken": taken, "machine": machine, "pairs": [asdict(p) for p in pairs]}, indent=2
        )
    )
    output.with_suffix(".md").write_text(table + "\n")


def server_stack() -> str:
    """What uvicorn's "auto" picks for the gateway (the same interpreter runs it)."""
    import importlib.metadata
    import importlib.util

    def version(name: str) -> str | None:
        if importlib.util.find_spec(name) is None:
            return None
        return f"{name} {importlib.metadata.version(name)}"

    loop = version("uvloop") or "asyncio"
    parser = version("httptools") or f"h11 {importlib.metadata.version('h11')}"
    return f"{loop}, {parser}"


def node_version() -> str:
    return subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
