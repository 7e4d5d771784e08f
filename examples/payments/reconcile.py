"""Reconcile the ledger against the provider: `python -m examples.payments.reconcile`.

Compares the payments this service took with the charges the provider booked, and reports
payments missing downstream, charges with no payment, and payments charged more than once.
Exits 0 when the two agree, 1 when they differ, 2 when the database cannot be reached.
Payments younger than --grace-seconds (their event may still be on its way) are left out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from .settings import asyncpg_dsn

_MISSING = """
SELECT p.id, p.tenant_id, p.amount, p.currency, o.state AS outbox_state
FROM payments p
LEFT JOIN outbox o ON o.payment_id = p.id
WHERE p.created_at <= now() - make_interval(secs => $1)
  AND NOT EXISTS (SELECT 1 FROM provider.charges c WHERE c.payment_id = p.id)
ORDER BY p.created_at
"""

_ORPHANS = """
SELECT c.id, c.payment_id, c.tenant_id, c.amount
FROM provider.charges c
WHERE NOT EXISTS (
    SELECT 1 FROM payments p WHERE p.id = c.payment_id AND p.tenant_id = c.tenant_id
)
ORDER BY c.created_at
"""

_DUPLICATES = """
SELECT payment_id, count(*) AS charges, array_agg(id ORDER BY created_at) AS charge_ids
FROM provider.charges GROUP BY payment_id HAVING count(*) > 1 ORDER BY payment_id
"""

_MISMATCHED = """
SELECT p.id, p.amount, c.amount AS charged, p.currency, c.currency AS charged_currency
FROM payments p JOIN provider.charges c ON c.payment_id = p.id
WHERE p.amount <> c.amount OR p.currency <> c.currency
"""


@dataclass
class Report:
    missing: list[Any] = field(default_factory=list)
    orphans: list[Any] = field(default_factory=list)
    duplicates: list[Any] = field(default_factory=list)
    mismatched: list[Any] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.orphans or self.duplicates or self.mismatched)

    def lines(self) -> list[str]:
        out = [
            f"missing downstream: {len(self.missing)}",
            *(
                f"  {r['id']} ({r['tenant_id']}, {r['amount']} {r['currency']},"
                f" outbox {r['outbox_state']})"
                for r in self.missing
            ),
            f"charges without a payment: {len(self.orphans)}",
            *(f"  {r['id']} for {r['payment_id']} ({r['tenant_id']})" for r in self.orphans),
            f"payments charged more than once: {len(self.duplicates)}",
            *(
                f"  {r['payment_id']}: {r['charges']} charges {list(r['charge_ids'])}"
                for r in self.duplicates
            ),
            f"amount or currency differs: {len(self.mismatched)}",
            *(
                f"  {r['id']}: {r['amount']} {r['currency']} vs"
                f" {r['charged']} {r['charged_currency']}"
                for r in self.mismatched
            ),
        ]
        out.append("ledger and provider agree" if self.clean else "ledger and provider DIFFER")
        return out


async def reconcile(conn: Any, *, grace_seconds: float = 0.0) -> Report:
    return Report(
        missing=await conn.fetch(_MISSING, grace_seconds),
        orphans=await conn.fetch(_ORPHANS),
        duplicates=await conn.fetch(_DUPLICATES),
        mismatched=await conn.fetch(_MISMATCHED),
    )


async def _run(dsn: str, grace_seconds: float) -> Report:
    conn = await asyncpg.connect(asyncpg_dsn(dsn))
    try:
        return await reconcile(conn, grace_seconds=grace_seconds)
    finally:
        await conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.payments.reconcile")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL"))
    parser.add_argument("--grace-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("no database: pass --database-url or set DATABASE_URL")
    try:
        report = asyncio.run(_run(args.database_url, args.grace_seconds))
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        print(f"reconcile: cannot read the ledger: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
