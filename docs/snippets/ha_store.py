from idempotency_asgi import PostgresStore

# Both servers, in order: asyncpg keeps the first that accepts writes, and after a
# failover new connections find the promoted standby. Point your own pool at both.
store = PostgresStore(
    "postgresql://app@db1:5432,db2:5432/payments?target_session_attrs=read-write"
)
