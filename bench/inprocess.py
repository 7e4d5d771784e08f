"""`python -m bench.inprocess`: the server's CPU per request without HTTP, each mode beside
the same thing written by hand, the modes taking turns.

bench/app.py's app is called as an ASGI application in this process (uvloop, ten requests
at once by default, a new key each, the same JSON body as wrk's), and the process's own CPU
time is divided by the requests: no uvicorn, no wrk and no socket between them, so what
differs is the middleware's own work and the driver calls it makes. PostgreSQL runs on the
other core; its processes' CPU time is divided by the requests too. Their rounds of the same
code varied by a few per cent on a quiet machine and by up to a fifth on a busy one: read
the median of several rounds, and run it more than once. `--calls` counts instead what does
not vary: the Python calls (cProfile) and asyncio tasks a request makes.

    python -m bench.inprocess [--modes atomic,inline-atomic] [--requests 6000] [--rounds 3]
                              [--repo PATH] [--at-once 10] [--calls]

`--repo` measures another checkout's package and bench app (a worktree of the commit
before, say, with the same schema) in the same run, on the same server, alternating with
this one's: each figure is then the median of its rounds, one column per checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BODY = b'{"amount": 100, "currency": "EUR"}'
AT_ONCE = 10


async def _started(app: Any) -> Any:
    """The app's lifespan started; what stops it."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    running = asyncio.ensure_future(app(scope, inbox.get, outbox.put))
    message = await outbox.get()
    if message["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the app did not start: {message}")

    async def stop() -> None:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await running

    return stop


async def _request(app: Any) -> None:
    headers = [
        (b"host", b"bench"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
        (b"idempotency-key", uuid.uuid4().hex.encode()),
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/orders",
        "raw_path": b"/orders",
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    given = False
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()  # the client stays: nothing in these modes asks
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive, send)
    if statuses != [201]:
        raise RuntimeError(f"expected 201, got {statuses}")


async def _measure(
    mode: str,
    dsn: str,
    requests: int,
    at_once: int = AT_ONCE,
    calls: bool = False,
    postmaster: int = 0,
) -> str:
    """µs of this process's CPU per request, and of PostgreSQL's (every process of the
    server whose postmaster is `postmaster`); with `calls`, Python calls and tasks made per
    request instead (counted by cProfile and a task factory: the same on every run, whatever
    the machine does meanwhile)."""
    from bench.app import create_app
    from bench.cpu import postgres_ns, spent

    app = create_app(mode, dsn)
    stop = await _started(app)
    loop = asyncio.get_running_loop()
    tasks = 0
    made = loop.get_task_factory()

    def counted(loop: Any, coro: Any, **kwargs: Any) -> Any:
        nonlocal tasks
        tasks += 1
        return made(loop, coro, **kwargs) if made else asyncio.Task(coro, loop=loop, **kwargs)

    profile = cProfile.Profile()
    try:

        async def worker(count: int) -> None:
            for _ in range(count):
                await _request(app)

        await asyncio.gather(*(worker(50) for _ in range(at_once)))  # warm
        # Read outside the counted window (postmaster 0: not read).
        database = postgres_ns(postmaster) if postmaster else {}
        if calls:
            loop.set_task_factory(counted)
            profile.enable()
        began = time.process_time()
        await asyncio.gather(*(worker(requests // at_once) for _ in range(at_once)))
        ours = time.process_time() - began
        profile.disable()
        loop.set_task_factory(made)
        theirs = spent(database, postgres_ns(postmaster)) / 1e9 if postmaster else 0.0
    finally:
        await stop()
    done = requests // at_once * at_once
    if calls:
        stats: Any = pstats.Stats(profile)
        made_calls = sum(row[1] for row in stats.stats.values())
        # The workers' own tasks (`at_once`, made by gather) are not the request's.
        return f"{made_calls / done:.0f} {(tasks - at_once) / done:.2f}"
    return f"{1e6 * ours / done} {1e6 * theirs / done}"


def _one(
    repo: Path, mode: str, dsn: str, requests: int, at_once: int, calls: bool, postmaster: int = 0
) -> str:
    """One measurement, in a process of its own importing `repo`'s package and app."""
    # This file's driver, and the checkout's package and bench app (its `bench.app`, found
    # first on the path).
    code = (
        "import importlib.util, sys, uvloop; sys.path.insert(0, sys.argv[1]); "
        "spec = importlib.util.spec_from_file_location('driver', sys.argv[5]); "
        "driver = importlib.util.module_from_spec(spec); spec.loader.exec_module(driver); "
        "print(uvloop.run(driver._measure(sys.argv[2], sys.argv[3], int(sys.argv[4]),"
        " int(sys.argv[6]), sys.argv[7] == '1', int(sys.argv[8]))))"
    )
    argv = [
        *(str(repo), mode, dsn, str(requests), __file__),
        *(str(at_once), str(int(calls)), str(postmaster)),
    ]
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "BENCH_MODE": ""},
    )
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="atomic,inline-atomic")
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=None, help="another checkout, alternated")
    parser.add_argument("--at-once", type=int, default=AT_ONCE, help="requests in flight")
    parser.add_argument(
        "--calls", action="store_true", help="count Python calls and tasks, once, not CPU"
    )
    args = parser.parse_args()
    from bench.__main__ import prepare
    from bench.cpu import postmaster_of
    from examples.local_postgres import LocalPostgres

    repos = [ROOT] + ([args.repo.resolve()] if args.repo else [])
    database = LocalPostgres(
        Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-")) / "data", keep_data=False
    )
    try:
        dsn = database.start()
        asyncio.run(prepare(dsn))
        seen: dict[tuple[Path, str], list[float]] = {}
        seen_database: dict[tuple[Path, str], list[float]] = {}
        if args.calls:
            _count(repos, args, dsn)
            return
        postmaster = postmaster_of(dsn)
        for _ in range(args.rounds):
            for repo in reversed(repos):  # the other checkout first in each round
                for mode in args.modes.split(","):
                    figures = _one(repo, mode, dsn, args.requests, args.at_once, False, postmaster)
                    server, database_us = map(float, figures.split())
                    seen.setdefault((repo, mode), []).append(server)
                    seen_database.setdefault((repo, mode), []).append(database_us)
                    print(
                        f"{repo.name:>12} {mode:>14}: {server:6.1f} µs,"
                        f" PostgreSQL {database_us:6.1f} µs",
                        flush=True,
                    )
    finally:
        database.stop()
    for what, figures in (("server", seen), ("PostgreSQL", seen_database)):
        print(
            f"\n{what} CPU per request, µs (median of {args.rounds}, {args.requests} requests"
            f" each, {args.at_once} at once)"
        )
        print("| mode | " + " | ".join(repo.name for repo in repos) + " |")
        print("| --- |" + " ---: |" * len(repos))
        for mode in args.modes.split(","):
            cells = " | ".join(f"{statistics.median(figures[(repo, mode)]):.1f}" for repo in repos)
            print(f"| {mode} | {cells} |")


def _count(repos: list[Path], args: argparse.Namespace, dsn: str) -> None:
    print(f"Python calls and tasks made per request ({args.at_once} at once)")
    print("| mode | " + " | ".join(f"{repo.name} calls | tasks" for repo in repos) + " |")
    print("| --- |" + " ---: | ---: |" * len(repos))
    for mode in args.modes.split(","):
        cells = [_one(repo, mode, dsn, args.requests, args.at_once, True) for repo in repos]
        print(f"| {mode} | " + " | ".join(cell.replace(" ", " | ") for cell in cells) + " |")


if __name__ == "__main__":
    main()
