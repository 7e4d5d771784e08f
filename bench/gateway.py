"""`python -m bench.gateway`: the Node orders service called directly, through the gateway,
through nginx in front of both (examples/gateway/nginx.conf), and through a peer gateway
when its binary is given, side by side in one run.

Starts a throwaway PostgreSQL on disk (with pg_stat_statements), the Node service
(examples/gateway/upstream.js) and the gateway (`idempotency-asgi gateway`, as the command
runs it: on uvloop and httptools when they are installed; the table says which ran), then
drives each with wrk after a warm-up:

    pass-through GET   GET /items                  direct  vs  through the gateway
    keyed new POST     POST /orders, a new key     direct  vs  through the gateway
    keyed replay       POST /orders, one key       direct (the service runs it every time)
                                                   vs  through the gateway (replays)

With nginx installed (`apt-get install nginx-light`; `--no-nginx` to leave it out), the same
three again through nginx: the GET goes from nginx straight to the service, the keyed POSTs
through nginx and then the gateway, as the example config routes them, each against the same
direct figure. New keys once more through a second gateway without the per-tenant key bound
(`--max-keys-per-tenant ''`): what the bound's count costs, within the run (every key of a
measured run is one tenant's, the run's own).

With `--peer PATH`, the same three through that binary too: a Go reverse proxy with the same
contract for one tenant and a file store (idemgate; docs/gateway.md says how to build it).
It is started as `PATH serve --upstream URL --listen ADDR --store DIR --methods POST,PATCH`.

Then a 10 MB answer through the gateway, from an upstream of the benchmark's own (a bare
socket in a thread of this process, so that only the gateway's CPU is counted): once with a
Content-Length, once in 80-byte chunks (an export written row by row), and the gateway's CPU
for each (`--answer-downloads` of each, 5 by default; 0 leaves it out).

For each keyed row, the statements PostgreSQL ran per request during the measured run
(pg_stat_statements: the store's claims and completions, and all of them); for each row
through the gateway, the CPU time per request of the gateway's processes and of PostgreSQL's
(from /proc: what the machine spends, whatever the wall clock says). Last, the
gateway's memory per open connection: idle ones, and ones trickling a body past the memory
buffer (`/proc/<pid>/status` before and after; with one worker only).

With `--rounds N`, each request is measured N times on every route, one route after the other
in each round, and each row is the run with the median throughput (the table lists every
round's): on a shared machine one run moves by a third.

Prints the tables and writes bench/gateway_results.json and .md (with --upstream-delay-ms N,
bench/gateway_results_delay_N.*: the service then waits N ms on each of those requests, as
one that calls a database or a provider would; with --workers N, _workers_N).

    python -m bench.gateway [--seconds 10] [--warmup 3] [--connections 32]
                            [--upstream-delay-ms 0] [--workers 1] [--no-nginx]
                            [--peer PATH] [--memory-connections 100] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import statements
from bench.__main__ import (
    free_port,
    load_statement_statistics,
    run_wrk,
    stop,
    taken_on,
    wait_http,
)
from examples.gateway import nginx
from examples.local_postgres import LocalPostgres
from idempotency_asgi import migrate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: name, path, wrk script, mode (the script's second argument), what the target is
PAIRS = [
    ("pass-through GET", "/items", "gateway_get.lua", "", 0.7),
    ("keyed new POST", "/orders", "gateway_orders.lua", "new", 0.75),
    ("keyed replay", "/orders", "gateway_orders.lua", "same", 1.0),
]

#: What each row's "through" goes through, by route.
VIA = {
    "gateway": "gateway",
    "unbounded": "gateway, no key bound",
    "peer": "peer (Go)",
}
NGINX_VIA = {"pass-through GET": "nginx -> service"}


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
    #: statements PostgreSQL ran per request during the run: all, claims, completions
    statements: dict[str, float] = field(default_factory=dict)
    #: CPU time per request during the run, in ms: the gateway's processes, PostgreSQL's
    cpu_ms: dict[str, float] = field(default_factory=dict)
    #: req/s of every round, when there were several (the row is the median one's)
    rounds: list[int] = field(default_factory=list)


@dataclass
class Answers:
    """The gateway's CPU for one 10 MB answer, in ms: with a Content-Length, in chunks."""

    downloads: int
    with_length_ms: float
    chunked_ms: float
    chunk_bytes: int


@dataclass
class Memory:
    connections: int
    idle_kib_each: float
    trickling_kib_each: float


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


