"""The example's configuration, read from the environment once."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_TOKENS = "sk_test_acme=acme,sk_test_globex=globex"


def asyncpg_dsn(url: str) -> str:
    """DATABASE_URL as asyncpg takes it: SQLAlchemy's `postgresql+asyncpg://` (what the
    settings of a SQLAlchemy app hold) as `postgresql://`. The key store reads any URL itself,
    and refuses one it cannot use with the fix in the message; the example's own pool, worker
    and provider connect with asyncpg directly, so they are given this."""
    scheme, separator, rest = url.strip().partition("://")
    if separator and scheme.lower() == "postgresql+asyncpg":
        return "postgresql://" + rest
    return url


def parse_tokens(spec: str) -> dict[str, str]:
    """`token=tenant,token=tenant` -> {token: tenant}."""
    tokens: dict[str, str] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        token, sep, tenant = item.partition("=")
        if not sep or not token.strip() or not tenant.strip():
            raise ValueError(f"PAYMENTS_TOKENS entry {item!r} is not token=tenant")
        tokens[token.strip()] = tenant.strip()
    return tokens


@dataclass(frozen=True)
class Settings:
    database_url: str
    tokens: dict[str, str]
    fault_injection: bool
    lease_seconds: float
    ttl_seconds: float
    outbox_worker: bool = False
    downstream_url: str = "http://127.0.0.1:8001/charges"

    @classmethod
    def from_environment(cls) -> Settings:
        database_url = os.environ.get("DATABASE_URL", "")
        if not database_url:
            raise RuntimeError(
                "DATABASE_URL is not set: run `python -m examples.payments` to get a "
                "PostgreSQL of its own, or point DATABASE_URL at yours"
            )
        return cls(
            database_url=asyncpg_dsn(database_url),
            tokens=parse_tokens(os.environ.get("PAYMENTS_TOKENS", DEFAULT_TOKENS)),
            fault_injection=os.environ.get("PAYMENTS_FAULT_INJECTION") == "1",
            lease_seconds=float(os.environ.get("IDEMPOTENCY_LEASE_SECONDS", "10")),
            ttl_seconds=float(os.environ.get("IDEMPOTENCY_TTL_SECONDS", "86400")),
            outbox_worker=os.environ.get("PAYMENTS_OUTBOX_WORKER") == "1",
            downstream_url=os.environ.get(
                "PAYMENTS_DOWNSTREAM_URL", "http://127.0.0.1:8001/charges"
            ),
        )
