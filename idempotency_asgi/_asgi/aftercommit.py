"""What runs once the request's transaction has really committed: `after_commit(request, fn)`.

A handler's effects outside the database (an e-mail, an event on a queue, a call to another
service) must not happen for a transaction that rolls back, and must not happen twice. A
callback scheduled here runs once, after the COMMIT that made the request's writes and its
key's record durable, and after the answer was sent; never when the transaction rolls back
(a 5xx, an exception, a lost lease), never for a replay, never for an answer recorded on its
own after the transaction failed. A callback that raises is logged and changes nothing else.

Where a crash between the COMMIT and the callback would lose the effect, write an outbox row
in the transaction instead and deliver it from a worker (the example payments API does):
`after_commit` is at most once, the outbox at least once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import HTTPConnection

from .._callbacks import run
from .context import SCOPE_KEY, HandlerView

__all__ = ["after_commit", "run"]


def after_commit(request: HTTPConnection, callback: Callable[[], Any]) -> None:
    """Run `callback` (a function of no arguments, sync or async) once this request's
    transaction has committed, after its answer is sent; never if it rolls back. Works in
    every mode, in any keyed request the middleware runs (use `functools.partial` to pass
    arguments). The request's SQLAlchemy session's `after_commit` listeners are held for the
    same moment (see idempotency_asgi.sqlalchemy)."""
    transaction: HandlerView | None = request.scope.get(SCOPE_KEY)
    if transaction is None:
        raise RuntimeError(
            "no idempotent transaction for this request: after_commit(request, ...) works only "
            "in requests that IdempotencyMiddleware runs under a key"
        )
    transaction.on_commit.append(callback)
