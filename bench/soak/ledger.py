"""Reading the audit's `Ledger` from PostgreSQL once every request has been answered."""

from __future__ import annotations

from typing import Any

from .audit import Ledger
from .plan import FAULT, Job

# Every payment of the run, with the outbox events that name it (the handler writes both in
# the request's transaction). The prefix is the run's: `soak-<run>-`.
_PAYMENTS = """
SELECT p.tenant_id, p.idempotency_key, p.id, count(o.id) AS events
FROM payments p LEFT JOIN outbox o ON o.payment_id = p.id
WHERE p.idempotency_key LIKE $1
GROUP BY p.tenant_id, p.idempotency_key, p.id
"""

_FAULT_ROWS = """
SELECT k.tenant_id, k.idempotency_key, k.state
FROM idempotency_keys k
JOIN unnest($1::text[], $2::text[]) AS f(tenant_id, idempotency_key)
  ON k.tenant_id = f.tenant_id AND k.idempotency_key = f.idempotency_key
"""

_STORED = """
SELECT tenant_id, idempotency_key, sha256(response_body) AS digest
FROM idempotency_keys
WHERE state = 'completed' AND idempotency_key LIKE $1
"""

_IN_FLIGHT = "SELECT count(*) FROM idempotency_keys WHERE state = 'in_flight'"


async def read(conn: Any, run_id: str, jobs: list[Job]) -> Ledger:
    prefix = f"soak-{run_id}-%"
    payments: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for row in await conn.fetch(_PAYMENTS, prefix):
        where = (row["tenant_id"], row["idempotency_key"])
        payments.setdefault(where, []).append((row["id"], row["events"]))
    faults = [job for job in jobs if job.kind == FAULT]
    fault_rows = {
        (row["tenant_id"], row["idempotency_key"]): row["state"]
        for row in await conn.fetch(
            _FAULT_ROWS, [j.tenant for j in faults], [j.key for j in faults]
        )
    }
    stored = {
        (row["tenant_id"], row["idempotency_key"]): bytes(row["digest"])
        for row in await conn.fetch(_STORED, prefix)
        if row["digest"] is not None
    }
    return Ledger(payments, fault_rows, stored, await conn.fetchval(_IN_FLIGHT))
