"""SQLAlchemy on the request's connection (see `idempotency_asgi.sqlalchemy`): the driver
adapter SQLAlchemy is handed in place of the lent asyncpg connection (`driver.py`), and the
engine that makes sessions on it without a pool of SQLAlchemy's own (`engine.py`)."""
