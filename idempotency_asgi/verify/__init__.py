"""`idempotency-asgi verify`: check a deployed service against the Idempotency-Key contract,
over real HTTP, from the outside.

    from idempotency_asgi.verify import Target, verify

    report = await verify(Target("https://staging.example.com/payments",
                                 headers=(("Authorization", "Bearer ..."),),
                                 body='{"amount": 100, "currency": "EUR"}'))
    report.exit_status, report.finding("replay-identical").status, report.json()

It needs httpx (`pip install 'idempotency-asgi[verify]'`). The names load on first use, so
that the other commands work without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .conformance import verify
    from .report import Exchange, Finding, Report, Source, Status
    from .sender import VerifyError
    from .target import DEFAULT_MARKER, PLACEHOLDER, Target

__all__ = [
    "DEFAULT_MARKER",
    "PLACEHOLDER",
    "Exchange",
    "Finding",
    "Report",
    "Source",
    "Status",
    "Target",
    "VerifyError",
    "verify",
]

_HOMES = {
    "DEFAULT_MARKER": "target",
    "PLACEHOLDER": "target",
    "Exchange": "report",
    "Finding": "report",
    "Report": "report",
    "Source": "report",
    "Status": "report",
    "Target": "target",
    "VerifyError": "sender",
    "verify": "conformance",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
