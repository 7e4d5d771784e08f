"""The `idempotency-asgi` command."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from .migrate import migrate
from .store import UNAVAILABLE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="idempotency-asgi")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL"),
        help="PostgreSQL URL (default: $DATABASE_URL)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("migrate", help="create or upgrade the idempotency_keys table")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("no database: pass --database-url or set DATABASE_URL")
    if args.command == "migrate":
        try:
            applied = asyncio.run(migrate(args.database_url))
        except UNAVAILABLE as exc:
            print(f"idempotency-asgi: cannot migrate: {exc}", file=sys.stderr)
            return 1
        print(f"applied {', '.join(applied)}" if applied else "schema already up to date")
    return 0
