"""What the soak samples every few seconds while the load runs.

From PostgreSQL: `idempotency_keys`' size (pg_total_relation_size: heap, indexes and TOAST),
live and dead tuples, inserts, deletes and autovacuum runs (pg_stat_user_tables), rows in
flight, and the reaper's lag: how long the oldest finished row past its retention has been
waiting (`now() - min(expires_at)` over `state = 'completed' AND expires_at <= now()`, which
the reaper's own partial index answers), with how many such rows there are.

From /proc: CPU time used since the last sample by the client (this process), the server
(uvicorn and its workers), PostgreSQL (the postmaster and its backends), and the whole machine,
in cores, so that the report can say who used the two cores.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TABLE = """
SELECT s.n_live_tup, s.n_dead_tup, s.n_tup_ins, s.n_tup_del, s.n_tup_upd,
       s.autovacuum_count, s.vacuum_count,
       pg_total_relation_size(s.relid) AS total_bytes, pg_relation_size(s.relid) AS heap_bytes
FROM pg_stat_user_tables s
WHERE s.schemaname = 'public' AND s.relname = 'idempotency_keys'
"""

_LAG = """
SELECT extract(epoch FROM now() - min(expires_at))::float8 AS lag, count(*) AS waiting
FROM idempotency_keys WHERE state = 'completed' AND expires_at <= now()
"""

_IN_FLIGHT = "SELECT count(*) FROM idempotency_keys WHERE state = 'in_flight'"

_TICK = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def _tree(root: int, children: dict[int, list[int]]) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _ticks(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _machine_ticks() -> int:
    """Busy ticks of all cores: everything but idle and iowait."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values[:8]) - values[3] - values[4]  # without guest time (counted in user)


@dataclass
class CpuMeter:
    """CPU used per group of processes between two `read()`s, in cores. `roots` names each
    group's first process; `trees` the groups that include that process's descendants (the
    client's does not: the server and PostgreSQL were started from it)."""

    roots: dict[str, int]
    trees: frozenset[str] = frozenset()
    _last: dict[int, int] = field(default_factory=dict)
    _last_machine: int = 0
    _last_at: float = 0.0

    def read(self) -> dict[str, float]:
        now = time.monotonic()
        children = _children()
        seen: dict[int, int] = {}
        used: dict[str, int] = {}
        for name, root in self.roots.items():
            total = 0
            for pid in _tree(root, children) if name in self.trees else [root]:
                ticks = _ticks(pid)
                seen[pid] = ticks
                total += ticks - self._last.get(pid, 0)
            used[name] = total
        busy = _machine_ticks()
        elapsed = now - self._last_at if self._last_at else 0.0
        out = {name: ticks / _TICK / elapsed if elapsed else 0.0 for name, ticks in used.items()}
        out["machine"] = (busy - self._last_machine) / _TICK / elapsed if elapsed else 0.0
        # Everything else on the machine: other people's work, the kernel's.
        out["others"] = max(0.0, out["machine"] - sum(out[name] for name in used))
        self._last, self._last_machine, self._last_at = seen, busy, now
        return out


@dataclass
class Sample:
    t: float  # seconds since the load began
    total_bytes: int
    heap_bytes: int
    live_tuples: int
    dead_tuples: int
    inserted: int
    deleted: int
    autovacuums: int
    in_flight: int
    reaper_lag: float  # seconds; 0 when no finished row is past its retention
    expired_waiting: int
    cpu: dict[str, float]


async def sample_once(conn: Any, t: float, cpu: CpuMeter) -> Sample:
    table = await conn.fetchrow(_TABLE)
    lag = await conn.fetchrow(_LAG)
    in_flight = await conn.fetchval(_IN_FLIGHT)
    return Sample(
        t=t,
        total_bytes=table["total_bytes"],
        heap_bytes=table["heap_bytes"],
        live_tuples=table["n_live_tup"],
        dead_tuples=table["n_dead_tup"],
        inserted=table["n_tup_ins"],
        deleted=table["n_tup_del"],
        autovacuums=table["autovacuum_count"] + table["vacuum_count"],
        in_flight=in_flight,
        reaper_lag=lag["lag"] or 0.0,
        expired_waiting=lag["waiting"],
        cpu=cpu.read(),
    )
