import os
import secrets
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, FastAPI
from pydantic import BaseModel
from sqlalchemy import String, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from idempotency_asgi.fastapi import Session

DATABASE_URL = os.environ["DATABASE_URL"]
API_KEYS = {"sk_test_acme": "acme"}


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


class Base(DeclarativeBase):
    pass


class Payment(Base):
    __tablename__ = "payments"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    amount: Mapped[int]
    currency: Mapped[str] = mapped_column(String(3))


class PaymentIn(BaseModel):
    amount: int
    currency: str


app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware, store=PostgresStore(DATABASE_URL), tenant=tenant
)
# The application's own engine, as before.
engine = create_async_engine(
    DATABASE_URL.replace("postgresql://", "postgresql+asyncpg://", 1)
)
sessions = async_sessionmaker(engine, expire_on_commit=False)


# start: migrating
async def get_session() -> AsyncIterator[AsyncSession]:  # the dependency you had
    async with sessions() as session:
        yield session


@app.get("/payments/{payment_id}")  # reads, admin routes, workers: your own session
async def read_payment(
    payment_id: str, db: Annotated[AsyncSession, Depends(get_session)]
):
    found = await db.scalar(select(Payment).where(Payment.id == payment_id))
    return {"id": found.id, "amount": found.amount} if found else None


@app.post("/payments", status_code=201)  # a keyed write: the request's session, only
async def create_payment(payment: PaymentIn, session: Session):
    made = Payment(id=f"pay_{secrets.token_hex(8)}", **payment.model_dump())
    session.add(made)
    await session.commit()  # a savepoint: commits with the key's record
    return {"id": made.id, "amount": made.amount}


# end: migrating
