"""The idempotent consumer: every message delivered twice, concurrently; one effect each."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from idempotency_asgi import IdempotentConsumer


@pytest.fixture
async def ledger(db):
    await db.execute(
        "CREATE TABLE IF NOT EXISTS consumer_effects ("
        " id bigserial PRIMARY KEY, consumer text NOT NULL, message_id text NOT NULL)"
    )
    return db


def handler_for(consumer: IdempotentConsumer, message_id: str, delay: float = 0.0):
    async def handle(conn):
        await conn.execute(
            "INSERT INTO consumer_effects (consumer, message_id) VALUES ($1, $2)",
            consumer.name,
            message_id,
        )
        await asyncio.sleep(delay)
        return f"done:{message_id}".encode()

    return handle


async def test_each_message_delivered_twice_concurrently_has_one_effect(ledger):
    consumer = IdempotentConsumer(ledger, name=f"c-{uuid.uuid4().hex[:8]}")
    ids = [f"evt-{n}" for n in range(30)]
    results = await asyncio.gather(
        *(
            consumer.process(message_id, handler_for(consumer, message_id, delay=0.01))
            for message_id in ids
            for _ in range(2)
        )
    )
    rows = await ledger.fetch(
        "SELECT message_id, count(*) AS n FROM consumer_effects WHERE consumer = $1"
        " GROUP BY message_id",
        consumer.name,
    )
    assert {row["message_id"]: row["n"] for row in rows} == dict.fromkeys(ids, 1)
    assert sum(result.first for result in results) == len(ids)
    # The duplicate gets the first run's result back.
    assert {result.result for result in results} == {f"done:{m}".encode() for m in ids}


async def test_a_failed_first_run_leaves_no_record_and_the_redelivery_runs(ledger):
    consumer = IdempotentConsumer(ledger, name=f"c-{uuid.uuid4().hex[:8]}")

    async def failing(conn):
        await conn.execute(
            "INSERT INTO consumer_effects (consumer, message_id) VALUES ($1, 'm')", consumer.name
        )
        raise RuntimeError("downstream of the consumer failed")

    with pytest.raises(RuntimeError):
        await consumer.process("m", failing)
    again = await consumer.process("m", handler_for(consumer, "m"))
    assert again.first and again.result == b"done:m"
    count = await ledger.fetchval(
        "SELECT count(*) FROM consumer_effects WHERE consumer = $1", consumer.name
    )
    assert count == 1


async def test_consumers_are_independent(ledger):
    first = IdempotentConsumer(ledger, name=f"a-{uuid.uuid4().hex[:8]}")
    second = IdempotentConsumer(ledger, name=f"b-{uuid.uuid4().hex[:8]}")
    assert (await first.process("same", handler_for(first, "same"))).first
    assert (await second.process("same", handler_for(second, "same"))).first
    assert not (await first.process("same", handler_for(first, "same"))).first
