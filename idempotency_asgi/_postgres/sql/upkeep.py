"""Maintenance, inspection and the schema's own statements (see `maintenance.py`, `_cli.py`)."""

from .rows import lease_end

_LEASE_END = lease_end("k", "$1", "$2")

# -- maintenance ---------------------------------------------------------------------------
# Both take one bounded batch, skip rows another runner holds, and re-check their condition
# on the row they delete, so that a row taken over or completed meanwhile is left alone.

REAP = """
WITH doomed AS (
    SELECT tenant_id, idempotency_key FROM idempotency_keys
    WHERE state = 'completed' AND expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_keys AS k
USING doomed AS d
WHERE k.tenant_id = d.tenant_id AND k.idempotency_key = d.idempotency_key
  AND k.state = 'completed' AND k.expires_at <= now()
"""

# The sweeper: in-flight keys whose lease (their claim's, or a renewal's: both must be long
# past) lapsed more than $2 seconds ago, with their lease rows.
SWEEP = """
WITH stale AS (
    SELECT k.tenant_id, k.idempotency_key,
           greatest(k.lease_expires_at, l.lease_expires_at) AS lease_end
    FROM idempotency_keys AS k
    LEFT JOIN idempotency_leases AS l
           ON l.tenant_id = k.tenant_id AND l.idempotency_key = k.idempotency_key
          AND l.lease_token = k.lease_token
    WHERE k.state = 'in_flight' AND k.lease_expires_at <= now() - make_interval(secs => $2)
      AND (l.lease_expires_at IS NULL OR l.lease_expires_at <= now() - make_interval(secs => $2))
    ORDER BY k.lease_expires_at
    LIMIT $1
    FOR UPDATE OF k SKIP LOCKED
),
swept AS (
    DELETE FROM idempotency_keys AS k
    USING stale AS s
    WHERE k.tenant_id = s.tenant_id AND k.idempotency_key = s.idempotency_key
      AND k.state = 'in_flight' AND k.lease_expires_at <= now() - make_interval(secs => $2)
    RETURNING k.tenant_id, k.idempotency_key, k.method, k.path, s.lease_end
),
forgotten AS (
    DELETE FROM idempotency_leases AS l
    USING swept AS s
    WHERE l.tenant_id = s.tenant_id AND l.idempotency_key = s.idempotency_key
)
SELECT tenant_id, idempotency_key, method, path,
       extract(epoch FROM now() - lease_end)::float8 AS lapsed_seconds
FROM swept
"""

# The sweeper's other half: lease rows long past their end, whatever became of their key
# (completed, released, swept, taken over). A completion leaves its lease row behind.
FORGET_LEASES = """
WITH old AS (
    SELECT tenant_id, idempotency_key FROM idempotency_leases
    WHERE lease_expires_at <= now() - make_interval(secs => $2)
    ORDER BY lease_expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_leases AS l
USING old AS o
WHERE l.tenant_id = o.tenant_id AND l.idempotency_key = o.idempotency_key
  AND l.lease_expires_at <= now() - make_interval(secs => $2)
"""

REAP_PROCESSED = """
WITH doomed AS (
    SELECT consumer, message_id FROM idempotency_processed_messages
    WHERE processed_at <= now() - make_interval(secs => $2)
    ORDER BY processed_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_processed_messages AS m
USING doomed AS d
WHERE m.consumer = d.consumer AND m.message_id = d.message_id
"""

# -- maintenance where the key table is distributed by Citus (see `_postgres/spread.py`) -----------
# Citus takes row locks (FOR UPDATE SKIP LOCKED) only in a statement routed to one shard. So
# a run first finds the tenants with work, with one read of every shard that locks nothing
# (the *_TENANTS statements), and then runs, for each of them, the statement above with the
# tenant pinned (REAP_TENANT's $2, the others' $3): routed whole to its shard, it skips
# locked rows and re-checks what it deletes, as on one server. $1 and $2 are as above.

REAP_TENANTS = """
SELECT DISTINCT tenant_id FROM idempotency_keys
WHERE state = 'completed' AND expires_at <= now()
LIMIT $1
"""

