"""`python -m examples.payments`: the payments API on uvicorn, with a PostgreSQL of its own
when DATABASE_URL is not set (data kept in .data/payments-postgres, or PAYMENTS_DATA_DIR, so a
restart keeps the payments; delete that folder to start over)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from examples.local_postgres import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]


def banner(url: str, database: str, fault_injection: bool) -> str:
    """What the example serves and what to paste: every URL named here answers, and the
    walkthrough shows what it says, each answer on a line of its own (`-w '\\n'`: a body
    has no final newline)."""
    key = "demo-" + secrets.token_hex(4)
    curl = (
        f"curl -si {url}/payments -H 'Authorization: Bearer sk_test_acme' "
        f"-H 'Idempotency-Key: {key}' -H 'Content-Type: application/json' "
        '-d \'{"amount": 1250, "currency": "EUR", "customer_id": "cus_42"}\' -w \'\\n\''
    )
    lines = [
        f"The example payments API is ready ({database}).",
        "",
        f"  {url}/docs       the API in the browser (OpenAPI, try it out)",
        f"  {url}/payments   POST a payment (Idempotency-Key required), GET the list",
        "",
        "In another terminal, create a payment, then send the very same request again: the",
        "second answer is the stored first one, byte for byte, with Idempotent-Replayed: true.",
        "",
        f"  {curl}",
        f"  {curl}",
    ]
    if fault_injection:
        again = curl.replace(key, key + "-slow")
        slow = again.replace("curl -si ", "curl -s -o /dev/null -H 'X-Fault-Delay-Ms: 3000' ")
        slow = slow.removesuffix(" -w '\\n'")  # its answer is not shown: nothing to end
        lines += [
            "",
            "A slow payment (3 s) and its duplicate: sent while the first is in flight, the",
            "duplicate gets a 409 with Retry-After; sent again once the first has finished,",
            "it gets the first one's answer, replayed:",
            "",
            f"  {slow} & sleep 1; {again}; wait; {again}",
        ]
    else:
        lines += ["", "(PAYMENTS_FAULT_INJECTION=1 adds a slow payment, to see a 409.)"]
    return "\n".join(lines)


class Server(uvicorn.Server):
    """uvicorn, which prints the banner once it serves (not before: a pasted line would
    find nothing listening), after its own lines."""

    def __init__(self, config: uvicorn.Config, text: str) -> None:
        super().__init__(config)
        self.text = text

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print("\n" + self.text + "\n", flush=True)


def main() -> None:
    # uvicorn re-raises the signal that stopped it once it has shut down; turning SIGTERM
    # into SystemExit lets the `finally` below stop the database instead of leaking it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    host = os.environ.get("HOST", "127.0.0.1")
    port = int(os.environ.get("PORT", "8000"))
    server = None
    database = f"database: {os.environ.get('DATABASE_URL', '')}"
    if not os.environ.get("DATABASE_URL"):
        data_dir = Path(
            os.environ.get("PAYMENTS_DATA_DIR", str(ROOT / ".data" / "payments-postgres"))
        )
        first = not (data_dir / "PG_VERSION").exists()
        shown = os.path.relpath(data_dir) if data_dir.is_relative_to(Path.cwd()) else data_dir
        print(
            f"Starting a PostgreSQL of its own, data in {shown}"
            + (" (first run: creating it) ..." if first else " ..."),
            flush=True,
        )
        server = LocalPostgres(data_dir, keep_data=True)
        os.environ["DATABASE_URL"] = server.start()
        database = f"PostgreSQL {os.environ['DATABASE_URL']}; delete {shown} to start over"
    try:
        print("Starting the API (it brings its tables up to date first) ...", flush=True)
        text = banner(
            f"http://{host}:{port}",
            database,
            os.environ.get("PAYMENTS_FAULT_INJECTION") == "1",
        )
        config = uvicorn.Config("examples.payments.app:app", host=host, port=port)
        # The middleware's line per request (INFO, logger idempotency_asgi), beside uvicorn's
        # own: docs/operations.md, "Seeing the log lines".
        logging.basicConfig(format="%(levelname)s: %(message)s")
        logging.getLogger("idempotency_asgi").setLevel(logging.INFO)
        Server(config, text).run()
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
