"""Running the callbacks an application scheduled for after its request's transaction commits
(`after_commit`, a SQLAlchemy session's `after_commit` listeners): whoever learns of the COMMIT
runs them, the middleware as a rule, the store for a COMMIT that landed after its request was
answered."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("idempotency_asgi")


async def run(callbacks: Sequence[Callable[[], Any]]) -> None:
    """Run the callbacks in the order they were scheduled; one that fails is logged."""
    for callback in callbacks:
        try:
            result = callback()
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("an after-commit callback failed: %r", callback)
