"""The `idempotency-asgi` command: schema, maintenance and inspection.

    idempotency-asgi migrate [--distribute [--colocate-with TABLE]]   (Citus: see distribute.py)
    idempotency-asgi reap [--once] [--batch-size N] [--processed-retention SECONDS]
    idempotency-asgi sweep [--once] [--batch-size N] [--grace SECONDS]
    idempotency-asgi inspect --tenant T KEY
    idempotency-asgi stats
    idempotency-asgi held [--tenant T] [--older-than SECONDS] [--json]  (see _cli_reconcile.py:
    idempotency-asgi settle --tenant T KEY --status N ...              keys held after an
    idempotency-asgi release --tenant T KEY                            unknown outcome)
    idempotency-asgi gateway --upstream URL ...       (see gateway/cli.py)
    idempotency-asgi verify URL ...                   (see verify/cli.py; no database)
    idempotency-asgi dev-postgres [--port N]          (see _devpostgres.py; a PostgreSQL for
                                                       development, until Ctrl+C)

`--database-url` (before or after the command) or DATABASE_URL names the database. Exit
status: 0 done, 1 the database could not be reached or failed (or settle or release refused),
2 usage, 3 (inspect) no such key.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from . import _cli_reconcile, _devpostgres
from ._errors import StoreError
from ._postgres.connections import DATABASE_ERRORS
from ._postgres.distribute import NotCitus, distribute
from ._postgres.migrate import migrate
from ._postgres.store import PostgresStore
from ._postgres.urls import asyncpg_url
from .gateway.cli import add_parser as add_gateway_parser
from .gateway.cli import run as run_gateway
from .maintenance import Reaper, Sweeper
from .verify.cli import add_parser as add_verify_parser
from .verify.cli import run as run_verify


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="idempotency-asgi", description="Operate an idempotency-asgi key store."
    )
    database = "PostgreSQL URL (default: $DATABASE_URL)"
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL"), help=database)
    # The same option after the command (`idempotency-asgi migrate --database-url ...`). Its
    # default is "not given", so that it never overrides a value given before the command.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--database-url", default=argparse.SUPPRESS, help=database)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    migrate_command = commands.add_parser(
        "migrate", parents=[after], help="create or upgrade the tables"
    )
    migrate_command.add_argument(
        "--distribute",
        action="store_true",
        help="then distribute them by tenant on a Citus cluster (run against the coordinator)",
    )
    migrate_command.add_argument(
        "--colocate-with",
        metavar="TABLE",
        default=None,
        help="with --distribute: an application table, distributed by its tenant column, to"
        " co-locate the key tables with (default: Citus's default group)",
    )
    reap = commands.add_parser(
        "reap", parents=[after], help="delete finished keys past their retention"
    )
    reap.add_argument("--once", action="store_true", help="one batch, then exit")
    reap.add_argument("--batch-size", type=int, default=1000)
    reap.add_argument(
        "--processed-retention",
        type=float,
        default=None,
        metavar="SECONDS",
        help="also delete consumer dedup records older than this",
    )
    sweep = commands.add_parser(
        "sweep", parents=[after], help="release in-flight keys whose owner died"
    )
    sweep.add_argument("--once", action="store_true", help="one batch, then exit")
    sweep.add_argument("--batch-size", type=int, default=100)
    sweep.add_argument(
        "--grace",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="only leases that lapsed at least this long ago (default 300)",
    )
    inspect = commands.add_parser("inspect", parents=[after], help="show one key's record")
    inspect.add_argument("--tenant", required=True)
    inspect.add_argument("key")
    commands.add_parser(
        "stats", parents=[after], help="rows by state, oldest in flight, held, expired waiting"
    )
    _cli_reconcile.add_parsers(commands, after)
    add_gateway_parser(commands)
    add_verify_parser(commands)
    _devpostgres.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "gateway":
        return run_gateway(args)
    if args.command == "verify":
        return run_verify(args)
    if args.command == "dev-postgres":
        return _devpostgres.run(args)
    if not args.database_url:
        parser.error("no database: pass --database-url or set DATABASE_URL")
    try:
        asyncpg_url(args.database_url)  # a URL it cannot use is a usage error (2), said now
    except ValueError as exc:
        parser.error(f"--database-url: {exc}")
    try:
        return asyncio.run(_run(args))
    except (StoreError, *DATABASE_ERRORS) as exc:
        print(f"idempotency-asgi {args.command}: database unavailable: {exc}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    if args.command == "migrate":
        if args.colocate_with is not None and not args.distribute:
            print("idempotency-asgi migrate: --colocate-with needs --distribute", file=sys.stderr)
            return 2
        applied = await migrate(args.database_url)
        print(f"applied {', '.join(applied)}" if applied else "schema already up to date")
        if args.distribute:
            try:
                spread = await distribute(args.database_url, colocate_with=args.colocate_with)
            except NotCitus as exc:
                print(f"idempotency-asgi migrate --distribute: {exc}", file=sys.stderr)
                return 1
            print(f"distributed {', '.join(spread)}" if spread else "already distributed")
        return 0
    store = PostgresStore(args.database_url, min_size=1, max_size=2, timeout=30.0)
    try:
        if args.command == "reap":
            reaper = Reaper(
                store,
                batch_size=args.batch_size,
                processed_retention_seconds=args.processed_retention,
            )
            return await _batches("reaped", reaper.run_once, reaper.run, args.once)
        if args.command == "sweep":
            sweeper = Sweeper(store, grace_seconds=args.grace, batch_size=args.batch_size)
            return await _batches("swept", sweeper.run_once, sweeper.run, args.once)
        if args.command in _cli_reconcile.COMMANDS:
            return await _cli_reconcile.run(args, store)
        if args.command == "inspect":
            record = await store.inspect(tenant=args.tenant, key=args.key)
            if record is None:
                print(f"no key {args.key!r} for tenant {args.tenant!r}", file=sys.stderr)
                return 3
            _print_fields(record)
            return 0
        _print_fields(await store.stats())
        return 0
    finally:
        await store.close()


async def _batches(
    verb: str,
    run_once: Callable[[], Awaitable[int]],
    run: Callable[[asyncio.Event], Awaitable[None]],
    once: bool,
) -> int:
    if once:
        print(f"{verb} {await run_once()}")
        return 0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await run(stop)
    return 0


def _print_fields(fields: dict[str, Any]) -> None:
    width = max(len(name) for name in fields)
    for name, value in fields.items():
        shown = value.isoformat() if isinstance(value, datetime) else value
        print(f"{name:<{width}}  {'-' if shown is None else shown}")
