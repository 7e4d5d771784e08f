import asyncpg

from idempotency_asgi import IdempotentConsumer, Processed


async def handle_charge(pool: asyncpg.Pool, message_id: str, amount: int) -> Processed:
    consumer = IdempotentConsumer(pool, name="charges")

    async def book(conn: asyncpg.Connection) -> bytes | None:  # once per message id
        charge_id = await conn.fetchval(
            "INSERT INTO charges (reference, amount) VALUES ($1, $2)"
            " RETURNING reference",
            message_id,
            amount,
        )
        return f'{{"charge_id": "{charge_id}"}}'.encode()  # kept for redeliveries

    return await consumer.process(message_id, book)  # .first: False for a redelivery
