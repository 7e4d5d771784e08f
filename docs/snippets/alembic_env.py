import asyncio
import os

from alembic import context
from app import Base
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_asgi.alembic import include_name, include_object


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        include_name=include_name,  # (1)!
        include_object=include_object,
    )
    with context.begin_transaction():
        context.run_migrations()


async def main() -> None:
    # DATABASE_URL as asyncpg takes it (postgresql://); SQLAlchemy is told the driver.
    url = os.environ["DATABASE_URL"].replace("postgresql://", "postgresql+asyncpg://")
    engine = create_async_engine(url)
    async with engine.connect() as connection:
        await connection.run_sync(run_migrations)
    await engine.dispose()


asyncio.run(main())
