"""What the middleware tells operators: a log line, metrics and span attributes per request.

Each keyed request is reported once, with its settlement (see settlement.py), which names
its outcome and log level: `new` (ran and recorded), `replay`, `conflict` (409 in flight),
`mismatch` (422), `released` (5xx or error: key freed), `takeover`, `lease_lost`,
`store_error` (503, or 500 when the store refused), `not_replayable`, `over_limit` (429),
`outcome_unknown` (504: the app could not tell), `rejected` (400/401/413 before anything was
reserved), `tenant_error` (500: the application's tenant resolver failed).

- Logs: logger `idempotency_asgi`, one line per request, `key=value` pairs with the outcome,
  the settlement (`case`), the tenant and a hash of the key (never the key, never a body);
  the same fields in the record's `extra`.
- Prometheus (when `prometheus_client` is installed: the `prometheus` extra):
  `idempotency_requests_total{outcome}` and `idempotency_request_duration_seconds{outcome}`
  (time spent in the middleware, the application's run included), in the default registry.
- OpenTelemetry (when `opentelemetry-api` is installed): attributes `idempotency.outcome`,
  `idempotency.tenant`, `idempotency.key_hash` and `idempotency.replayed` on the current span.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import Send

from .._reporting import key_hash
from ..problems import Problem
from .settlement import Settlement

logger = logging.getLogger("idempotency_asgi")

prometheus_client: Any
trace: Any
try:
    import prometheus_client
except ImportError:  # pragma: no cover - the extra is optional
    prometheus_client = None
try:
    from opentelemetry import trace
except ImportError:  # pragma: no cover - optional
    trace = None


class _Prometheus:
    """The two metric families, with each outcome's children looked up once."""

    def __init__(self) -> None:
        self.requests = prometheus_client.Counter(
            "idempotency_requests", "Keyed requests by outcome.", ["outcome"]
        )
        self.duration = prometheus_client.Histogram(
            "idempotency_request_duration_seconds",
            "Time in the idempotency middleware by outcome, the application's run included.",
            ["outcome"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self._children: dict[str, tuple[Any, Any]] = {}

    def observe(self, outcome: str, seconds: float) -> None:
        children = self._children.get(outcome)
        if children is None:
            children = (self.requests.labels(outcome), self.duration.labels(outcome))
            self._children[outcome] = children
        children[0].inc()
        children[1].observe(seconds)


_metrics: _Prometheus | None = None


def _prometheus() -> _Prometheus | None:
    global _metrics
    if _metrics is None and prometheus_client is not None:
        _metrics = _Prometheus()
    return _metrics


class RequestTelemetry:
    """The outcome reporter of one keyed request."""

    __slots__ = ("_key", "_method", "_path", "_started", "_tenant")

    def __init__(self, *, tenant: str | None, key: str | None, method: str, path: str) -> None:
        self._tenant = tenant
        self._key = key
        self._method = method
        self._path = path
        self._started = time.perf_counter()

    async def answer(
        self, send: Send, settlement: Settlement, problem: Problem, error: object = None
    ) -> None:
        """Report the settlement, then send its problem answer."""
        self(settlement, problem.status, error)
        await problem.send(send)

    @property
    def _key_hash(self) -> str:
        # Computed only for a log line or a span that is actually recorded.
        return "-" if self._key is None else key_hash(self._key)

    def __call__(self, settlement: Settlement, status: int, error: object = None) -> None:
        """Report how the request ended; `error`, when one decided it, ends the log line (the
        one line the request gets, whatever went wrong)."""
        duration = time.perf_counter() - self._started
        outcome, level = settlement.outcome, settlement.level
        if logger.isEnabledFor(level):
            fields: dict[str, object] = {
                "outcome": outcome,
                "case": settlement.name.lower(),
                "tenant": self._tenant,
                "key_hash": self._key_hash,
                "method": self._method,
                "path": self._path,
                "status": status,
                "duration_ms": round(duration * 1000, 2),
            }
            # A fault in the application's code (its tenant resolver) is found by its
            # traceback; the store's and the network's failures are told by their error.
            traced = (
                error if settlement.case.traceback and isinstance(error, BaseException) else None
            )
            if error is not None:
                fields["error"] = error if traced is None else repr(error)
            logger.log(
                level,
                "idempotency " + " ".join(f"{name}={value}" for name, value in fields.items()),
                extra={"idempotency": fields},
                exc_info=traced,
            )
        metrics = _prometheus()
        if metrics is not None:
            metrics.observe(outcome, duration)
        if trace is not None:
            span = trace.get_current_span()
            if span.is_recording():
                span.set_attributes(
                    {
                        "idempotency.outcome": outcome,
                        "idempotency.tenant": self._tenant or "",
                        "idempotency.key_hash": self._key_hash,
                        "idempotency.replayed": outcome == "replay",
                    }
                )
