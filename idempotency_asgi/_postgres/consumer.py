"""The idempotent consumer: process each at-least-once message exactly once in effect.

A queue, a webhook sender or an outbox worker may deliver the same message twice, or twice at
once. `IdempotentConsumer.process` runs the handler inside a transaction that first inserts the
message's dedup record; the handler's writes and that record commit or roll back together.

- First delivery: the record is inserted, the handler runs, both commit.
- Redelivery after that: the insert conflicts; the handler does not run; the stored result of
  the first run is returned.
- Concurrent deliveries: the second insert waits on the first's uncommitted row (PostgreSQL's
  unique check does that); when the first commits it conflicts as above, and if the first
  rolls back it goes ahead and runs the handler itself. No lock is held outside that one row.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

_RECORD = """
INSERT INTO idempotency_processed_messages (consumer, message_id)
VALUES ($1, $2)
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING 1
"""

_RESULT = """
UPDATE idempotency_processed_messages SET result = $3
WHERE consumer = $1 AND message_id = $2
"""

_STORED = """
SELECT result FROM idempotency_processed_messages WHERE consumer = $1 AND message_id = $2
"""


@dataclass(frozen=True)
class Processed:
    """What `IdempotentConsumer.process` did with a message."""

    #: False when the message had been processed before and the handler did not run
    first: bool
    #: the bytes the handler returned on its (only) run
    result: bytes | None


class IdempotentConsumer:
    """`IdempotentConsumer(pool, name="provider")`; then `await consumer.process(id, handler)`
    with `async def handler(conn) -> bytes | None` doing its writes on `conn`."""

    def __init__(self, pool: asyncpg.Pool, *, name: str) -> None:
        self._pool = pool
        self.name = name

    async def process(
        self, message_id: str, handler: Callable[[Any], Awaitable[bytes | None]]
    ) -> Processed:
        """Run `handler(conn)` once for `message_id`, in one transaction with the message's
        dedup record; a redelivery gets the first run's result without running it."""
        async with self._pool.acquire() as conn, conn.transaction():
            if await conn.fetchval(_RECORD, self.name, message_id) is None:
                stored = await conn.fetchval(_STORED, self.name, message_id)
                return Processed(first=False, result=stored)
            result = await handler(conn)
            if result is not None:
                await conn.execute(_RESULT, self.name, message_id, result)
            return Processed(first=True, result=result)
