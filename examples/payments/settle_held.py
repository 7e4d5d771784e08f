"""Settle what the service could not know: `python -m examples.payments.settle_held`.

A handler that charges the provider inline and times out raises OutcomeUnknown: the charge
may or may not have happened, and the key is held. This job lists the held keys, asks the
provider for each (`GET /charges?idempotency_key=tenant:key`, see provider.py), and writes the
truth into the key: a charge booked is settled with the answer the handler would have given
(every retry replays it; nobody is charged twice), a charge never booked is released (the
next retry charges, once). A key the provider cannot tell about yet is left for the next run.

Only keys held at least --older-than seconds are asked about: longer than the provider can
take to book a charge it received, so that "no charge" is the final answer. Exits 0 when
every key was settled or released, 1 when some were left, 2 when the database cannot be
reached. DATABASE_URL and PROVIDER_URL (default http://127.0.0.1:8001).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass, field

import httpx
import orjson

from idempotency_asgi import PostgresStore, ReconciliationRefused, StoreError


@dataclass
class Run:
    settled: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


# start: job
def answer(charge: dict[str, object]) -> bytes:
    """The body the handler answers a charge with: a settled key replays the same."""
    return orjson.dumps({"charge_id": charge["charge_id"], "status": "succeeded"})


async def settle_held(
    store: PostgresStore, provider: httpx.AsyncClient, *, older_than: float = 300.0
) -> Run:
    run = Run()
    for held in await store.held(older_than=older_than):
        name = f"{held.tenant}:{held.key}"  # the key the handler sent the provider
        try:
            found = await provider.get("/charges", params={"idempotency_key": name})
        except httpx.HTTPError:
            run.left.append(name)  # the provider is away: ask again next run
            continue
        try:
            if found.status_code == 200:
                await store.settle(
                    tenant=held.tenant,
                    key=held.key,
                    status=201,
                    body=answer(found.json()),
                    headers=[("content-type", "application/json")],
                )
                run.settled.append(name)
            elif found.status_code == 404:
                await store.release_key(tenant=held.tenant, key=held.key)
                run.released.append(name)
            else:
                run.left.append(name)
        except ReconciliationRefused:
            # A retry got there first (its lease lapsed), or it has an
            # answer now: the next run sees what became of it.
            run.left.append(name)
    return run


# end: job


async def _main(dsn: str, provider_url: str, older_than: float) -> Run:
    store = PostgresStore(dsn, min_size=1, max_size=2)
    try:
        async with httpx.AsyncClient(base_url=provider_url, timeout=10.0) as provider:
            return await settle_held(store, provider, older_than=older_than)
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.payments.settle_held")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL"))
    parser.add_argument(
        "--provider-url", default=os.environ.get("PROVIDER_URL", "http://127.0.0.1:8001")
    )
    parser.add_argument("--older-than", type=float, default=300.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("no database: pass --database-url or set DATABASE_URL")
    try:
        run = asyncio.run(_main(args.database_url, args.provider_url, args.older_than))
    except StoreError as exc:
        print(f"settle_held: cannot reach the key store: {exc}", file=sys.stderr)
        return 2
    for verb, names in (("settled", run.settled), ("released", run.released)):
        for name in names:
            print(f"{verb} {name}")
    for name in run.left:
        print(f"left {name}", file=sys.stderr)
    return 1 if run.left else 0


if __name__ == "__main__":
    sys.exit(main())
