"""`python -m examples.payments`: the payments API on uvicorn, with a PostgreSQL of its own
when DATABASE_URL is not set (data kept in .data/payments-postgres, or PAYMENTS_DATA_DIR, so a
restart keeps the payments; delete that folder to start over)."""

from __future__ import annotations

import os
import secrets
import signal
import sys
from pathlib import Path

import uvicorn

from examples.local_postgres import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]


def banner(url: str, database_url: str, fault_injection: bool) -> str:
    key = "demo-" + secrets.token_hex(4)
    curl = (
        f"curl -si {url}/payments -H 'Authorization: Bearer sk_test_acme' "
        f"-H 'Idempotency-Key: {key}' -H 'Content-Type: application/json' "
        '-d \'{"amount": 1250, "currency": "EUR", "customer_id": "cus_42"}\''
    )
    lines = [
        f"Payments API on {url}  (database: {database_url})",
        "",
        "Create a payment, then send the very same request again: the second answer is the",
        "stored first one, byte for byte, with Idempotent-Replayed: true.",
        "",
        f"  {curl}",
        f"  {curl}",
    ]
    if fault_injection:
        slow = curl.replace(key, key + "-slow").replace("-si ", "-si -H 'X-Fault-Delay-Ms: 3000' ")
        lines += [
            "",
            "See a 409 (the first is still in flight), then its replay:",
            "",
            f"  {slow} & sleep 1; {curl.replace(key, key + '-slow')}; wait",
        ]
    return "\n".join(lines)


def main() -> None:
    # uvicorn re-raises the signal that stopped it once it has shut down; turning SIGTERM
    # into SystemExit lets the `finally` below stop the database instead of leaking it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    host = os.environ.get("HOST", "127.0.0.1")
    port = int(os.environ.get("PORT", "8000"))
    server = None
    if not os.environ.get("DATABASE_URL"):
        data_dir = os.environ.get("PAYMENTS_DATA_DIR", str(ROOT / ".data" / "payments-postgres"))
        server = LocalPostgres(Path(data_dir), keep_data=True)
        os.environ["DATABASE_URL"] = server.start()
    try:
        print(
            banner(
                f"http://{host}:{port}",
                os.environ["DATABASE_URL"],
                os.environ.get("PAYMENTS_FAULT_INJECTION") == "1",
            ),
            flush=True,
        )
        uvicorn.run("examples.payments.app:app", host=host, port=port, log_level="info")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
