import os

from idempotency_asgi import PostgresStore
from idempotency_asgi.gateway import build_gateway, tenant_from_header

# --8<-- [start:options]
app = build_gateway(
    os.environ["UPSTREAM_URL"],  # the upstream, e.g. http://127.0.0.1:9000 (a path prefix is kept)
    store=PostgresStore(os.environ["DATABASE_URL"]),  # or the URL itself
    tenant=tenant_from_header("X-Consumer-Id"),  # or tenant_from_credential("authorization"),
    #                                              or any callable(scope) -> str | None
    client_timeout=30.0,  # from forwarding (body read, key claimed): a client waits this
    #                       long for its answer
    upstream_timeout=120.0,  # longest silence from the upstream on a keyed request
    exchange_timeout=300.0,  # longest a keyed request may take upstream in all
    connect_timeout=5.0,  # connecting, or waiting for a free connection
    body_timeout=30.0,  # longest pause within a request body (408)
    body_deadline=60.0,  # longest a whole request body may take (408)
    send_timeout=30.0,  # longest a response waits for a client that does not read it
    #                     (then the client is let go)
    request_buffer_bytes=64 * 1024,  # a body is held in memory up to this, then in a file
    request_spool_bytes=64 * 1024 * 1024,  # read whole, up to this, before an upstream
    #                                        connection is taken (413 past it; 0: stream)
    response_buffer_bytes=256 * 1024,  # an answer the client has not taken: in memory,
    response_spool_bytes=1024 * 1024 * 1024,  # then in a file up to this
    unverified_statuses=(),  # with tenant_from_credential: stored before the upstream
    #                          answered the tenant a 2xx (others free the key)
    max_header_bytes=32 * 1024,  # a larger header section gets 431
    max_header_count=100,  # more header fields get 431
    keepalive_expiry=4.0,  # below the upstream's keep-alive timeout (Node: 5 s)
    max_connections=100,  # upstream connections per process
    preserve_host=False,  # True: send the client's Host, not the upstream's
    trust_forwarded=False,  # True: keep X-Forwarded-Proto/-Host, Forwarded, X-Real-IP,
    #                         X-Forwarded-Port/-Prefix from a proxy in front
    health_path="/_idempotency/health",  # the gateway's own, whatever methods covers:
    #                                      GET/HEAD 200, else 405; never forwarded
    apply_schema=True,  # bring the key table up to date at startup
    maintenance=None,  # BackgroundMaintenance(Reaper(store), Sweeper(store)); the command
    #                    runs it by default
    # The middleware's options, with the gateway's own defaults (see Configuration):
    require_key=False,  # keys optional by default in front of an existing API
    release_statuses={401, 403, 408, 425, 429},  # these (and any 5xx) free the key
    max_keys_per_tenant=100_000,  # new keys past this many stored per tenant: 429
    # ... and methods, required_paths, exempt_paths, lease_seconds, ttl_seconds,
    # max_body_bytes, max_stored_response_bytes, excluded_headers, fingerprint_headers,
    # wait_seconds, max_in_flight_per_tenant, www_authenticate, or config=IdempotencyConfig()
)
# --8<-- [end:options]
