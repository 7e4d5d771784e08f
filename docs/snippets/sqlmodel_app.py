import os
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlmodel import Field, SQLModel, select
from sqlmodel.ext.asyncio.session import AsyncSession
from starlette.types import Scope

import idempotency_asgi.sqlalchemy
from idempotency_asgi import IdempotencyMiddleware, PostgresStore

DATABASE_URL = os.environ["DATABASE_URL"]
API_KEYS = {"sk_test_acme": "acme"}


def tenant(scope: Scope) -> str | None:
    token = dict(scope["headers"]).get(b"authorization", b"")
    return API_KEYS.get(token.removeprefix(b"Bearer ").decode("latin-1"))


class Hero(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True)
    secret_name: str


# start: sqlmodel
idempotency_asgi.sqlalchemy.configure(  # (1)!
    async_sessionmaker(class_=AsyncSession, expire_on_commit=False)
)
HeroSession = Annotated[  # (2)!
    AsyncSession, Depends(idempotency_asgi.sqlalchemy.request_session)
]

app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware, store=PostgresStore(DATABASE_URL), tenant=tenant
)


@app.post("/heroes", status_code=201)
async def create_hero(hero: Hero, session: HeroSession) -> Hero:
    taken = await session.exec(select(Hero).where(Hero.name == hero.name))
    if taken.first() is not None:
        raise HTTPException(409, "a hero with this name exists")
    session.add(hero)
    await session.commit()
    await session.refresh(hero)
    return hero


# end: sqlmodel
