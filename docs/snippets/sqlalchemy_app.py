import os
import secrets
from datetime import datetime

from fastapi import FastAPI
from pydantic import BaseModel
from sqlalchemy import DateTime, String, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from starlette.types import Scope

from idempotency_asgi import IdempotencyMiddleware, PostgresStore
from idempotency_asgi.fastapi import Session

DATABASE_URL = os.environ["DATABASE_URL"]
API_KEYS = {"sk_test_acme": "acme"}


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


# start: models
class Base(DeclarativeBase):
    pass


class Payment(Base):
    __tablename__ = "payments"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    amount: Mapped[int]
    currency: Mapped[str] = mapped_column(String(3))
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )


class OutboxEvent(Base):
    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(primary_key=True)
    event: Mapped[dict[str, object]] = mapped_column(JSONB)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


# end: models
class PaymentIn(BaseModel):
    amount: int
    currency: str


app = FastAPI()
# start: handler
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore(DATABASE_URL),
    tenant=tenant,
    atomic=True,  # (1)!
)


@app.post("/payments", status_code=201)
async def create_payment(payment: PaymentIn, session: Session):  # (2)!
    made = Payment(id=f"pay_{secrets.token_hex(8)}", **payment.model_dump())
    session.add(made)
    session.add(OutboxEvent(event={"type": "payment.created", "id": made.id}))
    await session.commit()  # (3)!
    await session.refresh(made)
    return {"id": made.id, "amount": made.amount, "created_at": made.created_at}


# end: handler
