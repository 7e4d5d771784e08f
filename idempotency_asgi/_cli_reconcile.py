"""The operator's reconciliation commands of `idempotency-asgi` (see docs/reconciling.md):

    idempotency-asgi held [--tenant T] [--older-than SECONDS] [--limit N] [--json]
    idempotency-asgi settle --tenant T KEY --status N [--body TEXT | --body-file PATH]
                            [--header "Name: value"]... [--replace] [--ttl SECONDS]
    idempotency-asgi release --tenant T KEY [--completed]

Exit status: 0 done; 1 refused (no such key, a key with an answer already, a request still
running: the message says which) or the database failed; 2 usage (an answer that could not
be replayed as given, too).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from ._errors import KeyCompleted, ReconciliationRefused
from ._postgres.store import PostgresStore

COMMANDS = ("held", "settle", "release")


def add_parsers(commands: Any, after: argparse.ArgumentParser) -> None:
    held = commands.add_parser(
        "held",
        parents=[after],
        help="list keys held after an unknown outcome, and keys in flight past their lease",
    )
    held.add_argument("--tenant", default=None, help="only this tenant's (default: every one)")
    held.add_argument(
        "--older-than",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="only keys whose request was made at least this long ago",
    )
    held.add_argument("--limit", type=int, default=1000, help="at most this many (default 1000)")
    held.add_argument("--json", action="store_true", help="one JSON object per line")

    settle = commands.add_parser(
        "settle",
        parents=[after],
        help="record the answer a provider confirmed: every retry replays it",
    )
    settle.add_argument("--tenant", required=True)
    settle.add_argument("key")
    settle.add_argument("--status", type=int, required=True, help="the answer's status, 200-499")
    body = settle.add_mutually_exclusive_group()
    body.add_argument("--body", default=None, metavar="TEXT", help="the body, as UTF-8 text")
    body.add_argument(
        "--body-file", default=None, metavar="PATH", help="the body, the file's bytes (- stdin)"
    )
    settle.add_argument(
        "--header",
        action="append",
        default=[],
        metavar='"NAME: VALUE"',
        help="a header of the answer (again for more); content-length is added",
    )
    settle.add_argument(
        "--replace", action="store_true", help="overwrite an answer the key has already"
    )
    settle.add_argument(
        "--ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="replay it this long from now (default: the key's own retention, the"
        " application's ttl_seconds)",
    )

    release = commands.add_parser(
        "release", parents=[after], help="free a held key at once: the next retry runs"
    )
    release.add_argument("--tenant", required=True)
    release.add_argument("key")
    release.add_argument(
        "--completed",
        action="store_true",
        help="free it even if it has an answer (its retries then run the request again)",
    )


async def run(args: argparse.Namespace, store: PostgresStore) -> int:
    if args.command == "held":
        return await _held(args, store)
    try:
        if args.command == "settle":
            return await _settle(args, store)
        done = await store.release_key(tenant=args.tenant, key=args.key, completed=args.completed)
    except ReconciliationRefused as exc:
        hint = ""
        if isinstance(exc, KeyCompleted):
            hint = "; pass --replace to overwrite it" if args.command == "settle" else ""
            hint = hint or "; pass --completed to free it all the same"
        print(
            f"idempotency-asgi {args.command}: refused: key {args.key!r} of tenant"
            f" {args.tenant!r}: {exc.reason}{hint}",
            file=sys.stderr,
        )
        return 1
    print(
        f"released key {args.key!r} of tenant {args.tenant!r} (was {done.previous}):"
        " the next retry runs the request"
    )
    return 0


async def _held(args: argparse.Namespace, store: PostgresStore) -> int:
    found = await store.held(tenant=args.tenant, older_than=args.older_than, limit=args.limit)
    rows = [
        {
            "tenant": held.tenant,
            "key": held.key,
            "method": held.method,
            "path": held.path,
            "since": held.since.isoformat(),
            "reason": held.reason,
            "until": held.until.isoformat(),
        }
        for held in found
    ]
    if args.json:
        for row in rows:
            sys.stdout.write(orjson.dumps(row).decode() + "\n")
        return 0
    if not rows:
        print("no keys held")
        return 0
    names = list(rows[0])
    widths = {name: max(len(name), *(len(row[name]) for row in rows)) for name in names}
    for line in [dict(zip(names, names, strict=True)), *rows]:
        print("  ".join(line[name].ljust(widths[name]) for name in names).rstrip())
    return 0


async def _settle(args: argparse.Namespace, store: PostgresStore) -> int:
    try:
        body = _body(args)
        headers = [_header(text) for text in args.header]
        done = await store.settle(
            tenant=args.tenant,
            key=args.key,
            status=args.status,
            body=body,
            headers=headers,
            replace=args.replace,
            ttl_seconds=args.ttl,
        )
    except (ValueError, OSError) as exc:
        print(f"idempotency-asgi settle: {exc}", file=sys.stderr)
        return 2
    expires = done.expires_at.isoformat() if isinstance(done.expires_at, datetime) else "-"
    print(
        f"settled key {args.key!r} of tenant {args.tenant!r} (was {done.previous}):"
        f" {args.status}, replayed until {expires}"
    )
    return 0


def _body(args: argparse.Namespace) -> bytes:
    if args.body is not None:
        return str(args.body).encode("utf-8")
    if args.body_file is None:
        return b""
    if args.body_file == "-":
        return sys.stdin.buffer.read()
    return Path(args.body_file).read_bytes()


def _header(text: str) -> tuple[str, str]:
    name, colon, value = text.partition(":")
    if not colon or not name.strip():
        raise ValueError(f'--header {text!r}: write it as "Name: value"')
    return name.strip(), value.strip()