REAP_TENANT = """
WITH doomed AS (
    SELECT tenant_id, idempotency_key FROM idempotency_keys
    WHERE tenant_id = $2 AND state = 'completed' AND expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_keys AS k
USING doomed AS d
WHERE k.tenant_id = $2 AND k.tenant_id = d.tenant_id AND k.idempotency_key = d.idempotency_key
  AND k.state = 'completed' AND k.expires_at <= now()
"""

# SWEEP's test of a stale key, renewals included: a tenant whose only old keys are renewed
# (long requests, still running) has no work, and must not take a place in the LIMIT.
SWEEP_TENANTS = """
SELECT DISTINCT k.tenant_id FROM idempotency_keys AS k
LEFT JOIN idempotency_leases AS l
       ON l.tenant_id = k.tenant_id AND l.idempotency_key = k.idempotency_key
      AND l.lease_token = k.lease_token
WHERE k.state = 'in_flight' AND k.lease_expires_at <= now() - make_interval(secs => $2)
  AND (l.lease_expires_at IS NULL OR l.lease_expires_at <= now() - make_interval(secs => $2))
LIMIT $1
"""

SWEEP_TENANT = """
WITH stale AS (
    SELECT k.tenant_id, k.idempotency_key,
           greatest(k.lease_expires_at, l.lease_expires_at) AS lease_end
    FROM idempotency_keys AS k
    LEFT JOIN idempotency_leases AS l
           ON l.tenant_id = k.tenant_id AND l.idempotency_key = k.idempotency_key
          AND l.lease_token = k.lease_token AND l.tenant_id = $3
    WHERE k.tenant_id = $3
      AND k.state = 'in_flight' AND k.lease_expires_at <= now() - make_interval(secs => $2)
      AND (l.lease_expires_at IS NULL OR l.lease_expires_at <= now() - make_interval(secs => $2))
    ORDER BY k.lease_expires_at
    LIMIT $1
    FOR UPDATE OF k SKIP LOCKED
),
swept AS (
    DELETE FROM idempotency_keys AS k
    USING stale AS s
    WHERE k.tenant_id = $3 AND k.tenant_id = s.tenant_id AND k.idempotency_key = s.idempotency_key
      AND k.state = 'in_flight' AND k.lease_expires_at <= now() - make_interval(secs => $2)
    RETURNING k.tenant_id, k.idempotency_key, k.method, k.path, s.lease_end
),
forgotten AS (
    DELETE FROM idempotency_leases AS l
    USING swept AS s
    WHERE l.tenant_id = $3 AND l.tenant_id = s.tenant_id
      AND l.idempotency_key = s.idempotency_key
)
SELECT tenant_id, idempotency_key, method, path,
       extract(epoch FROM now() - lease_end)::float8 AS lapsed_seconds
FROM swept
"""

FORGET_TENANTS = """
SELECT DISTINCT tenant_id FROM idempotency_leases
WHERE lease_expires_at <= now() - make_interval(secs => $2)
LIMIT $1
"""

FORGET_TENANT = """
WITH old AS (
    SELECT tenant_id, idempotency_key FROM idempotency_leases
    WHERE tenant_id = $3 AND lease_expires_at <= now() - make_interval(secs => $2)
    ORDER BY lease_expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_leases AS l
USING old AS o
WHERE l.tenant_id = $3 AND l.tenant_id = o.tenant_id AND l.idempotency_key = o.idempotency_key
  AND l.lease_expires_at <= now() - make_interval(secs => $2)
"""

# The consumer's records have no tenant (they are distributed by message id, one shard per
# message): one statement over every shard, with no row locks (none would be taken), each
# row's age checked again as it is deleted. Two runners at once may wait for each other's
# rows; the maintenance runner is one (see maintenance.py). A message id that several
# consumers recorded is deleted for each of them whose record is old enough, so a run may
# delete a few more rows than its batch.
REAP_PROCESSED_SPREAD = """
DELETE FROM idempotency_processed_messages
WHERE message_id IN (
    SELECT message_id FROM idempotency_processed_messages
    WHERE processed_at <= now() - make_interval(secs => $2)
    ORDER BY processed_at
    LIMIT $1
)
AND processed_at <= now() - make_interval(secs => $2)
"""

