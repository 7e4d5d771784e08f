"""Verify a deployment from CI: `python verify_staging.py` exits 1 when a property
fails."""

import asyncio
import os
import sys

import httpx

from idempotency_asgi.verify import Status, Target, verify


async def main(transport: httpx.AsyncBaseTransport | None = None) -> int:
    target = Target(
        os.environ["STAGING_URL"],  # e.g. https://staging.example.com/payments
        headers=(("Authorization", f"Bearer {os.environ['STAGING_TOKEN']}"),),
        body='{"amount": 100, "currency": "EUR"}',
    )
    # transport=httpx.ASGITransport(app) probes an application in process instead.
    report = await verify(target, transport=transport)
    print(report.text())
    if report.finding("concurrent-one-execution").status is not Status.PASSED:
        print("a duplicate may run twice here", file=sys.stderr)
    return report.exit_status


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
