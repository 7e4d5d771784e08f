"""The handler's side of the transactional mode: `await connection(request)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import HTTPConnection

from .._errors import ended
from .._keystore import RequestTransaction

#: Where the middleware puts the request's lazy transaction in the ASGI scope.
SCOPE_KEY = "idempotency_asgi._postgres.transaction"


class HandlerView:
    """The request's transaction as the application reaches it through the scope: the same,
    until the run closes it to the application (its answer is whole, and will not be
    recorded: see execution.py), which may be before the run ends the transaction itself.
    From then on `connection()` raises TransactionEnded, as after the transaction's end."""

    def __init__(self, transaction: RequestTransaction) -> None:
        self._transaction = transaction
        self.closed = False

    async def connection(self) -> Any:
        if self.closed:
            raise ended()
        return await self._transaction.connection()

    @property
    def on_commit(self) -> list[Callable[[], Any]]:
        """What runs once the transaction has committed (see aftercommit.py)."""
        return self._transaction.on_commit


async def connection(request: HTTPConnection) -> Any:
    """The asyncpg connection inside this request's transaction.

    Writes made through it commit together with the stored response, after the response is
    complete and before it is sent, or roll back with it (5xx, exception, lost lease). Use it
    as a FastAPI dependency (`Depends(connection)`) or await it in a Starlette endpoint.
    Do all writes before returning the response: the transaction ends with it.
    """
    transaction: HandlerView | None = request.scope.get(SCOPE_KEY)
    if transaction is None:
        raise RuntimeError(
            "no idempotent transaction for this request: connection(request) works only in "
            "requests that IdempotencyMiddleware runs under a key (a covered method, with an "
            "Idempotency-Key header, on a path that is not exempt)"
        )
    return await transaction.connection()
