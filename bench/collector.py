"""`python -m bench.collector [--modes atomic,inline-atomic]`: Python's cyclic collector in
the server, per mode, under the same wrk load as `bench.cpu` (new keys).

The server runs with `gc.callbacks` counting each generation's collections, their time and
what they freed; garbage that only the collector frees (a reference cycle per request) shows
as objects freed per request, and as collections far more frequent than the hand-written
transaction's.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
import uuid
from pathlib import Path

from bench.__main__ import run_wrk, serve, statistics_server, stop

ROOT = Path(__file__).resolve().parent.parent

#: Run inside the server: count the collections (from SIGUSR1 on: after the warm-up), write
#: them out when it stops.
_COUNTING = """
import gc, json, os, signal, sys, time
import uvicorn
seen = {0: [0, 0.0, 0], 1: [0, 0.0, 0], 2: [0, 0.0, 0]}
began = [0.0]
def count(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        row = seen[info["generation"]]
        row[0] += 1; row[1] += time.perf_counter() - began[0]; row[2] += info["collected"]
gc.callbacks.append(count)
def written(*_):
    open(os.environ["BENCH_GC_OUT"], "w").write(json.dumps(seen))
    sys.exit(0)
# uvicorn raises the SIGTERM it caught again once it has shut down: this handler then runs
signal.signal(signal.SIGTERM, written)
def counting(*_):
    for row in seen.values():
        row[:] = [0, 0.0, 0]
signal.signal(signal.SIGUSR1, counting)
sys.argv = ["uvicorn", *sys.argv[1:]]
uvicorn.main()
"""


def measure(mode: str, dsn: str, seconds: float) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix="bench-gc-")) / "gc.json"
    env = {"DATABASE_URL": dsn, "BENCH_GC_OUT": str(out)}
    process, url = serve(mode, env, Path(out).with_suffix(".log"), launcher=("-c", _COUNTING))
    try:
        run_wrk(url + "/orders", "new_keys.lua", 2, 32, uuid.uuid4().hex[:8] + "w")  # warm-up
        process.send_signal(signal.SIGUSR1)  # counted from here
        time.sleep(0.2)
        measured = run_wrk(url + "/orders", "new_keys.lua", seconds, 32, uuid.uuid4().hex[:8])
    finally:
        stop(process)
    seen = {int(g): row for g, row in json.loads(out.read_text()).items()}
    requests = measured["requests"]
    return {
        "req/s": measured["rps"],
        "gen-0 collections per 1,000 requests": 1000 * seen[0][0] / requests,
        "objects freed per request": sum(row[2] for row in seen.values()) / requests,
        "collector µs per request": 1e6 * sum(row[1] for row in seen.values()) / requests,
        "full collections": seen[2][0],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="atomic,inline-atomic")
    parser.add_argument("--seconds", type=float, default=8)
    args = parser.parse_args()
    with statistics_server() as dsn:
        for mode in args.modes.split(","):
            figures = measure(mode, dsn, args.seconds)
            print(mode, ", ".join(f"{k} {v:,.1f}" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()
