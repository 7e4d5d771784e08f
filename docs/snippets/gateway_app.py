import os

from idempotency_asgi import PostgresStore
from idempotency_asgi.gateway import build_gateway, tenant_from_header

# start: options
app = build_gateway(
    os.environ["UPSTREAM_URL"],  # e.g. http://127.0.0.1:9000 (a path prefix is kept)
    store=PostgresStore(os.environ["DATABASE_URL"]),  # or the URL itself
    tenant=tenant_from_header("X-Consumer-Id"),  # (1)!
    client_timeout=30.0,  # from forwarding: a client waits this long for its answer
    upstream_timeout=120.0,  # longest silence from the upstream on a keyed request
    exchange_timeout=300.0,  # longest a keyed request may take upstream in all
    connect_timeout=5.0,  # connecting, or waiting for a free connection
    body_timeout=30.0,  # longest pause within a request body (408)
    body_deadline=60.0,  # longest a whole request body may take (408)
    send_timeout=30.0,  # longest a response waits for a client that does not read it
    request_buffer_bytes=64 * 1024,  # (2)!
    request_spool_bytes=64 * 1024 * 1024,  # then in a file up to this (413 past it)
    response_buffer_bytes=256 * 1024,  # an answer not yet taken: in memory up to this,
    response_spool_bytes=1024 * 1024 * 1024,  # then in a file up to this
    spool_disk_bytes=2 * 1024 * 1024 * 1024,  # all of a process's temporary files
    unverified_statuses=(),  # stored for a tenant the upstream never answered 2xx
    max_header_bytes=32 * 1024,  # a larger header section gets 431
    max_header_count=100,  # more header fields get 431
    keepalive_expiry=4.0,  # below the upstream's keep-alive timeout (Node: 5 s)
    max_connections=100,  # upstream connections per process
    preserve_host=False,  # True: send the client's Host, not the upstream's
    trust_forwarded=False,  # (3)!
    health_path="/_idempotency/health",  # (4)!
    apply_schema=True,  # bring the key table up to date at startup
    maintenance=None,  # (5)!
    # The middleware's options, with the gateway's own defaults (see Configuration):
    require_key=False,  # keys optional by default in front of an existing API
    release_statuses={401, 403, 408, 425, 429},  # these (and any 5xx) free the key
    max_keys_per_tenant=100_000,  # new keys past this many stored per tenant: 429
    # ... and every other option of the middleware: see Configuration
)
# end: options
