"""What the package tells operators about keys outside a request's own report (see
_asgi/telemetry.py for that): how a key is named in a log line, and the count of operators'
settles and releases.

- Logs: a key is shown by `key_hash` (enough to correlate, never the key itself).
- Prometheus (with the `prometheus` extra): `idempotency_reconciliations_total{action,
  previous}`, one per settle or release (`action` "settle" or "release"; `previous` what the
  key was: a `HeldReason` value, or "completed"), in the default registry of the process
  that made the change (an application's reconciliation job or webhook; a CLI run counts in
  its own process, which nothing scrapes: its log line is its record).
"""

from __future__ import annotations

import hashlib
from typing import Any

prometheus_client: Any
try:
    import prometheus_client
except ImportError:  # pragma: no cover - the extra is optional
    prometheus_client = None


def key_hash(key: str) -> str:
    """What logs show of a key: enough to correlate, not the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


_reconciliations: Any = None


def count_reconciliation(action: str, previous: str) -> None:
    """Count one operator's settle or release (made on first use: importing the package
    registers nothing)."""
    global _reconciliations
    if prometheus_client is None:
        return
    if _reconciliations is None:
        _reconciliations = prometheus_client.Counter(
            "idempotency_reconciliations",
            "Keys settled or released by an operator, by action and what the key was.",
            ["action", "previous"],
        )
    _reconciliations.labels(action, previous).inc()