def start_peer(binary: str, upstream: str, port: int, store: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            binary,
            "serve",
            "--upstream",
            upstream,
            "--listen",
            f"127.0.0.1:{port}",
            "--store",
            str(store),
            "--methods",
            "POST,PATCH",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_http(f"http://127.0.0.1:{port}/health")  # passed through to the service
    return process


def measure(url: str, script: str, mode: str, args: argparse.Namespace) -> dict[str, float]:
    run_id = uuid.uuid4().hex[:8]
    # New keys: another run id for the warm-up, so that the measured run repeats none of its
    # keys. One key: the same, so that the measured run is all replays. (The run id names the
    # tenant too: a run's keys are its tenant's, whatever ran before.)
    warmup_id = run_id if mode == "same" else run_id + "w"
    run_wrk(url, script, args.warmup, args.connections, f"{warmup_id}/{mode}")
    return run_wrk(url, script, args.seconds, args.connections, f"{run_id}/{mode}")


def median_rps(runs: list[tuple[dict[str, float], dict[str, float], dict[str, float]]]) -> float:
    return statistics.median(run[0]["rps"] for run in runs)


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    middle = statistics.median(run["rps"] for run in runs)
    return min(runs, key=lambda run: abs(run["rps"] - middle))


def counted(
    url: str, script: str, mode: str, args: argparse.Namespace, dsn: str | None, pid: int
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """`measure`, the statements per request PostgreSQL ran in the measured run, and the CPU
    time per request of the gateway (`pid` and its children) and of PostgreSQL."""
    run_id = uuid.uuid4().hex[:8]
    warmup_id = run_id if mode == "same" else run_id + "w"
    run_wrk(url, script, args.warmup, args.connections, f"{warmup_id}/{mode}")
    if dsn is not None:
        asyncio.run(statements.reset(dsn))
    before = cpu_seconds(pid)
    result = run_wrk(url, script, args.seconds, args.connections, f"{run_id}/{mode}")
    after = cpu_seconds(pid)
    requests = int(result["requests"])
    cpu = {name: (after[name] - before[name]) * 1000 / requests for name in after}
    counts = {} if dsn is None else asyncio.run(statements.per_request(dsn, requests))
    return result, counts, cpu


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time used so far (user and system) by `pid` with its children, and by every
    process named postgres, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = {"gateway": 0.0, "postgres": 0.0}
    parents: dict[int, int] = {}
    times: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    for process, (name, seconds) in times.items():
        ancestor = process
        while ancestor not in (pid, 0, 1) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor == pid:
            used["gateway"] += seconds
        elif name == "postgres":
            used["postgres"] += seconds
    return used


ANSWER_BYTES = 10_000_000


def answer_cpu(dsn: str, downloads: int, chunk: int = 80) -> Answers:
    """The gateway's CPU per 10 MB answer, with a Content-Length and in `chunk`-byte chunks,
    from an upstream on a bare socket in a thread of this process."""
    import socketserver
    import threading

    import httpx

    body = (b'{"row":1234567,"name":"an order row","amount":1999}\n' * 200_000)[:ANSWER_BYTES]
    with_length = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    head = b"%x\r\n" % chunk
    chunks = [head + body[i : i + chunk] + b"\r\n" for i in range(0, len(body), chunk)]
    in_chunks = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(chunks) + b"0\r\n\r\n"
    )

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            while line := self.rfile.readline():
                target = line.split()[1] if len(line.split()) > 1 else b""
                while self.rfile.readline() not in (b"\r\n", b""):
                    pass
                self.wfile.write(in_chunks if target == b"/chunked" else with_length)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = free_port()
    gateway = start_gateway(f"http://127.0.0.1:{server.server_address[1]}", dsn, port, 1)
    spent = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            for path in ("/length", "/chunked"):
                assert len(http.get(path).content) == len(body)  # warm
                before = cpu_seconds(gateway.pid)["gateway"]
                for _ in range(downloads):
                    assert len(http.get(path).content) == len(body)
                spent[path] = (cpu_seconds(gateway.pid)["gateway"] - before) * 1000 / downloads
    finally:
        stop(gateway)
        server.shutdown()
        server.server_close()
    return Answers(downloads, spent["/length"], spent["/chunked"], chunk)


def connection_memory(port: int, pid: int, count: int) -> Memory:
    """The gateway's resident memory per connection: `count` idle ones (connected, nothing
    sent), then `count` that sent all but 1 KiB of a 1 MiB body and then a byte."""

    def resident() -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def opened(first: bytes) -> list[socket.socket]:
        held = []
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port))
            if first:
                sock.sendall(first)
            held.append(sock)
        return held

    each = []
    size = 1024 * 1024
    head = b"PUT /upload HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % size
    trickling = head + b"t" * (size - 1024)
    for first in (b"", trickling):
        time.sleep(1.0)
        before = resident()
        held = opened(first)
        try:
            time.sleep(2.0)  # all of it read
            if first:
                for sock in held:
                    sock.send(b"t")
                time.sleep(1.0)
            each.append((resident() - before) / count)
        finally:
            for sock in held:
                sock.close()
    return Memory(count, each[0], each[1])


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
    parser.add_argument("--peer", default=None, help="a peer gateway's binary (idemgate)")
    parser.add_argument("--memory-connections", type=int, default=100)
    parser.add_argument("--answer-downloads", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure every route this many times, in turn"
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.output is None:
        suffix = f"_delay_{args.upstream_delay_ms}" if args.upstream_delay_ms else ""
        suffix += f"_workers_{args.workers}" if args.workers != 1 else ""
        args.output = str(HERE / f"gateway_results{suffix}")
    for command in ("wrk", "node"):
        if shutil.which(command) is None:
            print(f"{command} is not installed", file=sys.stderr)
            return 2
    if args.peer and not os.access(args.peer, os.X_OK):
        print(f"--peer {args.peer}: not an executable", file=sys.stderr)
        return 2
    database = LocalPostgres(
        Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-")) / "data", keep_data=False
    )
    dsn = os.environ.get("DATABASE_URL") or load_statement_statistics(database)
    peer_store = Path(tempfile.mkdtemp(prefix="idempotency-asgi-peer-"))
    upstream_port, gateway_port, front_port = free_port(), free_port(), free_port()
    unbounded_port, peer_port = free_port(), free_port()
    processes: list[subprocess.Popen[bytes]] = []
    front: nginx.Nginx | None = None
    pairs: list[Pair] = []
    memory: Memory | None = None
    answers: Answers | None = None
    try:
        asyncio.run(migrate(dsn))
        counting = dsn if asyncio.run(statements.enable(dsn)) else None
        upstream = start_upstream(upstream_port, args.upstream_delay_ms)
        processes.append(upstream)
        direct_url = f"http://127.0.0.1:{upstream_port}"
        gateway = start_gateway(direct_url, dsn, gateway_port, args.workers)
        processes.append(gateway)
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
        processes.append(unbounded)
        routes = [("gateway", f"http://127.0.0.1:{gateway_port}")]
        peer: subprocess.Popen[bytes] | None = None
        if args.peer:
            peer = start_peer(args.peer, direct_url, peer_port, peer_store)
            processes.append(peer)
            routes.append(("peer", f"http://127.0.0.1:{peer_port}"))
        if args.nginx:
            front = nginx.Nginx(listen=front_port, gateway=gateway_port, service=upstream_port)
            front.start()
            routes.append(("nginx", front.url))
        for name, path, script, mode, target in PAIRS:
            extra = [("unbounded", f"http://127.0.0.1:{unbounded_port}")] if mode == "new" else []
            # Round after round, each route once a round, so that what else the machine does
            # weighs on all of them alike; each figure is the median of its rounds.
            directs: list[dict[str, float]] = []
            runs: dict[str, list[tuple[dict[str, float], dict[str, float], dict[str, float]]]]
            runs = {route: [] for route, _ in routes + extra}
            for _ in range(args.rounds):
                directs.append(measure(direct_url + path, script, mode, args))
                for route, url in routes + extra:
                    if route in ("gateway", "unbounded"):
                        pid = (gateway if route == "gateway" else unbounded).pid
                        dsn_counted = counting if mode else None
                        runs[route].append(
                            counted(url + path, script, mode, args, dsn_counted, pid)
                        )
                    elif route == "peer" and peer is not None:
                        # Its CPU too, measured the same way: the process and its children.
                        runs[route].append(counted(url + path, script, mode, args, None, peer.pid))
                    else:
                        runs[route].append((measure(url + path, script, mode, args), {}, {}))
            direct = median_run(directs)
            for route, _ in routes + extra:
                through, counts, cpu = min(
                    runs[route], key=lambda run: abs(run[0]["rps"] - median_rps(runs[route]))
                )
                pair = Pair(
                    name,
                    NGINX_VIA.get(name, "nginx -> gateway") if route == "nginx" else VIA[route],
                    direct["rps"],
                    direct["p50"],
                    direct["p99"],
                    through["rps"],
                    through["p50"],
                    through["p99"],
                    int(through["non_2xx"]),
                    through["rps"] / direct["rps"],
                    target,
                    counts,
                    cpu,
                    [round(run[0]["rps"]) for run in runs[route]],
                )
                pairs.append(pair)
                print(
                    f"{name:>17}: direct {pair.direct_rps:8.0f} req/s, {pair.through} "
                    f"{pair.gateway_rps:8.0f} req/s ({pair.ratio:.2f}x; rounds {pair.rounds})",
                    flush=True,
                )
        if args.workers == 1 and args.memory_connections:
            memory = connection_memory(gateway_port, gateway.pid, args.memory_connections)
        if args.answer_downloads:
            answers = answer_cpu(dsn, args.answer_downloads)
    finally:
        if front is not None:
            front.stop()
        for process in reversed(processes):
            stop(process)
        database.stop()
        shutil.rmtree(peer_store, ignore_errors=True)
    report(pairs, memory, answers, args)
    return 0


def report(
    pairs: list[Pair], memory: Memory | None, answers: Answers | None, args: argparse.Namespace
) -> None:
    taken, machine = taken_on()
    machine += f", node {node_version()}"
    lines = [
        f"Taken {taken} on {machine}; wrk -t1 -c{args.connections}, {args.seconds:g} s after "
        f"a {args.warmup:g} s warm-up, {args.rounds} round(s), the median shown; gateway "
        f"workers: {args.workers} ({server_stack()}); the service waits "
        f"{args.upstream_delay_ms} ms per request.",
        "",
        "| request | through | direct req/s | through req/s | through / direct | "
        "direct p50 / p99 ms | through p50 / p99 ms | through non-2xx | statements / request | "
        "CPU ms / request: gateway, PostgreSQL |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in pairs:
        counts = (
            f"{p.statements['all']:.2f} ({p.statements['claim']:.2f} claims, "
            f"{p.statements['completion']:.2f} completions)"
            if p.statements
            else ""
        )
        cpu = (
            f"{p.cpu_ms['gateway']:.3f}"
            + ("" if p.through == VIA["peer"] else f", {p.cpu_ms['postgres']:.3f}")
            if p.cpu_ms
            else ""
        )
        spread = f" ({min(p.rounds):,} to {max(p.rounds):,})" if len(p.rounds) > 1 else ""
        lines.append(
            f"| {p.name} | {p.through} | {p.direct_rps:,.0f} | {p.gateway_rps:,.0f}{spread} | "
            f"{p.ratio:.2f} | {p.direct_p50_ms:.2f} / {p.direct_p99_ms:.2f} | "
            f"{p.gateway_p50_ms:.2f} / {p.gateway_p99_ms:.2f} | {p.gateway_non_2xx} | {counts} | "
            f"{cpu} |"
        )
    peers = {p.name: p for p in pairs if p.through == VIA["peer"]}
    if peers:
        lines += [
            "",
            "| request | gateway req/s | peer req/s | gateway / peer | target | CPU ms / request: "
            "gateway (+ PostgreSQL), peer |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        targets = {"keyed new POST": 0.75, "keyed replay": 0.35}
        for p in pairs:
            peer_row = peers.get(p.name)
            if p.through == VIA["gateway"] and peer_row is not None:
                target = targets.get(p.name)
                cpu = (
                    f"{p.cpu_ms['gateway']:.3f} (+ {p.cpu_ms['postgres']:.3f}), "
                    f"{peer_row.cpu_ms['gateway']:.3f}"
                    if p.cpu_ms and peer_row.cpu_ms
                    else ""
                )
                lines.append(
                    f"| {p.name} | {p.gateway_rps:,.0f} | {peer_row.gateway_rps:,.0f} | "
                    f"{p.gateway_rps / peer_row.gateway_rps:.2f} | "
                    f"{'' if target is None else f'{target:g}'} | {cpu} |"
                )
    if memory is not None:
        lines += [
            "",
            f"Gateway memory per connection ({memory.connections} at once, VmRSS): idle "
            f"{memory.idle_kib_each:.1f} KiB; trickling a 1 MiB body (all but its last KiB "
            f"sent) {memory.trickling_kib_each:.1f} KiB.",
        ]
    if answers is not None:
        lines += [
            "",
            f"A 10 MB answer through the gateway ({answers.downloads} of each): "
            f"{answers.with_length_ms:.1f} ms of its CPU with a Content-Length, "
            f"{answers.chunked_ms:.1f} ms in {answers.chunk_bytes}-byte chunks "
            f"({answers.chunked_ms / max(answers.with_length_ms, 0.001):.1f}x; target: at most "
            f"4x).",
        ]
    table = "\n".join(lines)
    print()
    print(table)
    output = Path(args.output)
    output.with_suffix(".json").write_text(
        json.dumps(
            {
                "taken": taken,
                "machine": machine,
                "pairs": [asdict(p) for p in pairs],
                "memory": None if memory is None else asdict(memory),
                "answers": None if answers is None else asdict(answers),
            },
            indent=2,
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
