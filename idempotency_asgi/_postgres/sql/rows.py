"""Fragments the protocols' statements share: a new key row, and a key's row as every read of
one answers it (what `_claiming.judge` reads).

A statement about one key's in-flight row says so with `completed_at IS NULL`, never with
`state = 'in_flight'`: the latter lets the planner pick the small in-flight index, which has
only tenant_id in front of the key, and walk every in-flight entry of the tenant (dead ones
too, until vacuum) instead of probing the primary key. The schema keeps the two equivalent
(a CHECK constraint): a row is completed exactly when it has a completion time.
"""

# A new key's row, as the INSERT's column list and its values ($1 tenant, $2 key, $3 method,
# $4 path, $5 fingerprint, $6 lease token, $7 lease seconds, $8 retention seconds, $9 the
# stored-response format).
NEW_ROW_COLUMNS = """
        tenant_id, idempotency_key, method, path, fingerprint, state,
        lease_token, lease_expires_at, format_version, expires_at"""
NEW_ROW_VALUES = """
        $1, $2, $3, $4, $5, 'in_flight',
        $6, now() + make_interval(secs => $7), $9, now() + make_interval(secs => $8)"""


def lease_end(k: str, tenant: str, key: str) -> str:
    """When the lease of in-flight row `k` (of `tenant`, `key`) ends: its claim's, or a
    renewal's (renewals go to idempotency_leases, never to the key row: see recording.py)."""
    return f"""greatest({k}.lease_expires_at, (
    SELECT l.lease_expires_at FROM idempotency_leases AS l
    WHERE l.tenant_id = {tenant} AND l.idempotency_key = {key}
      AND l.lease_token = {k}.lease_token))"""


def found_row(k: str, tenant: str, key: str, fingerprint: str) -> str:
    """What a read of one key answers when its row `k` is there: its state, whether it holds
    the same request, its lease, and its stored response only when the fingerprints match (a
    mismatch need not carry a body over the wire)."""
    same = f"{k}.fingerprint = {fingerprint}"
    return f"""false AS claimed, {k}.state, {same} AS same_request, {k}.lease_token,
       CASE WHEN {k}.state = 'in_flight'
            THEN extract(epoch FROM {lease_end(k, tenant, key)} - now())::float8
       END AS lease_remaining,
       {k}.expires_at <= now() AS expired,
       {k}.format_version, {k}.response_status,
       CASE WHEN {same} THEN {k}.response_headers END AS response_headers,
       CASE WHEN {same} THEN {k}.response_body END AS response_body,
       {k}.expires_at, extract(epoch FROM now() - {k}.created_at)::float8 AS running_for,
       NULL::tid AS row_id"""


def no_row(claimed: str, state: str, row_id: str = "NULL") -> str:
    """The same columns when there is no row to show: `claimed` (true: this statement made
    it) and a `state` that says why ('locked': an atomic transaction holds the key; 'absent':
    nobody has it); `row_id`, the ctid of the row a claim made (see
    recording.COMPLETE_BY_ROW)."""
    return f"""{claimed} AS claimed, {state}::text AS state, NULL::boolean AS same_request,
       NULL::bigint AS lease_token, NULL::float8 AS lease_remaining, NULL::boolean AS expired,
       NULL::smallint AS format_version, NULL::smallint AS response_status,
       NULL::bytea AS response_headers, NULL::bytea AS response_body,
       NULL::timestamptz AS expires_at, NULL::float8 AS running_for,
       {row_id}::tid AS row_id"""