# What `stats` reports as the table's size on Citus: its shards', on every worker.
TABLE_BYTES_SPREAD = "SELECT citus_total_relation_size('idempotency_keys')"

INSPECT = f"""
SELECT tenant_id, idempotency_key, method, path, encode(fingerprint, 'hex') AS fingerprint,
       state, lease_token, {_LEASE_END} AS lease_expires_at,
       state = 'in_flight' AND {_LEASE_END} > now() AS lease_live, held_reason,
       format_version, response_status, octet_length(response_body) AS response_bytes,
       created_at, completed_at, expires_at
FROM idempotency_keys AS k
WHERE tenant_id = $1 AND idempotency_key = $2
"""

STATS = """
SELECT
    count(*) FILTER (WHERE state = 'completed') AS completed,
    count(*) FILTER (WHERE state = 'in_flight') AS in_flight,
    count(*) FILTER (WHERE state = 'in_flight' AND lease_expires_at <= now() AND NOT EXISTS (
        SELECT 1 FROM idempotency_leases AS l
        WHERE l.tenant_id = k.tenant_id AND l.idempotency_key = k.idempotency_key
          AND l.lease_token = k.lease_token AND l.lease_expires_at > now())) AS lapsed,
    count(*) FILTER (WHERE state = 'completed' AND expires_at <= now()) AS expired_waiting,
    min(created_at) FILTER (WHERE state = 'in_flight') AS oldest_in_flight,
    count(*) FILTER (WHERE state = 'in_flight' AND held_reason IS NOT NULL) AS held,
    min(created_at) FILTER (WHERE state = 'in_flight' AND held_reason IS NOT NULL)
        AS oldest_held,
    pg_total_relation_size('idempotency_keys') AS table_bytes
FROM idempotency_keys AS k
"""

# Each table's schema-qualified name, or NULL when it is not there. COMPLETE runs on a
# handler's connection too, whose search_path is the handler's to change (a schema per
# tenant, say): there it names its tables this way.
TABLE_NAMES = """
SELECT (SELECT format('%I.%I', n.nspname, c.relname)
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE c.oid = to_regclass('idempotency_keys')) AS keys,
       (SELECT format('%I.%I', n.nspname, c.relname)
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE c.oid = to_regclass('idempotency_leases')) AS leases,
       current_setting('default_transaction_isolation') AS isolation
"""


def qualified(statement: str, keys: str, leases: str) -> str:
    """`statement` with the two tables named as `keys` and `leases` (from TABLE_NAMES)."""
    return statement.replace("idempotency_keys", keys).replace("idempotency_leases", leases)


# Whether the schema is there at all (to_regclass answers NULL, where a SELECT would fail).
SCHEMA_TABLES = """
SELECT to_regclass('idempotency_keys') IS NOT NULL AS has_keys,
       to_regclass('idempotency_asgi_version') IS NOT NULL AS has_versions
"""
SCHEMA_VERSION = "SELECT version_num FROM idempotency_asgi_version"

# Whether Citus is there, and (only then: the catalog table exists with it) whether it
# distributes the key table: read once when the store opens (see `_database.Database`).
HAS_CITUS = "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')"
# NULL while there is no key table; true for a table whose rows live on workers: distributed
# by hash, or a single-shard distributed table (schema-based sharding). Not for a reference
# table (replicated, 't') or a local table Citus manages (no co-location group): those are
# read on whichever node a statement reaches.
KEYS_DISTRIBUTED = """
SELECT CASE WHEN to_regclass('idempotency_keys') IS NOT NULL THEN EXISTS (
    SELECT 1 FROM pg_dist_partition
    WHERE logicalrelid = to_regclass('idempotency_keys')
      AND (partmethod = 'h' OR (partmethod = 'n' AND repmodel <> 't' AND colocationid <> 0))
) END
"""

# Held by the one runner of the background maintenance among many workers (session-scoped;
# released when its connection closes or is reset, so a dead runner is replaced).
MAINTENANCE_LOCK = "SELECT pg_try_advisory_lock($1)"
