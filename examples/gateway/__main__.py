"""`python -m examples.gateway`: a non-idempotent Node.js orders service with the gateway in
front of it, on a PostgreSQL of its own (a throwaway one, unless DATABASE_URL is set).

    PORT           the gateway's port (8080)
    UPSTREAM_PORT  the Node service's port (9000)
    DATABASE_URL   use this database instead of starting one

Ctrl-C or SIGTERM stops the gateway, the Node service and the database.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvicorn

from examples.local_postgres import LocalPostgres
from idempotency_asgi.gateway import build_gateway, tenant_from_credential

HERE = Path(__file__).resolve().parent


def banner(gateway: str, upstream: str) -> str:
    key = "demo-" + secrets.token_hex(4)
    order = (
        f"curl -si {gateway}/orders -H 'Authorization: Bearer demo-token' "
        f"-H 'Idempotency-Key: {key}' -H 'Content-Type: application/json' "
        """-d '{"sku": "A-1", "quantity": 2}'"""
    )
    slow = order.replace(key, key + "-slow").replace("-si ", "-si -H 'X-Delay-Ms: 3000' ")
    direct = (
        f"curl -s {upstream}/orders -H 'Content-Type: application/json' "
        """-d '{"sku": "A-1", "quantity": 2}'"""
    )
    return "\n".join(
        [
            f"Gateway on {gateway}, in front of the Node orders service on {upstream}",
            "",
            "The Node service is not idempotent: the same POST twice makes two orders.",
            "",
            f"  {direct}",
            f"  {direct}",
            "",
            "Through the gateway, with a key: the second answer is the first one, replayed",
            "(Idempotent-Replayed: true), and the service made one order:",
            "",
            f"  {order}",
            f"  {order}",
            f"  curl -s '{upstream}/orders/count?key={key}'",
            "",
            "A slow order raced by its duplicate: the duplicate gets 409, nothing runs twice:",
            "",
            f"  {slow} & sleep 1; {order.replace(key, key + '-slow')}; wait",
            "",
            f"The gateway's own health: curl -s {gateway}/_idempotency/health",
        ]
    )


def _die_with_parent() -> None:
    # Linux: the Node service gets SIGTERM if this process dies without cleaning up.
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_upstream(port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        ["node", str(HERE / "upstream.js")],
        env={**os.environ, "PORT": str(port), "HOST": "127.0.0.1"},
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the Node service exited with {process.returncode}")
        with contextlib.suppress(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return process
        time.sleep(0.05)
    process.terminate()
    raise SystemExit("the Node service did not start")


def main() -> None:
    # uvicorn re-raises the signal that stopped it once it has shut down; turning SIGTERM
    # into SystemExit lets the `finally` below stop the Node service and the database.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    port = int(os.environ.get("PORT", "8080"))
    upstream_port = int(os.environ.get("UPSTREAM_PORT", "9000"))
    database = None
    dsn = os.environ.get("DATABASE_URL")
    if not dsn:
        database = LocalPostgres.temporary()
        dsn = database.start()
    upstream = None
    try:
        upstream = start_upstream(upstream_port)
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        app = build_gateway(upstream_url, store=dsn, tenant=tenant_from_credential())
        print(banner(f"http://127.0.0.1:{port}", upstream_url), flush=True)
        uvicorn.run(
            app,
            host="127.0.0.1",
            port=port,
            log_level="info",
            date_header=False,
            server_header=False,
            proxy_headers=False,
        )
    finally:
        if upstream is not None:
            upstream.terminate()
            upstream.wait(timeout=10)
        if database is not None:
            database.stop()


if __name__ == "__main__":
    main()
