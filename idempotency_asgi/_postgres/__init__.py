"""The store's half: the key store on PostgreSQL, through asyncpg, and nothing of ASGI.

`store.py` (PostgresStore) is the facade over one module per protocol: `claiming.py` (the
claim), `recording.py` (completion, release, renewal), `atomic.py` and `atomic_citus.py` (the
atomic mode: one transaction, one COMMIT), `transaction.py` and `lending.py` (the two-phase
mode's transaction, lent to the handler), `waiting.py` and `listener.py` (duplicates that
wait). They run on `database.py` (connections, one statement within a deadline, the
breaker of `outages.py`) and `sql/` (every statement). `schema.py`, `migrate.py` and
`distribute.py` make the tables; `consumer.py` is the idempotent message consumer.
"""
