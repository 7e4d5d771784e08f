"""The store's statements, one module per protocol: `claiming` (reserve a key, or read what
holds it), `recording` (complete, release, renew), `atomic` (the one-transaction mode),
`waiting` (duplicates that wait), `upkeep` (maintenance, inspection, the schema), `session`
(connections lent to handlers).

Every statement filters by tenant_id first, so that the key table can be distributed by
tenant (see docs/scaling-out.md), and every one that changes a claimed row is fenced by the
lease token (docs/how-it-works.md; what each outcome answers is docs/contract.md). All of them
are named here too, for the audits that read every statement the package runs.
"""

from .atomic import COUNT_KEYS, HOLD, KEY_ROW, LOCK_KEY, READ, RECORD, begin_locked
from .claiming import (
    CLAIM,
    CLAIM_BOUNDED,
    CLAIM_CAPPED,
    CLAIM_MANY,
    INSERT_KEY,
    LOOK_BOUNDED,
    LOOK_CAPPED,
    PEEK,
    PEEK_MANY,
    TAKE_OVER,
)
from .recording import (
    COMPLETE,
    COMPLETE_MANY,
    HOLDS,
    RELEASE,
    RELEASE_MANY,
    RENEW,
    RENEW_MANY,
)
from .session import COMMIT_AND_RESET, RESET_SESSION
from .upkeep import (
    FORGET_LEASES,
    FORGET_TENANT,
    FORGET_TENANTS,
    HAS_CITUS,
    INSPECT,
    KEYS_DISTRIBUTED,
    MAINTENANCE_LOCK,
    REAP,
    REAP_PROCESSED,
    REAP_PROCESSED_SPREAD,
    REAP_TENANT,
    REAP_TENANTS,
    SCHEMA_TABLES,
    SCHEMA_VERSION,
    STATS,
    SWEEP,
    SWEEP_TENANT,
    SWEEP_TENANTS,
    TABLE_BYTES_SPREAD,
    TABLE_NAMES,
    qualified,
)
from .waiting import CHANNEL, LOCK_FREE, MARK_WAITING

__all__ = [
    "CHANNEL",
    "CLAIM",
    "CLAIM_BOUNDED",
    "CLAIM_CAPPED",
    "CLAIM_MANY",
    "COMMIT_AND_RESET",
    "COMPLETE",
    "COMPLETE_MANY",
    "COUNT_KEYS",
    "FORGET_LEASES",
    "FORGET_TENANT",
    "FORGET_TENANTS",
    "HAS_CITUS",
    "HOLD",
    "HOLDS",
    "INSERT_KEY",
    "INSPECT",
    "KEY_ROW",
    "KEYS_DISTRIBUTED",
    "LOCK_FREE",
    "LOCK_KEY",
    "LOOK_BOUNDED",
    "LOOK_CAPPED",
    "MAINTENANCE_LOCK",
    "MARK_WAITING",
    "PEEK",
    "PEEK_MANY",
    "READ",
    "REAP",
    "REAP_PROCESSED",
    "REAP_PROCESSED_SPREAD",
    "REAP_TENANT",
    "REAP_TENANTS",
    "RECORD",
    "RELEASE",
    "RELEASE_MANY",
    "RENEW",
    "RENEW_MANY",
    "RESET_SESSION",
    "SCHEMA_TABLES",
    "SCHEMA_VERSION",
    "STATS",
    "SWEEP",
    "SWEEP_TENANT",
    "SWEEP_TENANTS",
    "TABLE_BYTES_SPREAD",
    "TABLE_NAMES",
    "TAKE_OVER",
    "begin_locked",
    "qualified",
]
